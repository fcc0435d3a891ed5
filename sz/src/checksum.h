// checksum.h - order-sensitive 64-bit checksum that parallelises as a plain sum.
// sum over 32-bit little-endian words w_i (last one zero-padded) of term(i, w_i), mod 2^64
// (format version 2). Addition commutes, so CPU threads and GPU blocks may add their partial
// sums in any order and still get the same value; the index in each term makes it sensitive to
// moved bytes.
#pragma once
#include "common.h"

namespace szi {

// Term of word i: the exact 64-bit product of two 32-bit functions of the word and of the
// index's key k_i = i * 0x9e3779b9 (mod 2^32), so that a changed word or a word moved to another
// index changes its term (up to the rare equal products; y is odd, so a change of x alone always
// does). A 32 x 32 -> 64 product per word
// vectorizes (pmuludq), where format version 1's 64-bit mixing of each word (two 64-bit
// multiplies) ran scalar: about 105 ms of the store's worker time per ResNet-18 step.
SZ_HD uint64_t checksum_term(uint64_t word_index, uint32_t w) {
  const uint32_t k = (uint32_t)word_index * 0x9e3779b9u;
  const uint32_t x = w + k, y = (w ^ 0x5bd1e995u) + (k ^ (k >> 15)) + 0x7f4a7c15u;
  return (uint64_t)x * (uint64_t)(y | 1u);
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
