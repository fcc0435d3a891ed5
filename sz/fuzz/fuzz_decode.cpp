// fuzz_decode.cpp - fuzz target for the stream decoder (libFuzzer entry point).
// Byte 0 of the input picks a mode: bit 0 set = rewrite the header and payload checksums
// before decoding, so the fuzzer reaches the structural checks behind them; bit 1 set = read
// a prefix (sz_decompress_host_prefix: bytes after the stream allowed), else the strict
// decoders (the input must be exactly one stream). The rest is the candidate stream. The
// decoder must return an error or SZ_OK, never crash or read out of bounds (built with
// ASan + UBSan); a prefix read that succeeds must report the stream's size and decode the
// same values as a strict read of exactly that many bytes. Strict reads also run the device
// decoder's steps as CPU loops (device_twin.h): the same verdict and, for a stream without
// the lossless stage, the same values as the host decoder, inside the same bounds.
#include "sz/sz.h"
#include "format.h"
#include "device_twin.h"
#include <stdlib.h>
#include <string.h>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool fix = data[0] & 1, prefix = data[0] & 2;
  // exact-size heap copy so that any overread hits the redzone
  size_t n = size - 1;
  uint8_t* s = (uint8_t*)malloc(n ? n : 1);
  if (n) memcpy(s, data + 1, n);
  if (fix && n >= szi::kHeaderSize) {
    uint64_t plen = szi::load_u64le(s + 72);
    if (plen <= n - szi::kHeaderSize)
      szi::store_u64le(s + 88, szi::checksum_serial(s + szi::kHeaderSize, plen));
    uint64_t sum = 0;
    for (uint64_t i = 0; i < 24; ++i) sum += szi::checksum_term(i, szi::load_u32le(s + 4 * i));
    szi::store_u64le(s + 96, sum);
  }
  sz_header_info info;
  const int peek = sz_peek_header(s, n, &info);
  if (prefix) {
    if (peek == SZ_OK && info.n_elems <= (1u << 22)) {
      size_t m = (size_t)info.n_elems, used = 1;
      float* out = (float*)malloc(m ? 4 * m : 4);
      int st = sz_decompress_host_prefix(s, n, out, m, 1, &used);
      if (st > 0) abort();
      if (st == SZ_OK) {
        if (used != info.stream_size || used > n) abort();
        float* again = (float*)malloc(m ? 4 * m : 4);
        if (sz_decompress_host_ex(s, used, again, m, 1) != SZ_OK) abort();
        if (m && memcmp(out, again, 4 * m) != 0) abort();
        free(again);
      } else if (used != 0) {
        abort();
      }
      free(out);
    } else {
      float small[8];
      size_t used;
      (void)sz_decompress_host_prefix(s, n, small, 8, 1, &used);
    }
  } else if (sz_read_header(s, n, &info) == SZ_OK && info.n_elems <= (1u << 22)) {
    if (info.stream_size != n) abort();  // strict: exactly one stream
    size_t m = (size_t)info.n_elems;
    float* out = (float*)malloc(m ? 4 * m : 4);
    int st = sz_decompress_host_ex(s, n, out, m, 1);
    if (st != SZ_OK && st >= 0) abort();
    if (info.lossless == SZ_LOSSLESS_NONE) {
      float* twin = (float*)malloc(m ? 4 * m : 4);
      if (szi::twin_decompress(s, n, twin, m) != st) abort();
      if (st == SZ_OK && m && memcmp(out, twin, 4 * m) != 0) abort();
      free(twin);
    }
    free(out);
  } else {
    float small[8];
    // sz_read_header refused it (or it is large): the strict decoder makes the same checks
    int st = sz_decompress_host_ex(s, n, small, 8, 1);
    if (st >= 0) abort();
    if (szi::twin_decompress(s, n, small, 8) >= 0) abort();
  }
  free(s);
  return 0;
}
