// make_seeds.cpp - writes valid streams (prefixed with the fuzz mode byte) as a seed corpus.
// Mode bits as in fuzz_decode.cpp: 1 = fix checksums, 2 = prefix read.
#include "sz/sz.h"
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  std::string dir = argv[1];
  int k = 0;
  for (size_t n : {0ul, 1ul, 7ul, 33ul, 100ul, 1000ul, 5000ul}) {
    for (int lossless : {SZ_LOSSLESS_NONE, SZ_LOSSLESS_ZSTD}) {
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) {
        double v = std::sin(i * 0.1) * 3 + (i % 7 == 0 ? 5 : 0);
        x[i] = v > 0 ? (float)v : 0.0f;
      }
      if (n > 10) { x[3] = NAN; x[9] = -INFINITY; }
      size_t dims[2] = {n > 10 ? (size_t)10 : (size_t)1, n > 10 ? n / 10 : n};
      size_t use_n = dims[0] * dims[1];
      std::vector<unsigned char> out(sz_compress_bound(use_n) + 1);
      sz_params p;
      sz_params_default(&p, 1e-2, k % 2 ? SZ_EB_REL : SZ_EB_ABS);
      p.lossless = lossless;
      size_t size = 0;
      if (sz_compress_host_ex(x.data(), dims, 2, &p, out.data() + 1, out.size() - 1, &size) != SZ_OK) return 1;
      // modes 0..3: checksum fixing (bit 0) x prefix read (bit 1); prefix seeds carry the
      // stream twice, so the read stops before the second copy
      for (int mode : {0, 1, 2, 3}) {
        out[0] = (unsigned char)mode;
        std::string path = dir + "/seed" + std::to_string(k++);
        FILE* f = fopen(path.c_str(), "wb");
        if (!f) return 1;
        fwrite(out.data(), 1, size + 1, f);
        if (mode & 2) fwrite(out.data() + 1, 1, size, f);
        fclose(f);
      }
    }
  }
  printf("wrote %d seeds to %s\n", k, dir.c_str());
  return 0;
}
