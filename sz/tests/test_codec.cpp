// test_codec.cpp - round trips through the host C API: bound, exact values, shapes, modes.
#include "test_util.h"
#include "sz/sz.hpp"
#include <algorithm>
#include <tuple>

using namespace szt;

namespace {

std::vector<float> roundtrip(const std::vector<float>& x, const std::vector<size_t>& dims, double eb,
                             int mode, int lossless, double* eb_abs, size_t* csize = nullptr,
                             int threads = 0) {
  Stream s = compress(x, dims, eb, mode, lossless, threads);
  EXPECT_EQ(s.status, SZ_OK) << sz_strerror(s.status);
  sz_header_info info;
  EXPECT_EQ(sz_read_header(s.bytes.data(), s.bytes.size(), &info), SZ_OK);
  EXPECT_EQ(info.n_elems, x.size());
  EXPECT_EQ(info.stream_size, s.bytes.size());
  EXPECT_LE(s.bytes.size(), sz_compress_bound(x.size()));
  *eb_abs = info.eb_abs;
  if (csize) *csize = s.bytes.size();
  std::vector<float> y(x.size(), 12345.0f);
  EXPECT_EQ(sz_decompress_host(s.bytes.data(), s.bytes.size(), y.data(), y.size()), SZ_OK);
  return y;
}

double value_range(const std::vector<float>& x) {
  float lo = INFINITY, hi = -INFINITY;
  for (float v : x)
    if (std::isfinite(v)) { lo = std::min(lo, v); hi = std::max(hi, v); }
  return hi >= lo ? (double)hi - lo : 0.0;
}

struct Case {
  const char* name;
  std::vector<size_t> dims;
  int kind;  // 0 uniform, 1 smooth, 2 relu 50%, 3 relu 80%, 4 relu 95%, 5 constant, 6 zeros
};

std::vector<float> make(const Case& c) {
  size_t n = 1;
  for (size_t d : c.dims) n *= d;
  switch (c.kind) {
    case 0: return random_uniform(n, 1, -3, 5);
    case 1: return smooth(n);
    case 2: return relu_sparse(n, 0.5, 2);
    case 3: return relu_sparse(n, 0.8, 3);
    case 4: return relu_sparse(n, 0.95, 4);
    case 5: return std::vector<float>(n, 3.25f);
    default: return std::vector<float>(n, 0.0f);
  }
}

class RoundTrip : public ::testing::TestWithParam<std::tuple<Case, double, int, int>> {};

TEST_P(RoundTrip, BoundHolds) {
  const Case& c = std::get<0>(GetParam());
  double eb = std::get<1>(GetParam());
  int mode = std::get<2>(GetParam());
  int lossless = std::get<3>(GetParam());
  std::vector<float> x = make(c);
  double eb_abs = 0;
  std::vector<float> y = roundtrip(x, c.dims, eb, mode, lossless, &eb_abs);
  double want = mode == SZ_EB_ABS ? eb : eb * value_range(x);
  if (mode == SZ_EB_REL && value_range(x) == 0) want = eb_abs;  // documented fallback
  EXPECT_LE(eb_abs, want);
  EXPECT_GT(eb_abs, 0.0);
  check_bound(x, y, eb_abs);
}

const Case kCases[] = {
    {"uniform_4d", {2, 3, 17, 19}, 0},    {"smooth_1d", {10000}, 1},
    {"relu50_nchw", {2, 8, 16, 16}, 2},   {"relu80_nchw", {4, 4, 13, 29}, 3},
    {"relu95_2d", {333, 77}, 4},          {"constant_3d", {5, 6, 7}, 5},
    {"zeros_4d", {2, 2, 32, 32}, 6},      {"tiny1", {1}, 0},
    {"tiny2", {2}, 1},                    {"tiny7", {7}, 2},
    {"odd_w1", {3, 5, 7, 1}, 0},          {"odd_w33", {1, 1, 1, 33}, 3},
    {"w31_rows", {9, 31}, 1},
};

std::string name_of(const ::testing::TestParamInfo<RoundTrip::ParamType>& info) {
  const Case& c = std::get<0>(info.param);
  double eb = std::get<1>(info.param);
  std::string s = std::string(c.name) + "_eb" + std::to_string((int)std::round(-std::log10(eb)));
  s += std::get<2>(info.param) == SZ_EB_ABS ? "_abs" : "_rel";
  s += std::get<3>(info.param) == SZ_LOSSLESS_ZSTD ? "_zstd" : "_none";
  return s;
}

INSTANTIATE_TEST_SUITE_P(Host, RoundTrip,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(1e-1, 1e-2, 1e-4),
                                            ::testing::Values(SZ_EB_ABS, SZ_EB_REL),
                                            ::testing::Values(SZ_LOSSLESS_NONE, SZ_LOSSLESS_ZSTD)),
                         name_of);

TEST(Host, EmptyTensor) {
  std::vector<float> x;
  for (std::vector<size_t> dims : {std::vector<size_t>{0}, {3, 0, 5}, {0, 0, 0, 0}}) {
    Stream s = compress(x, dims, 1e-3);
    ASSERT_EQ(s.status, SZ_OK);
    sz_header_info info;
    ASSERT_EQ(sz_read_header(s.bytes.data(), s.bytes.size(), &info), SZ_OK);
    EXPECT_EQ(info.n_elems, 0u);
    EXPECT_EQ(sz_decompress_host(s.bytes.data(), s.bytes.size(), nullptr, 0), SZ_OK);
  }
}

TEST(Host, NanInfAndSignedZeroExact) {
  std::vector<float> x = random_uniform(1000, 7);
  x[0] = NAN;
  x[3] = INFINITY;
  x[64] = -INFINITY;
  x[65] = -NAN;
  uint32_t payload_nan = 0x7fc01234u;
  std::memcpy(&x[500], &payload_nan, 4);
  x[999] = 0.0f;
  x[998] = -0.0f;
  x[700] = 3e38f;    // huge: outlier
  x[701] = -3e38f;
  x[702] = 1e-40f;   // denormal
  for (int mode : {SZ_EB_ABS, SZ_EB_REL}) {
    double eb_abs;
    std::vector<float> y = roundtrip(x, {1000}, 1e-3, mode, SZ_LOSSLESS_ZSTD, &eb_abs);
    check_bound(x, y, eb_abs);
    EXPECT_EQ(y[700], 3e38f);
  }
}

// sz_restore_host gives, value by value, what a stream decodes to (blocks without an outlier),
// and the value itself where the quantizer refuses it.
TEST(Host, RestoreIsWhatTheStreamDecodesTo) {
  for (int kind : {0, 1, 2}) {
    std::vector<float> x = kind == 0 ? random_uniform(4096, 11, -3, 5)
                           : kind == 1 ? smooth(4096) : relu_sparse(4096, 0.5, 12);
    for (double eb : {1e-1, 1e-3, 0.37}) {
      double eb_abs;
      const std::vector<float> y = roundtrip(x, {4, 1024}, eb, SZ_EB_ABS, SZ_LOSSLESS_NONE, &eb_abs);
      std::vector<float> r(x.size(), 12345.0f);
      ASSERT_EQ(sz_restore_host(x.data(), x.size(), eb, r.data()), SZ_OK);
      for (size_t i = 0; i < x.size(); ++i)
        ASSERT_EQ(std::memcmp(&r[i], &y[i], 4), 0) << "kind " << kind << " eb " << eb << " at " << i;
    }
  }
  const float odd[] = {NAN, INFINITY, -3e38f, -0.0f, 0.2f};
  float r[5];
  ASSERT_EQ(sz_restore_host(odd, 5, 1e-3, r), SZ_OK);
  EXPECT_TRUE(std::isnan(r[0]));
  EXPECT_EQ(r[1], INFINITY);
  EXPECT_EQ(r[2], -3e38f);
  EXPECT_EQ(std::signbit(r[3]), false) << "-0.0 comes back as +0.0";
  EXPECT_LE(std::fabs(r[4] - 0.2f), 1e-3);
  EXPECT_EQ(sz_restore_host(odd, 5, 0.0, r), SZ_OK);  // no usable step: every value verbatim
  EXPECT_EQ(r[4], 0.2f);
  EXPECT_EQ(sz_restore_host(nullptr, 5, 1e-3, r), SZ_ERR_PARAM);
}

TEST(Host, AllNanRelMode) {
  std::vector<float> x(100, NAN);
  double eb_abs;
  std::vector<float> y = roundtrip(x, {100}, 1e-2, SZ_EB_REL, SZ_LOSSLESS_NONE, &eb_abs);
  check_bound(x, y, eb_abs);
}

TEST(Host, ZerosCostAlmostNothing) {
  std::vector<float> x(1 << 20, 0.0f);
  double eb_abs;
  size_t csize;
  roundtrip(x, {1 << 20}, 1e-3, SZ_EB_ABS, SZ_LOSSLESS_ZSTD, &eb_abs, &csize);
  EXPECT_LT(csize, 4096u) << "4 MiB of zeros should compress to a few hundred bytes";
  size_t csize_none;
  roundtrip(x, {1 << 20}, 1e-3, SZ_EB_ABS, SZ_LOSSLESS_NONE, &eb_abs, &csize_none);
  EXPECT_LE(csize_none, SZ_HEADER_SIZE + x.size() / 32 / 8) << "one bit per 32 zeros";
}

TEST(Host, SparseCompressesWell) {
  std::vector<float> x = relu_sparse(1 << 18, 0.9, 11);
  double eb_abs;
  size_t csize;
  std::vector<float> y = roundtrip(x, {16, 64, 256}, 1e-2, SZ_EB_REL, SZ_LOSSLESS_ZSTD, &eb_abs, &csize);
  check_bound(x, y, eb_abs);
  double ratio = (double)x.size() * 4 / csize;
  EXPECT_GT(ratio, 10.0) << "ratio " << ratio;
}

TEST(Host, ThreadCountDoesNotChangeStream) {
  std::vector<float> x = relu_sparse(1 << 19, 0.6, 5);
  x[12345] = NAN;
  Stream a = compress(x, {1 << 19}, 1e-3, SZ_EB_REL, SZ_LOSSLESS_ZSTD, 1);
  Stream b = compress(x, {1 << 19}, 1e-3, SZ_EB_REL, SZ_LOSSLESS_ZSTD, 2);
  Stream c = compress(x, {1 << 19}, 1e-3, SZ_EB_REL, SZ_LOSSLESS_ZSTD, 7);
  ASSERT_EQ(a.status, SZ_OK);
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.bytes, c.bytes);
  std::vector<float> y1(x.size()), y2(x.size());
  ASSERT_EQ(sz_decompress_host_ex(a.bytes.data(), a.bytes.size(), y1.data(), y1.size(), 1), SZ_OK);
  ASSERT_EQ(sz_decompress_host_ex(a.bytes.data(), a.bytes.size(), y2.data(), y2.size(), 3), SZ_OK);
  EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), 4 * y1.size()));
}

// An executor that runs the tasks in reverse order on the calling thread and counts them: the
// host backend hands it every multi-threaded step, and the stream is the same.
struct CountingExecutor {
  static int calls, tasks;
  static void run(void* ctx, int n, sz_task task, void* arg) {
    EXPECT_EQ(ctx, (void*)&calls);
    ++calls;
    tasks += n;
    for (int t = n - 1; t >= 0; --t) task(arg, t);
  }
};
int CountingExecutor::calls = 0, CountingExecutor::tasks = 0;

TEST(Host, AnExecutorRunsTheThreadsWorkAndTheStreamIsTheSame) {
  std::vector<float> x = relu_sparse(1 << 19, 0.6, 7);
  Stream plain = compress(x, {1 << 19}, 1e-3, SZ_EB_ABS, SZ_LOSSLESS_NONE, 4);
  sz_set_executor(&CountingExecutor::run, &CountingExecutor::calls);
  Stream a = compress(x, {1 << 19}, 1e-3, SZ_EB_ABS, SZ_LOSSLESS_NONE, 4);
  const int encode_calls = CountingExecutor::calls;
  std::vector<float> y(x.size()), z(x.size());
  const int rc = sz_decompress_host_ex(a.bytes.data(), a.bytes.size(), y.data(), y.size(), 3);
  const int calls = CountingExecutor::calls, tasks = CountingExecutor::tasks;
  Stream one = compress(x, {1 << 19}, 1e-3, SZ_EB_ABS, SZ_LOSSLESS_NONE, 1);  // no team asked for
  const int calls_after_one = CountingExecutor::calls;
  sz_set_executor(nullptr, nullptr);
  ASSERT_EQ(a.status, SZ_OK);
  ASSERT_EQ(rc, SZ_OK);
  EXPECT_EQ(a.bytes, plain.bytes);
  EXPECT_EQ(one.bytes, plain.bytes);
  EXPECT_GE(encode_calls, 2);           // encode's two phases at least
  EXPECT_GT(calls, encode_calls);       // and the decoder's
  EXPECT_GE(tasks, 4 * encode_calls);   // each call with all of its threads' tasks
  EXPECT_EQ(calls_after_one, calls);
  ASSERT_EQ(sz_decompress_host_ex(a.bytes.data(), a.bytes.size(), z.data(), z.size(), 1), SZ_OK);
  EXPECT_EQ(0, std::memcmp(y.data(), z.data(), 4 * y.size()));
}

TEST(Host, BadArguments) {
  std::vector<float> x(10, 1.0f);
  std::vector<uint8_t> out(sz_compress_bound(10));
  size_t dims[1] = {10}, size = 0;
  EXPECT_EQ(sz_compress_host(x.data(), dims, 1, 0.0, SZ_EB_ABS, out.data(), out.size(), &size), SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(x.data(), dims, 1, -1.0, SZ_EB_ABS, out.data(), out.size(), &size), SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(x.data(), dims, 1, NAN, SZ_EB_ABS, out.data(), out.size(), &size), SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(x.data(), dims, 1, INFINITY, SZ_EB_ABS, out.data(), out.size(), &size), SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(x.data(), dims, 0, 1e-3, SZ_EB_ABS, out.data(), out.size(), &size), SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(x.data(), dims, 5, 1e-3, SZ_EB_ABS, out.data(), out.size(), &size), SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(x.data(), dims, 1, 1e-3, 7, out.data(), out.size(), &size), SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(nullptr, dims, 1, 1e-3, SZ_EB_ABS, out.data(), out.size(), &size), SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(x.data(), dims, 1, 1e-3, SZ_EB_ABS, out.data(), 50, &size), SZ_ERR_BUFFER);
  // random data, no room for the payload
  std::vector<float> r = random_uniform(1000, 3);
  std::vector<uint8_t> small(200);
  size_t d2[1] = {1000};
  EXPECT_EQ(sz_compress_host(r.data(), d2, 1, 1e-6, SZ_EB_ABS, small.data(), small.size(), &size), SZ_ERR_BUFFER);
  // output too small for decompression
  ASSERT_EQ(sz_compress_host(x.data(), dims, 1, 1e-3, SZ_EB_ABS, out.data(), out.size(), &size), SZ_OK);
  std::vector<float> y(9);
  EXPECT_EQ(sz_decompress_host(out.data(), size, y.data(), y.size()), SZ_ERR_BUFFER);
  EXPECT_STRNE(sz_strerror(SZ_ERR_CORRUPT), sz_strerror(SZ_ERR_TRUNCATED));
}

TEST(Host, HugeAndTinyBounds) {
  std::vector<float> x = random_uniform(4096, 9, -1e30f, 1e30f);
  for (double eb : {1e38, 1e20, 1.0, 1e-30, 1e-45, 1e-300}) {
    double eb_abs;
    std::vector<float> y = roundtrip(x, {64, 64}, eb, SZ_EB_ABS, SZ_LOSSLESS_ZSTD, &eb_abs);
    EXPECT_LE(eb_abs, eb);
    check_bound(x, y, eb_abs);
  }
}

TEST(Host, RandomBitPatterns) {
  // every float class at once: denormals, huge values, NaN payloads, infinities, zeros
  std::mt19937 g(77);
  std::vector<float> x(50000);
  for (auto& v : x) {
    uint32_t u = g();
    if (g() % 3 == 0) u &= 0x807FFFFFu;  // a third denormal or zero
    std::memcpy(&v, &u, 4);
  }
  for (double eb : {1e-30, 1e-3, 1e3, 1e30}) {
    for (int lossless : {SZ_LOSSLESS_NONE, SZ_LOSSLESS_ZSTD}) {
      double eb_abs;
      std::vector<float> y = roundtrip(x, {50, 1000}, eb, SZ_EB_ABS, lossless, &eb_abs);
      check_bound(x, y, eb_abs);
    }
  }
}

TEST(Host, DenormalRangeRelMode) {
  // relative bound of a tiny range falls below the smallest float step: stored exactly
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 1e-41f * (float)(i % 17);
  double eb_abs;
  std::vector<float> y = roundtrip(x, {1000}, 1e-6, SZ_EB_REL, SZ_LOSSLESS_ZSTD, &eb_abs);
  check_bound(x, y, eb_abs);
  EXPECT_LE(eb_abs, 1e-6 * 16 * 1e-41 * 1.0001);
}

TEST(CppApi, RoundTripAndErrors) {
  std::vector<float> x = relu_sparse(5000, 0.7, 21);
  auto s = sz::compress(x.data(), {50, 100}, 1e-3, sz::Mode::Rel);
  auto info = sz::read_header(s.data(), s.size());
  EXPECT_EQ(info.ndims, 2u);
  EXPECT_EQ(info.dims[0], 50u);
  EXPECT_EQ(info.dims[1], 100u);
  std::vector<float> y = sz::decompress(s);
  check_bound(x, y, info.eb_abs);
  s[SZ_HEADER_SIZE + 3] ^= 0x10;
  EXPECT_THROW(sz::decompress(s), sz::Error);
}

}  // namespace
