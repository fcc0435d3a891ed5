#ifndef CAFFE_UTIL_LMDB_CHECK_HPP_
#define CAFFE_UTIL_LMDB_CHECK_HPP_
#ifdef USE_LMDB

// COMET-Caffe: an LMDB opened for reading must be whole. LMDB maps its data file and trusts the
// page numbers its meta page records, so a database whose data.mdb was cut short (a copy or a
// conversion that stopped half way, a full disk) opened without complaint, and the first read
// of a page past the file's end killed the process with SIGBUS in the data layer's prefetch
// thread. db::LMDB::Open calls this (patch 0032) and stops with a message that says so.

#include <lmdb.h>

#include <string>

namespace caffe {

// Empty when the environment's data file holds every page its last transaction used; otherwise
// what is wrong, in words (the caller names the database).
std::string LmdbIncomplete(MDB_env* env, const std::string& source);

}  // namespace caffe

#endif  // USE_LMDB
#endif  // CAFFE_UTIL_LMDB_CHECK_HPP_
