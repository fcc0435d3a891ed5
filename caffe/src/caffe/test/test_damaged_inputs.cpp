// COMET-Caffe: damaged inputs are named. LMDBs are read whole or refused (patch 0032,
// util/lmdb_check.cpp): a data file cut short used to open and kill training with SIGBUS at the
// first read past its end; a record that does not parse as a Datum used to be read as an empty
// one. A proto file that cannot be read says which file and what it should hold (patch 0033).
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "boost/scoped_ptr.hpp"
#include "gtest/gtest.h"

#include "caffe/blob.hpp"
#include "caffe/common.hpp"
#include "caffe/layers/data_layer.hpp"
#include "caffe/proto/caffe.pb.h"
#include "caffe/util/db.hpp"
#include "caffe/util/format.hpp"
#include "caffe/util/io.hpp"
#ifdef USE_LMDB
#include "caffe/util/lmdb_check.hpp"
#endif

#include "caffe/test/test_caffe_main.hpp"

namespace caffe {

using boost::scoped_ptr;

// The mean file of a data layer, cut short: upstream said only "Check failed:
// ReadProtoFromBinaryFile(filename, proto)".
TEST(DamagedProtoFileTest, ABinaryProtoCutShortIsNamed) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  BlobProto mean;
  mean.set_num(1);
  mean.set_channels(3);
  mean.set_height(16);
  mean.set_width(16);
  for (int i = 0; i < 3 * 16 * 16; ++i) mean.add_data(i * 0.5f);
  std::string bytes;
  ASSERT_TRUE(mean.SerializeToString(&bytes));
  std::string path;
  MakeTempFilename(&path);
  std::ofstream(path.c_str(), std::ios::binary).write(bytes.data(), bytes.size() / 2);
  BlobProto read;
  EXPECT_DEATH(ReadProtoFromBinaryFileOrDie(path, &read),
               "cannot read .* as caffe.BlobProto \\(truncated, or another kind of file\\)");
  std::ofstream(path.c_str()) << "num: 1 channels: oops";
  EXPECT_DEATH(ReadProtoFromTextFileOrDie(path, &read),
               "cannot read .* as caffe.BlobProto \\(a text-format error above");
  std::ofstream(path.c_str(), std::ios::binary).write(bytes.data(), bytes.size());
  ReadProtoFromBinaryFileOrDie(path, &read);  // whole: read as written
  EXPECT_EQ(read.data_size(), 3 * 16 * 16);
}

#ifdef USE_LMDB

class LmdbCheckTest : public ::testing::Test {
 protected:
  LmdbCheckTest() {
    MakeTempDir(&dir_);
    source_ = dir_ + "/db";
  }

  // n records of 4 KB images each (enough pages that a cut keeps the meta pages), then `extra`
  // as the value of one more record when given.
  void Write(int n, const std::string& extra = "") {
    scoped_ptr<db::DB> db(db::GetDB(DataParameter_DB_LMDB));
    db->Open(source_, db::NEW);
    scoped_ptr<db::Transaction> txn(db->NewTransaction());
    for (int i = 0; i < n; ++i) {
      Datum datum;
      datum.set_label(i % 3);
      datum.set_channels(4);
      datum.set_height(32);
      datum.set_width(32);
      datum.mutable_data()->assign(4 * 32 * 32, static_cast<char>(i));
      std::string out;
      CHECK(datum.SerializeToString(&out));
      txn->Put(format_int(i, 5), out);
    }
    if (!extra.empty()) txn->Put(format_int(n, 5), extra);
    txn->Commit();
    db->Close();
  }

  off_t DataFileSize() const {
    struct stat s;
    CHECK_EQ(stat((source_ + "/data.mdb").c_str(), &s), 0);
    return s.st_size;
  }

  void SetUpDataLayer() {
    LayerParameter param;
    param.set_phase(TRAIN);
    DataParameter* data = param.mutable_data_param();
    data->set_batch_size(4);
    data->set_source(source_);
    data->set_backend(DataParameter_DB_LMDB);
    DataLayer<float> layer(param);
    Blob<float> top_data, top_label;
    std::vector<Blob<float>*> bottom, top;
    top.push_back(&top_data);
    top.push_back(&top_label);
    layer.SetUp(bottom, top);
    for (int i = 0; i < 3; ++i) layer.Forward(bottom, top);
  }

  std::string dir_, source_;
};

TEST_F(LmdbCheckTest, AWholeDatabaseOpensAndReads) {
  Write(40);
  scoped_ptr<db::DB> db(db::GetDB(DataParameter_DB_LMDB));
  db->Open(source_, db::READ);
  scoped_ptr<db::Cursor> cursor(db->NewCursor());
  int n = 0;
  for (; cursor->valid(); cursor->Next()) ++n;
  EXPECT_EQ(n, 40);
  SetUpDataLayer();
}

TEST_F(LmdbCheckTest, ADataFileCutShortIsRefusedAtOpen) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  Write(40);
  const off_t whole = DataFileSize();
  ASSERT_GT(whole, 64 * 1024);
  ASSERT_EQ(truncate((source_ + "/data.mdb").c_str(), whole / 2), 0);
  // it used to open, and a read past the end was a bus error
  EXPECT_DEATH({
    scoped_ptr<db::DB> db(db::GetDB(DataParameter_DB_LMDB));
    db->Open(source_, db::READ);
  }, "LMDB .*/db is incomplete: its pages reach [0-9]+ bytes but .*data.mdb has [0-9]+ \\(cut "
     "short");
  EXPECT_DEATH(SetUpDataLayer(), "is incomplete");
  ASSERT_EQ(truncate((source_ + "/data.mdb").c_str(), 0), 0);
  EXPECT_DEATH({
    scoped_ptr<db::DB> db(db::GetDB(DataParameter_DB_LMDB));
    db->Open(source_, db::READ);
  }, "LMDB .*/db cannot be opened: .*\\(a missing, empty, cut-short or foreign data file\\?\\)");
}

TEST_F(LmdbCheckTest, ARecordThatIsNoDatumIsRefusedByTheDataLayer) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  // a field of wire type 7, which does not exist: not a protobuf message
  Write(2, std::string("\x0f\x01\x02", 3));
  Datum probe;
  ASSERT_FALSE(probe.ParseFromString(std::string("\x0f\x01\x02", 3)));
  EXPECT_DEATH(SetUpDataLayer(), "record '00002' of .*/db is not a Datum \\(a damaged database\\)");
}

TEST_F(LmdbCheckTest, TheCheckSaysNothingOfAWholeDatabase) {
  Write(5);
  MDB_env* env;
  ASSERT_EQ(mdb_env_create(&env), MDB_SUCCESS);
  ASSERT_EQ(mdb_env_open(env, source_.c_str(), MDB_RDONLY | MDB_NOTLS, 0664), MDB_SUCCESS);
  EXPECT_EQ(LmdbIncomplete(env, source_), "");
  mdb_env_close(env);
}

#endif  // USE_LMDB

}  // namespace caffe
