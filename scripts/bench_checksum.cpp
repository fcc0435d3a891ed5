// scripts/bench_checksum.cpp - sz's payload checksum term, stream format 1 against 2, one thread.
// Build and run (from the repository root; -mavx2 is what host.cpp's AVX2 clone gets):
//   g++ -O3 -mavx2 -std=c++17 -Isz/src -Isz/include scripts/bench_checksum.cpp -o /tmp/bench_checksum
//   /tmp/bench_checksum
// Version 1 mixed each 32-bit word with two 64-bit multiplies, which GCC does not vectorize;
// version 2 (sz/src/checksum.h) takes one 32 x 32 -> 64 product, which it does (vpmuludq).
#include "checksum.h"
#include <chrono>
#include <cstdio>
#include <vector>
using namespace szi;
static uint64_t old_term(uint64_t i, uint32_t w) {
  uint64_t z = i * 0x9e3779b97f4a7c15ULL + ((uint64_t)w << 1) + 0x5bd1e995ULL;
  z ^= z >> 32; z *= 0xd6e8feb86659fd93ULL; z ^= z >> 29; z *= 0xa0761d6478bd642fULL; z ^= z >> 32;
  return z;
}
template <class F> double run(const uint32_t* p, uint64_t n, F f, uint64_t* s) {
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    uint64_t acc = 0;
    for (uint64_t i = 0; i < n; ++i) acc += f(i, p[i]);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    *s += acc; if (t < best) best = t;
  }
  return best;
}
int main() {
  const uint64_t n = 25u << 20;  // 100 MiB of words
  std::vector<uint32_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = (uint32_t)(i * 2654435761u);
  uint64_t s = 0;
  double a = run(v.data(), n, [](uint64_t i, uint32_t w) { return old_term(i, w); }, &s), b = run(v.data(), n, [](uint64_t i, uint32_t w) { return checksum_term(i, w); }, &s);
  printf("100 MiB, one thread, best of 5: version 1 term %.1f ms (%.2f GB/s), version 2 term %.1f ms (%.2f GB/s) [%llu]\n",
         a * 1e3, 4.0 * n / a / 1e9, b * 1e3, 4.0 * n / b / 1e9, (unsigned long long)(s & 1));
}
