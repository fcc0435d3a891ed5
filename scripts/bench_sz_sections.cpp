// bench_sz_sections.cpp - design experiment behind docs/sz.md ("Choices measured"): would
// splitting the raw payload into sections (flags + descriptors, bitmaps, signs, fields) before zstd
// compress better than the block-interleaved layout? Uses sz's own block encoder.
// Built and run by scripts/bench_sz_choices.py:
//   g++ -O2 -std=c++17 -ffp-contract=off -Isz/include -Isz/src scripts/bench_sz_sections.cpp -lzstd
//   ./a.out data.f32 N C H W frac...   (raw float32 NCHW; bounds as fractions of the range)
#include "blockpack.h"
#include <zstd.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
using namespace szi;

static size_t zsize(const std::vector<uint8_t>& v) {  // zstd level 1 in 1 MiB chunks, as sz does
  size_t tot = 0;
  std::vector<uint8_t> o(ZSTD_compressBound(1 << 20));
  for (size_t off = 0; off < v.size(); off += 1 << 20) {
    size_t len = std::min<size_t>(1 << 20, v.size() - off);
    size_t r = ZSTD_compress(o.data(), o.size(), v.data() + off, len, 1);
    tot += (ZSTD_isError(r) ? len : std::min(r, len)) + 8;
  }
  return tot;
}

int main(int argc, char** argv) {
  if (argc < 7) { fprintf(stderr, "usage: %s data.f32 N C H W frac...\n", argv[0]); return 2; }
  size_t n = 1;
  for (int i = 2; i < 6; ++i) n *= strtoull(argv[i], nullptr, 10);
  const uint64_t W = strtoull(argv[5], nullptr, 10);
  std::vector<float> x(n);
  FILE* f = fopen(argv[1], "rb");
  if (!f || fread(x.data(), 4, n, f) != n) { fprintf(stderr, "cannot read %s\n", argv[1]); return 1; }
  fclose(f);
  float lo = *std::min_element(x.begin(), x.end()), hi = *std::max_element(x.begin(), x.end());
  for (int a = 6; a < argc; ++a) {
    double frac = atof(argv[a]);
    QuantParams p = make_quant_params(eb_to_float(frac * (hi - lo)));
    std::vector<uint8_t> flags, inter, desc, bm, sg, fl;
    uint8_t buf[4 * kBlock];
    for (size_t b = 0; b * kBlock < n; ++b) {
      int L = (int)std::min<size_t>(kBlock, n - b * kBlock);
      uint16_t d;
      uint32_t s = encode_block(&x[b * kBlock], L, (b * kBlock) % W, W, p, &d, buf);
      if (b % 8 == 0) flags.push_back(0);
      if (d == kDescZero) continue;
      flags.back() |= (uint8_t)(1u << (b % 8));
      desc.push_back((uint8_t)d);
      desc.push_back((uint8_t)(d >> 8));
      inter.insert(inter.end(), buf, buf + s);
      if (d == kDescRaw) { fl.insert(fl.end(), buf, buf + s); continue; }
      int nnz = (d >> 7) & 63, signs = (d >> 6) & 1;
      uint8_t* q = buf;
      if (nnz < L) { bm.insert(bm.end(), q, q + 4); q += 4; }
      if (signs) { sg.insert(sg.end(), q, q + (nnz + 7) / 8); q += (nnz + 7) / 8; }
      fl.insert(fl.end(), q, buf + s);
    }
    std::vector<uint8_t> all = flags;  // the stream's layout: flags, descriptors, block data
    all.insert(all.end(), desc.begin(), desc.end());
    all.insert(all.end(), inter.begin(), inter.end());
    std::vector<uint8_t> head = flags;
    head.insert(head.end(), desc.begin(), desc.end());
    size_t a1 = zsize(all) + 104, a2 = zsize(head) + zsize(bm) + zsize(sg) + zsize(fl) + 104;
    printf("  eb %g of range: interleaved ratio %.2f, sections ratio %.2f (%+.1f%%)\n", frac,
           4.0 * n / a1, 4.0 * n / a2, 100.0 * ((double)a1 / a2 - 1));
  }
  return 0;
}
