// test_corrupt.cpp - corrupt, truncated and foreign input is rejected with an error.
#include "test_util.h"
#include <memory>
#include <set>

using namespace szt;

namespace {

int decode(const std::vector<uint8_t>& s, size_t n) {
  std::vector<float> y(n + 1);
  return sz_decompress_host(s.data(), s.size(), y.data(), y.size());
}

class Corrupt : public ::testing::TestWithParam<int> {};

TEST_P(Corrupt, EverySingleByteFlipIsRejected) {
  int lossless = GetParam();
  std::vector<float> x = relu_sparse(700, 0.6, 17);
  x[100] = NAN;
  Stream s = compress(x, {7, 100}, 1e-2, SZ_EB_ABS, lossless);
  ASSERT_EQ(s.status, SZ_OK);
  ASSERT_EQ(decode(s.bytes, x.size()), SZ_OK);
  std::set<int> seen;
  for (size_t i = 0; i < s.bytes.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xFF}) {
      std::vector<uint8_t> c = s.bytes;
      c[i] ^= mask;
      int st = decode(c, x.size());
      EXPECT_LT(st, 0) << "flip 0x" << std::hex << (int)mask << " at byte " << std::dec << i;
      seen.insert(st);
    }
  }
  EXPECT_TRUE(seen.count(SZ_ERR_CORRUPT));
  EXPECT_TRUE(seen.count(SZ_ERR_FORMAT));  // magic bytes
}

TEST_P(Corrupt, EveryTruncationIsRejected) {
  std::vector<float> x = smooth(500);
  Stream s = compress(x, {500}, 1e-3, SZ_EB_ABS, GetParam());
  ASSERT_EQ(s.status, SZ_OK);
  for (size_t len = 0; len < s.bytes.size(); ++len) {
    // the prefix lives in its own exact-size heap block so that ASan/valgrind catch overreads
    std::unique_ptr<uint8_t[]> t(new uint8_t[len + 1]);
    std::memcpy(t.get(), s.bytes.data(), len);
    std::vector<float> y(x.size());
    int st = sz_decompress_host(t.get(), len, y.data(), y.size());
    EXPECT_TRUE(st == SZ_ERR_TRUNCATED) << "length " << len << " gave " << st;
  }
  sz_header_info info;
  EXPECT_EQ(sz_read_header(s.bytes.data(), 50, &info), SZ_ERR_TRUNCATED);
  // the header alone: sz_read_header says truncated, sz_peek_header reads it
  EXPECT_EQ(sz_read_header(s.bytes.data(), SZ_HEADER_SIZE, &info), SZ_ERR_TRUNCATED);
  ASSERT_EQ(sz_peek_header(s.bytes.data(), SZ_HEADER_SIZE, &info), SZ_OK);
  EXPECT_EQ(info.stream_size, s.bytes.size());
  EXPECT_EQ(info.n_elems, x.size());
  EXPECT_EQ(sz_peek_header(s.bytes.data(), SZ_HEADER_SIZE - 1, &info), SZ_ERR_TRUNCATED);
  std::vector<uint8_t> bad(s.bytes.begin(), s.bytes.begin() + SZ_HEADER_SIZE);
  bad[20] ^= 1;  // a dim: header checksum
  EXPECT_EQ(sz_peek_header(bad.data(), bad.size(), &info), SZ_ERR_CORRUPT);
}

INSTANTIATE_TEST_SUITE_P(Streams, Corrupt, ::testing::Values(SZ_LOSSLESS_NONE, SZ_LOSSLESS_ZSTD));

TEST(Foreign, RandomAndTextInputRejected) {
  std::mt19937 g(99);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint8_t> b(g() % 400);
    for (auto& v : b) v = (uint8_t)g();
    EXPECT_LT(decode(b, 1000), 0);
  }
  std::string text = "hello, this is not a compressed stream at all, not even close.........."
                     "......................................................................";
  std::vector<uint8_t> t(text.begin(), text.end());
  EXPECT_EQ(decode(t, 10), SZ_ERR_FORMAT);
  EXPECT_EQ(sz_decompress_host(nullptr, 10, nullptr, 0), SZ_ERR_PARAM);
}

}  // namespace
