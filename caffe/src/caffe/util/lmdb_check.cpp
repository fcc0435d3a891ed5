// COMET-Caffe: include/caffe/util/lmdb_check.hpp.
#ifdef USE_LMDB
#include <sys/stat.h>

#include <sstream>
#include <string>

#include "caffe/util/lmdb_check.hpp"

namespace caffe {

std::string LmdbIncomplete(MDB_env* env, const std::string& source) {
  MDB_envinfo info;
  MDB_stat stat;
  if (mdb_env_info(env, &info) != MDB_SUCCESS || mdb_env_stat(env, &stat) != MDB_SUCCESS)
    return "its environment cannot be read";
  unsigned int flags = 0;
  mdb_env_get_flags(env, &flags);
  const std::string data = (flags & MDB_NOSUBDIR) ? source : source + "/data.mdb";
  struct stat file;
  if (::stat(data.c_str(), &file) != 0) return "its data file " + data + " cannot be read";
  // Pages 0 .. me_last_pgno are in use, each ms_psize bytes long.
  const unsigned long long needed =  // NOLINT(runtime/int)
      (static_cast<unsigned long long>(info.me_last_pgno) + 1) * stat.ms_psize;  // NOLINT
  if (static_cast<unsigned long long>(file.st_size) >= needed) return "";  // NOLINT
  std::ostringstream why;
  why << "its pages reach " << needed << " bytes but " << data << " has " << file.st_size
      << " (cut short: a copy or conversion that stopped half way, or a full disk)";
  return why.str();
}

}  // namespace caffe
#endif  // USE_LMDB
