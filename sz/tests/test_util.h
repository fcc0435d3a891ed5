// test_util.h - data generators and checks shared by the sz tests.
#pragma once
#include "sz/sz.h"
#include <gtest/gtest.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace szt {

inline std::vector<float> random_uniform(size_t n, uint32_t seed, float lo = -1, float hi = 1) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// ReLU output of a smooth-ish field plus noise; zero_frac of the values are exact zeros.
inline std::vector<float> relu_sparse(size_t n, double zero_frac, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  // threshold of a standard normal for the wanted zero fraction (bisection on erf)
  double lo = -8, hi = 8;
  for (int i = 0; i < 60; ++i) {
    double mid = 0.5 * (lo + hi);
    double cdf = 0.5 * std::erfc(-mid / std::sqrt(2.0));
    (cdf < zero_frac ? lo : hi) = mid;
  }
  float thr = (float)lo;
  std::vector<float> v(n);
  float s = 0;
  for (size_t i = 0; i < n; ++i) {
    s = 0.8f * s + 0.6f * nd(g);  // correlated along the innermost dimension
    float x = s - thr;
    v[i] = x > 0 ? x : 0.0f;
  }
  return v;
}

inline std::vector<float> smooth(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (float)(std::sin(i * 0.01) * 10.0 + std::cos(i * 0.0037));
  return v;
}

struct Stream {
  std::vector<uint8_t> bytes;
  int status = SZ_OK;
};

inline Stream compress(const std::vector<float>& x, const std::vector<size_t>& dims, double eb,
                       int mode = SZ_EB_ABS, int lossless = SZ_LOSSLESS_ZSTD, int threads = 0) {
  size_t n = 1;
  for (size_t d : dims) n *= d;
  Stream s;
  s.bytes.resize(sz_compress_bound(n));
  sz_params p;
  sz_params_default(&p, eb, mode);
  p.lossless = lossless;
  p.nthreads = threads;
  size_t size = 0;
  s.status = sz_compress_host_ex(x.data(), dims.data(), (int)dims.size(), &p, s.bytes.data(),
                                 s.bytes.size(), &size);
  s.bytes.resize(s.status == SZ_OK ? size : 0);
  return s;
}

// Checks the error bound and the exactness of zeros, NaN and Inf. Returns max error.
inline double check_bound(const std::vector<float>& x, const std::vector<float>& y, double eb) {
  EXPECT_EQ(x.size(), y.size());
  double maxerr = 0;
  size_t bad = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    float a = x[i], b = y[i];
    if (std::isnan(a) || std::isinf(a) || a == 0.0f) {
      uint32_t ua, ub;
      std::memcpy(&ua, &a, 4);
      std::memcpy(&ub, &b, 4);
      bool ok = a == 0.0f ? b == 0.0f : ua == ub;
      if (!ok && bad++ < 5) ADD_FAILURE() << "value " << a << " at " << i << " came back as " << b;
      continue;
    }
    double e = std::fabs((double)a - (double)b);
    if (!(e <= eb) && bad++ < 5)
      ADD_FAILURE() << "error " << e << " > eb " << eb << " at " << i << " (" << a << " -> " << b << ")";
    if (e > maxerr) maxerr = e;
  }
  EXPECT_EQ(bad, 0u);
  return maxerr;
}

// Shapes and kinds of tensor that the device-backend tests (test_gpu, test_device_twin) run:
// kind 0 uniform, 1 ReLU 70% zeros, 2 smooth, 3 all zeros; every one over 100 values that is
// not all zeros also holds NaN, +Inf, -Inf and a value too large for any step.
struct ShapeCase {
  const char* name;
  std::vector<size_t> dims;
  int kind;
};

inline const std::vector<ShapeCase>& device_cases() {
  static const std::vector<ShapeCase> cases = {
      {"uniform", {3, 5, 17, 33}, 0}, {"relu", {8, 16, 32, 32}, 1}, {"smooth", {100000}, 2},
      {"zeros", {4, 1000}, 3},        {"tiny1", {1}, 0},            {"tiny7", {7}, 1},
      {"empty", {0}, 0},              {"odd", {1, 3, 1, 97}, 1},    {"one_tile_plus", {1057}, 1},
      {"w1", {40, 1}, 2}};
  return cases;
}

inline std::vector<float> make_case(const ShapeCase& c) {
  size_t n = 1;
  for (size_t d : c.dims) n *= d;
  std::vector<float> x;
  switch (c.kind) {
    case 0: x = random_uniform(n, 5, -2, 2); break;
    case 1: x = relu_sparse(n, 0.7, 6); break;
    case 2: x = smooth(n); break;
    default: x.assign(n, 0.0f);
  }
  if (n > 100 && c.kind != 3) { x[17] = NAN; x[n - 1] = INFINITY; x[n / 2] = -INFINITY; x[n / 3] = 3e38f; }
  return x;
}

// gtest name of a (case, mode) parameter
template <class Info>
std::string case_mode_name(const Info& i) {
  return std::string(std::get<0>(i.param).name) + (std::get<1>(i.param) ? "_rel" : "_abs");
}

}  // namespace szt
