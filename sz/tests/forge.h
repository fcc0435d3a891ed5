// forge.h - edits stream fields the way a forger would: the change, then both checksums
// recomputed, so that only the decoder's consistency checks can catch the lie.
#pragma once
#include "format.h"
#include <cstdint>
#include <vector>

namespace szt {

// Recomputes the payload checksum (when the stated length fits) and the header checksum.
inline void reseal(std::vector<uint8_t>& s) {
  using namespace szi;
  if (s.size() < kHeaderSize) return;
  const uint64_t plen = load_u64le(s.data() + 72);
  if (plen <= s.size() - kHeaderSize)
    store_u64le(s.data() + 88, checksum_serial(s.data() + kHeaderSize, plen));
  uint64_t sum = 0;
  for (uint64_t i = 0; i < 24; ++i) sum += checksum_term(i, load_u32le(s.data() + 4 * i));
  store_u64le(s.data() + 96, sum);
}

inline std::vector<uint8_t> with_eb_abs(std::vector<uint8_t> s, float eb_abs) {
  szi::store_u32le(s.data() + 56, szi::f2u(eb_abs));
  reseal(s);
  return s;
}

inline std::vector<uint8_t> with_eb_req(std::vector<uint8_t> s, double eb_req) {
  szi::store_u64le(s.data() + 48, szi::d2u(eb_req));
  reseal(s);
  return s;
}

inline std::vector<uint8_t> with_mode(std::vector<uint8_t> s, uint8_t mode) {
  s[10] = mode;
  reseal(s);
  return s;
}

}  // namespace szt
