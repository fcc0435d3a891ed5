// test_large.cpp - a 256 MiB ReLU-sparse tensor (64 Mi floats) through the host codec.
#include "test_util.h"
#include <chrono>

using namespace szt;

TEST(Large, Relu256MiB) {
  const size_t N = 16, C = 64, H = 256, W = 256;  // 2^26 floats = 256 MiB
  const size_t n = N * C * H * W;
  std::vector<float> x(n);
  // cheap generator: a correlated sequence, ReLU'd; ~70% zeros
  uint32_t s = 12345;
  float acc = 0;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    float u = (float)(s >> 8) * (1.0f / 16777216.0f) - 0.5f;
    acc = 0.9f * acc + u;
    float v = acc - 0.3f;
    x[i] = v > 0 ? v : 0.0f;
  }
  x[n - 1] = INFINITY;
  x[n / 2] = NAN;
  size_t dims[4] = {N, C, H, W};
  std::vector<uint8_t> out(sz_compress_bound(n));
  size_t size = 0;
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(sz_compress_host(x.data(), dims, 4, 1e-3, SZ_EB_REL, out.data(), out.size(), &size), SZ_OK);
  auto t1 = std::chrono::steady_clock::now();
  sz_header_info info;
  ASSERT_EQ(sz_read_header(out.data(), size, &info), SZ_OK);
  std::vector<float> y(n);
  ASSERT_EQ(sz_decompress_host(out.data(), size, y.data(), n), SZ_OK);
  auto t2 = std::chrono::steady_clock::now();
  double ct = std::chrono::duration<double>(t1 - t0).count();
  double dt = std::chrono::duration<double>(t2 - t1).count();
  printf("256 MiB: ratio %.2f, compress %.2f GB/s, decompress %.2f GB/s, eb_abs %g\n",
         4.0 * n / size, 4e-9 * n / ct, 4e-9 * n / dt, info.eb_abs);
  check_bound(x, y, info.eb_abs);
  EXPECT_GT(4.0 * n / size, 3.0);
}
