// sz.hpp - C++ API over the C API of <sz/sz.h>. Header only; errors throw sz::Error.
#pragma once
#include "sz/sz.h"
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace sz {

enum class Mode { Abs = SZ_EB_ABS, Rel = SZ_EB_REL };

class Error : public std::runtime_error {
 public:
  explicit Error(int status, const std::string& what)
      : std::runtime_error(what + ": " + sz_strerror(status)), status_(status) {}
  int status() const { return status_; }

 private:
  int status_;
};

inline void check(int status, const char* what) {
  if (status != SZ_OK) throw Error(status, what);
}

inline std::size_t compress_bound(std::size_t n_elems) { return sz_compress_bound(n_elems); }

inline std::size_t num_elems(const std::vector<std::size_t>& dims) {
  std::size_t n = 1;
  for (std::size_t d : dims) n *= d;
  return n;
}

// Compresses host data with the given bound; returns the stream.
inline std::vector<std::uint8_t> compress(const float* data, const std::vector<std::size_t>& dims,
                                          double eb, Mode mode = Mode::Abs, bool zstd = true,
                                          int nthreads = 0) {
  sz_params p;
  sz_params_default(&p, eb, static_cast<int>(mode));
  if (!zstd) p.lossless = SZ_LOSSLESS_NONE;
  p.nthreads = nthreads;
  std::vector<std::uint8_t> out(sz_compress_bound(num_elems(dims)));
  std::size_t size = 0;
  check(sz_compress_host_ex(data, dims.data(), static_cast<int>(dims.size()), &p, out.data(),
                            out.size(), &size),
        "sz::compress");
  out.resize(size);
  return out;
}

inline sz_header_info read_header(const void* stream, std::size_t size) {
  sz_header_info info;
  check(sz_read_header(stream, size, &info), "sz::read_header");
  return info;
}

// Decompresses into out (at least header().n_elems values).
inline void decompress(const void* stream, std::size_t size, float* out, std::size_t out_elems,
                       int nthreads = 0) {
  check(sz_decompress_host_ex(stream, size, out, out_elems, nthreads), "sz::decompress");
}

// Decompresses the stream at the start of buf (other bytes may follow); returns its size.
inline std::size_t decompress_prefix(const void* buf, std::size_t size, float* out,
                                     std::size_t out_elems, int nthreads = 0) {
  std::size_t used = 0;
  check(sz_decompress_host_prefix(buf, size, out, out_elems, nthreads, &used),
        "sz::decompress_prefix");
  return used;
}

// stream must hold exactly one stream (sz::Error with SZ_ERR_TRAILING otherwise).
inline std::vector<float> decompress(const std::vector<std::uint8_t>& stream, int nthreads = 0) {
  sz_header_info info = read_header(stream.data(), stream.size());
  std::vector<float> out(static_cast<std::size_t>(info.n_elems));
  decompress(stream.data(), stream.size(), out.data(), out.size(), nthreads);
  return out;
}

}  // namespace sz
