// checksum.h - order-sensitive 64-bit checksum that parallelises as a plain sum.
// sum over 32-bit little-endian words w_i (last one zero-padded) of mix(i, w_i), mod 2^64.
// Addition commutes, so CPU threads and GPU blocks may add their partial sums in any order
// and still get the same value; mixing the index in makes it sensitive to moved bytes.
#pragma once
#include "common.h"

namespace szi {

SZ_HD uint64_t mix64(uint64_t z) {
  z ^= z >> 32;
  z *= 0xd6e8feb86659fd93ULL;
  z ^= z >> 29;
  z *= 0xa0761d6478bd642fULL;
  z ^= z >> 32;
  return z;
}

SZ_HD uint64_t checksum_term(uint64_t word_index, uint32_t w) {
  return mix64(word_index * 0x9e3779b97f4a7c15ULL + ((uint64_t)w << 1) + 0x5bd1e995ULL);
}

// word i of a byte range, zero padded past len
SZ_HD uint32_t checksum_word(const uint8_t* p, uint64_t len, uint64_t i) {
  uint64_t off = i * 4;
  if (off + 4 <= len) return load_u32le(p + off);
  uint32_t w = 0;
  for (uint64_t b = off; b < len; ++b) w |= (uint32_t)p[b] << (8 * (b - off));
  return w;
}

// serial reference (headers, small ranges)
inline uint64_t checksum_serial(const uint8_t* p, uint64_t len) {
  uint64_t s = 0, nw = (len + 3) / 4;
  for (uint64_t i = 0; i < nw; ++i) s += checksum_term(i, checksum_word(p, len, i));
  return s;
}

}  // namespace szi
