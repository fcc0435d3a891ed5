// sz_bench - throughput of the CPU backend at several thread counts and, when built with
// CUDA and a device is present, of the CUDA backend, on generated ReLU-sparse NCHW data.
//   sz_bench [--mib SIZE] [--zeros FRAC] [--rel EB] [--threads 1,2,4] [--reps R] [--gpu] [--twin]
// Prints one line per configuration: ratio, max error / eb, compress and decompress GB/s.
// --twin adds the device code's steps run as CPU loops on one thread (device_twin.h): the
// work per value of the device encoder (plan, write) and decoder, where no GPU is.
#include "sz/sz.h"
#include "device_twin.h"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#ifdef SZC_CUDA
#include <cuda_runtime.h>
#endif

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  double mib = 256, zeros = 0.7, rel = 1e-3;
  int reps = 3;
  bool gpu = false, twin = false;
  std::vector<int> threads;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) { fprintf(stderr, "sz_bench: %s needs a value\n", a.c_str()); exit(2); }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      printf("usage: sz_bench [--mib S] [--zeros F] [--rel EB] [--threads 1,2] [--reps R] [--gpu] [--twin]\n"
             "Steady-state compress and decompress throughput (GB/s) of the host backend at each\n"
             "thread count, and of the device backend with --gpu, on generated activation-like\n"
             "data of S MiB with a fraction F of exact zeros, at relative bound EB. --twin: the\n"
             "device backend's steps as CPU loops on one thread (plan, write, decode).\n");
      return 0;
    }
    if (a == "--mib") mib = atof(next());
    else if (a == "--zeros") zeros = atof(next());
    else if (a == "--rel") rel = atof(next());
    else if (a == "--reps") reps = atoi(next());
    else if (a == "--gpu") gpu = true;
    else if (a == "--twin") twin = true;
    else if (a == "--threads") {
      std::string v = next();
      for (size_t p = 0; p < v.size();) {
        size_t c = v.find(',', p);
        threads.push_back(atoi(v.substr(p, c == std::string::npos ? std::string::npos : c - p).c_str()));
        if (c == std::string::npos) break;
        p = c + 1;
      }
    } else { fprintf(stderr, "usage: sz_bench [--mib S] [--zeros F] [--rel EB] [--threads 1,2] [--reps R] [--gpu] [--twin]\n"); return 2; }
  }
  if (threads.empty()) {
    unsigned h = std::thread::hardware_concurrency();
    for (unsigned t = 1; t <= (h ? h : 1); t *= 2) threads.push_back((int)t);
  }
  // NCHW with W = H = 64, C = 64: a correlated sequence along W, ReLU at a shifted level
  const size_t W = 64, H = 64, C = 64;
  size_t n = (size_t)(mib * 1048576.0 / 4.0);
  size_t N = std::max<size_t>(1, n / (C * H * W));
  n = N * C * H * W;
  size_t dims[4] = {N, C, H, W};
  std::vector<float> x(n);
  uint32_t s = 2463534242u;
  float acc = 0, thr = (float)(0.55 * std::sqrt(2.0) * 2.0 * (zeros - 0.5) * 1.8);
  for (size_t i = 0; i < n; ++i) {
    s ^= s << 13; s ^= s >> 17; s ^= s << 5;
    float u = (float)(s >> 8) * (1.0f / 16777216.0f) - 0.5f;
    acc = 0.85f * acc + u;
    float v = acc * 3.0f - thr;
    x[i] = v > 0 ? v : 0.0f;
  }
  size_t nz = 0;
  for (float v : x) nz += v == 0.0f;
  printf("data: %zu x %zu x %zu x %zu float32 (%.0f MiB), %.1f%% zeros, eb = %g x range\n", N, C, H, W,
         4.0 * n / 1048576.0, 100.0 * nz / n, rel);
  std::vector<uint8_t> out(sz_compress_bound(n));
  std::vector<float> y(n);
  for (int T : threads) {
    sz_params p;
    sz_params_default(&p, rel, SZ_EB_REL);
    p.nthreads = T;
    size_t size = 0;
    double ct = 1e30, dt = 1e30;
    for (int r = 0; r < reps; ++r) {
      double t0 = now();
      if (sz_compress_host_ex(x.data(), dims, 4, &p, out.data(), out.size(), &size) != SZ_OK) return 1;
      double t1 = now();
      if (sz_decompress_host_ex(out.data(), size, y.data(), n, T) != SZ_OK) return 1;
      double t2 = now();
      ct = std::min(ct, t1 - t0);
      dt = std::min(dt, t2 - t1);
    }
    sz_header_info h;
    sz_read_header(out.data(), size, &h);
    double me = 0;
    for (size_t i = 0; i < n; ++i) me = std::max(me, std::fabs((double)x[i] - y[i]));
    printf("cpu %2d threads: ratio %.2f  max_err/eb %.3f  compress %.2f GB/s  decompress %.2f GB/s\n", T,
           4.0 * n / size, me / h.eb_abs, 4e-9 * n / ct, 4e-9 * n / dt);
  }
  if (twin) {
    szi::TwinPlan plan;
    std::vector<uint8_t> stream;
    double pt = 1e30, wt = 1e30, dt = 1e30;
    for (int r = 0; r < reps; ++r) {
      double t0 = now();
      if (szi::twin_plan(x.data(), dims, 4, rel, SZ_EB_REL, &plan) != SZ_OK) return 1;
      double t1 = now();
      stream.resize(plan.stream_size());
      szi::twin_write(x.data(), plan, stream.data());
      double t2 = now();
      if (szi::twin_decompress(stream.data(), stream.size(), y.data(), n) != SZ_OK) return 1;
      double t3 = now();
      pt = std::min(pt, t1 - t0);
      wt = std::min(wt, t2 - t1);
      dt = std::min(dt, t3 - t2);
    }
    double me = 0;
    for (size_t i = 0; i < n; ++i) me = std::max(me, std::fabs((double)x[i] - y[i]));
    printf("twin 1 thread: ratio %.2f  max_err/eb %.3f  plan %.2f GB/s  write %.2f GB/s  "
           "compress %.2f GB/s  decompress %.2f GB/s\n", 4.0 * n / stream.size(),
           me / plan.h.eb_abs, 4e-9 * n / pt, 4e-9 * n / wt, 4e-9 * n / (pt + wt), 4e-9 * n / dt);
  }
#ifdef SZC_CUDA
  if (gpu) {
    int nd = 0;
    if (cudaGetDeviceCount(&nd) != cudaSuccess || nd == 0) { printf("gpu: no device\n"); return 0; }
    float *dx, *dy;
    void *dout, *dscr;
    size_t cap = sz_compress_bound(n), scr = sz_device_scratch_size(n);
    if (cudaMalloc(&dx, 4 * n) || cudaMalloc(&dy, 4 * n) || cudaMalloc(&dout, cap) || cudaMalloc(&dscr, scr)) {
      printf("gpu: cudaMalloc failed\n");
      return 1;
    }
    cudaMemcpy(dx, x.data(), 4 * n, cudaMemcpyHostToDevice);
    cudaStream_t st;
    cudaStreamCreate(&st);
    size_t size = 0;
    double ct = 1e30, dt = 1e30;
    for (int r = 0; r < reps + 1; ++r) {  // first round warms up
      double t0 = now();
      if (sz_compress_device(dx, dims, 4, rel, SZ_EB_REL, dout, cap, &size, dscr, scr, st) != SZ_OK) return 1;
      double t1 = now();
      if (sz_decompress_device(dout, size, dy, n, dscr, scr, st) != SZ_OK) return 1;
      double t2 = now();
      if (r) { ct = std::min(ct, t1 - t0); dt = std::min(dt, t2 - t1); }
    }
    cudaMemcpy(y.data(), dy, 4 * n, cudaMemcpyDeviceToHost);
    std::vector<uint8_t> g(size);
    cudaMemcpy(g.data(), dout, size, cudaMemcpyDeviceToHost);
    sz_header_info h;
    sz_read_header(g.data(), size, &h);
    double me = 0;
    for (size_t i = 0; i < n; ++i) me = std::max(me, std::fabs((double)x[i] - y[i]));
    printf("gpu: ratio %.2f  max_err/eb %.3f  compress %.1f GB/s  decompress %.1f GB/s\n", 4.0 * n / size,
           me / h.eb_abs, 4e-9 * n / ct, 4e-9 * n / dt);
    cudaFree(dx); cudaFree(dy); cudaFree(dout); cudaFree(dscr);
  }
#else
  if (gpu) printf("gpu: sz_bench built without CUDA\n");
#endif
  return 0;
}
