// test_gpu.cpp - CUDA backend: byte-identical streams to the CPU backend (lossless none),
// cross decoding bit for bit, corrupt-stream rejection, and a 1 GiB throughput report.
// Compiled whenever SZ_CUDA is on; every test skips with a message when no device exists.
#include "test_util.h"
#include "forge.h"
#include <cuda_runtime.h>
#include <chrono>

using namespace szt;

namespace {

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU()                                                         \
  if (!have_device()) GTEST_SKIP() << "no CUDA device: GPU test skipped"

template <class T>
struct DevBuf {
  T* p = nullptr;
  explicit DevBuf(size_t count) { EXPECT_EQ(cudaMalloc(&p, count * sizeof(T) + 16), cudaSuccess); }
  ~DevBuf() { cudaFree(p); }
};

std::vector<uint8_t> gpu_compress(const std::vector<float>& x, const std::vector<size_t>& dims,
                                  double eb, int mode) {
  size_t n = x.size();
  DevBuf<float> dx(n);
  size_t cap = sz_compress_bound(n);
  DevBuf<uint8_t> dout(cap);
  size_t scr = sz_device_scratch_size(n);
  DevBuf<uint8_t> dscr(scr);
  if (n) EXPECT_EQ(cudaMemcpy(dx.p, x.data(), 4 * n, cudaMemcpyHostToDevice), cudaSuccess);
  size_t size = 0;
  int st = sz_compress_device(dx.p, dims.data(), (int)dims.size(), eb, mode, dout.p, cap, &size,
                              dscr.p, scr, nullptr);
  EXPECT_EQ(st, SZ_OK) << sz_strerror(st);
  std::vector<uint8_t> s(st == SZ_OK ? size : 0);
  if (!s.empty()) EXPECT_EQ(cudaMemcpy(s.data(), dout.p, size, cudaMemcpyDeviceToHost), cudaSuccess);
  return s;
}

int gpu_decompress(const std::vector<uint8_t>& s, std::vector<float>& y) {
  DevBuf<uint8_t> din(s.size());
  DevBuf<float> dy(y.size());
  size_t scr = sz_device_scratch_size(y.size());
  DevBuf<uint8_t> dscr(scr);
  EXPECT_EQ(cudaMemcpy(din.p, s.data(), s.size(), cudaMemcpyHostToDevice), cudaSuccess);
  int st = sz_decompress_device(din.p, s.size(), dy.p, y.size(), dscr.p, scr, nullptr);
  if (st == SZ_OK && !y.empty())
    EXPECT_EQ(cudaMemcpy(y.data(), dy.p, 4 * y.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return st;
}

class GpuCpu : public ::testing::TestWithParam<std::tuple<ShapeCase, int>> {};

TEST_P(GpuCpu, SameStreamAndSameValues) {
  REQUIRE_GPU();
  const ShapeCase& c = std::get<0>(GetParam());
  int mode = std::get<1>(GetParam());
  std::vector<float> x = make_case(c);
  for (double eb : {1e-1, 1e-3}) {
    Stream cpu = compress(x, c.dims, eb, mode, SZ_LOSSLESS_NONE);
    ASSERT_EQ(cpu.status, SZ_OK);
    std::vector<uint8_t> gpu = gpu_compress(x, c.dims, eb, mode);
    ASSERT_EQ(gpu.size(), cpu.bytes.size());
    EXPECT_TRUE(gpu == cpu.bytes) << "GPU and CPU streams differ";
    std::vector<float> y_cpu(x.size()), y_gpu(x.size());
    ASSERT_EQ(sz_decompress_host(gpu.data(), gpu.size(), y_cpu.data(), y_cpu.size()), SZ_OK);
    ASSERT_EQ(gpu_decompress(cpu.bytes, y_gpu), SZ_OK);
    EXPECT_EQ(0, x.empty() ? 0 : std::memcmp(y_cpu.data(), y_gpu.data(), 4 * x.size()));
    sz_header_info info;
    ASSERT_EQ(sz_read_header(gpu.data(), gpu.size(), &info), SZ_OK);
    check_bound(x, y_gpu, info.eb_abs);
  }
}

INSTANTIATE_TEST_SUITE_P(Device, GpuCpu,
                         ::testing::Combine(::testing::ValuesIn(device_cases()),
                                            ::testing::Values(SZ_EB_ABS, SZ_EB_REL)),
                         case_mode_name<::testing::TestParamInfo<GpuCpu::ParamType>>);

// Plan, then write into a buffer of exactly the planned size: the one-call stream, byte for
// byte; a write must match its plan's request and fit.
TEST(Device, PlanThenWriteExactSize) {
  REQUIRE_GPU();
  std::vector<float> x = relu_sparse(3 * 64 * 64, 0.6, 10);
  const size_t dims[3] = {3, 64, 64}, n = x.size();
  Stream cpu = compress(x, {3, 64, 64}, 1e-2, SZ_EB_REL, SZ_LOSSLESS_NONE);
  ASSERT_EQ(cpu.status, SZ_OK);
  DevBuf<float> dx(n);
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), 4 * n, cudaMemcpyHostToDevice), cudaSuccess);
  const size_t scr = sz_device_scratch_size(n);
  DevBuf<uint8_t> dscr(scr);
  ASSERT_EQ(cudaMemset(dscr.p, 0, scr), cudaSuccess);
  size_t planned = 0, size = 0;
  DevBuf<uint8_t> early(cpu.bytes.size());
  EXPECT_EQ(sz_compress_device_write(dx.p, dims, 3, 1e-2, SZ_EB_REL, early.p, cpu.bytes.size(),
                                     &size, dscr.p, scr, nullptr),
            SZ_ERR_PARAM);  // no plan in the scratch yet
  ASSERT_EQ(sz_compress_device_plan(dx.p, dims, 3, 1e-2, SZ_EB_REL, dscr.p, scr, &planned, nullptr),
            SZ_OK);
  ASSERT_EQ(planned, cpu.bytes.size());
  uint8_t* exact = nullptr;
  ASSERT_EQ(cudaMalloc(&exact, planned), cudaSuccess);
  EXPECT_EQ(sz_compress_device_write(dx.p, dims, 3, 1e-2, SZ_EB_REL, exact, planned - 1, &size,
                                     dscr.p, scr, nullptr),
            SZ_ERR_BUFFER);
  EXPECT_EQ(sz_compress_device_write(dx.p, dims, 3, 2e-2, SZ_EB_REL, exact, planned, &size, dscr.p,
                                     scr, nullptr),
            SZ_ERR_PARAM);  // another bound than the plan's
  const size_t other[3] = {3, 32, 128};
  EXPECT_EQ(sz_compress_device_write(dx.p, other, 3, 1e-2, SZ_EB_REL, exact, planned, &size, dscr.p,
                                     scr, nullptr),
            SZ_ERR_PARAM);  // another shape
  ASSERT_EQ(sz_compress_device_write(dx.p, dims, 3, 1e-2, SZ_EB_REL, exact, planned, &size, dscr.p,
                                     scr, nullptr),
            SZ_OK);
  ASSERT_EQ(size, planned);
  std::vector<uint8_t> got(planned);
  ASSERT_EQ(cudaMemcpy(got.data(), exact, planned, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(got == cpu.bytes);
  cudaFree(exact);
}

TEST(Device, CorruptAndForeignRejected) {
  REQUIRE_GPU();
  std::vector<float> x = relu_sparse(4000, 0.5, 8);
  Stream s = compress(x, {4000}, 1e-2, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(s.status, SZ_OK);
  std::vector<float> y(x.size());
  int rejected = 0, tried = 0;
  for (size_t i = 0; i < s.bytes.size(); i += 7) {
    std::vector<uint8_t> c = s.bytes;
    c[i] ^= 0x5A;
    tried++;
    if (gpu_decompress(c, y) < 0) rejected++;
  }
  EXPECT_EQ(rejected, tried);
  std::vector<uint8_t> t(s.bytes.begin(), s.bytes.end() - 1);
  EXPECT_EQ(gpu_decompress(t, y), SZ_ERR_TRUNCATED);
  Stream z = compress(x, {4000}, 1e-2, SZ_EB_ABS, SZ_LOSSLESS_ZSTD);
  EXPECT_EQ(gpu_decompress(z.bytes, y), SZ_ERR_UNSUPPORTED);
  std::vector<float> small(10);
  EXPECT_EQ(gpu_decompress(s.bytes, small), SZ_ERR_BUFFER);
}

// The device decoder's host-side checks match the host decoder's: forged bounds, trailing
// bytes, empty input, a coded block in a stream whose bound admits none.
TEST(Device, StrictStreams) {
  REQUIRE_GPU();
  std::vector<float> x = relu_sparse(4000, 0.5, 9);
  Stream s = compress(x, {4000}, 1e-2, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(s.status, SZ_OK);
  std::vector<float> y(x.size());
  ASSERT_EQ(gpu_decompress(with_eb_abs(s.bytes, 1e-2f * 0.999f), y), SZ_ERR_CORRUPT);
  ASSERT_EQ(gpu_decompress(with_eb_abs(s.bytes, 0.0f), y), SZ_ERR_CORRUPT);
  ASSERT_EQ(gpu_decompress(with_eb_abs(s.bytes, 1.0f), y), SZ_ERR_CORRUPT);
  ASSERT_EQ(gpu_decompress(with_eb_req(s.bytes, 1.0), y), SZ_ERR_CORRUPT);
  std::vector<uint8_t> t = s.bytes;
  t.push_back(0);
  EXPECT_EQ(gpu_decompress(t, y), SZ_ERR_TRAILING);
  t.clear();
  EXPECT_EQ(gpu_decompress(t, y), SZ_ERR_EMPTY);
  std::vector<float> r = random_uniform(64, 5), yr(64);
  Stream raw = compress(r, {64}, 1e-300, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(raw.status, SZ_OK);
  ASSERT_EQ(gpu_decompress(raw.bytes, yr), SZ_OK);
  EXPECT_EQ(std::memcmp(r.data(), yr.data(), 4 * r.size()), 0);
  std::vector<uint8_t> c = raw.bytes;
  szi::store_u16le(c.data() + SZ_HEADER_SIZE + 1, (uint16_t)(31 | 1 << 6 | 32 << 7));
  reseal(c);
  EXPECT_EQ(gpu_decompress(c, yr), SZ_ERR_CORRUPT);
}

TEST(Device, ScratchAndCapacityChecked) {
  REQUIRE_GPU();
  std::vector<float> x = random_uniform(10000, 4);
  DevBuf<float> dx(x.size());
  DevBuf<uint8_t> dout(200), dscr(16);
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), 4 * x.size(), cudaMemcpyHostToDevice), cudaSuccess);
  size_t dims[1] = {x.size()}, size = 0;
  EXPECT_EQ(sz_compress_device(dx.p, dims, 1, 1e-3, SZ_EB_ABS, dout.p, 200, &size, dscr.p, 16, nullptr),
            SZ_ERR_SCRATCH);
  size_t scr = sz_device_scratch_size(x.size());
  DevBuf<uint8_t> big(scr);
  EXPECT_EQ(sz_compress_device(dx.p, dims, 1, 1e-3, SZ_EB_ABS, dout.p, 200, &size, big.p, scr, nullptr),
            SZ_ERR_BUFFER);
  // a buffer large enough for the descriptors but not for the data
  DevBuf<uint8_t> mid(2000);
  EXPECT_EQ(sz_compress_device(dx.p, dims, 1, 1e-6, SZ_EB_ABS, mid.p, 2000, &size, big.p, scr, nullptr),
            SZ_ERR_BUFFER);
}

// Not a timed test: prints GPU throughput on a 1 GiB ReLU-sparse NCHW tensor.
TEST(DeviceThroughput, OneGiB) {
  REQUIRE_GPU();
  const size_t dims_v[4] = {64, 64, 256, 256};  // 2^28 floats = 1 GiB
  const size_t n = (size_t)1 << 28;
  std::vector<float> x = relu_sparse(n, 0.7, 42);
  DevBuf<float> dx(n), dy(n);
  size_t cap = sz_compress_bound(n), scr = sz_device_scratch_size(n);
  DevBuf<uint8_t> dout(cap), dscr(scr);
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), 4 * n, cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  for (double rel : {1e-2, 1e-3, 1e-4}) {
    size_t size = 0;
    ASSERT_EQ(sz_compress_device(dx.p, dims_v, 4, rel, SZ_EB_REL, dout.p, cap, &size, dscr.p, scr, s), SZ_OK);
    const int reps = 5;
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r)
      ASSERT_EQ(sz_compress_device(dx.p, dims_v, 4, rel, SZ_EB_REL, dout.p, cap, &size, dscr.p, scr, s), SZ_OK);
    auto t1 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r)
      ASSERT_EQ(sz_decompress_device(dout.p, size, dy.p, n, dscr.p, scr, s), SZ_OK);
    auto t2 = std::chrono::steady_clock::now();
    double ct = std::chrono::duration<double>(t1 - t0).count() / reps;
    double dt = std::chrono::duration<double>(t2 - t1).count() / reps;
    printf("GPU 1 GiB relu70 rel=%g: ratio %.2f  compress %.1f GB/s  decompress %.1f GB/s\n", rel,
           4.0 * n / size, 4e-9 * n / ct, 4e-9 * n / dt);
    std::vector<float> y(n);
    ASSERT_EQ(cudaMemcpy(y.data(), dy.p, 4 * n, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<uint8_t> stream(size);
    ASSERT_EQ(cudaMemcpy(stream.data(), dout.p, size, cudaMemcpyDeviceToHost), cudaSuccess);
    sz_header_info info;
    ASSERT_EQ(sz_read_header(stream.data(), size, &info), SZ_OK);
    double maxerr = 0;
    for (size_t i = 0; i < n; ++i) maxerr = std::max(maxerr, std::fabs((double)x[i] - (double)y[i]));
    EXPECT_LE(maxerr, info.eb_abs);
  }
  cudaStreamDestroy(s);
}

}  // namespace
