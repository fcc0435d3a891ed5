// bench_loops.cpp - the store's host loops on one activation-sized blob, as the store runs them.
// Built and run by scripts/bench_loops against the CPU build (build/cpu); see docs/comet.md.
//
//   bench_loops [N C H W] [repeat]     (default 32 64 56 56: ResNet-18's res2 blobs at batch 32)
//
// Rows "worker" run as jobs on a CometWorker, one thread, as the store's background work does
// (the main thread only polls); rows "step" run on the calling thread with every core, as a
// layer's own work in the training step. Times are the best of `repeat` runs.
#include <algorithm>
#include <chrono>  // NOLINT(build/c++11)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>  // NOLINT(build/c++11)
#include <vector>

#include "caffe/comet/codes.hpp"
#include "caffe/comet/mask.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/worker.hpp"
#include "caffe/util/math_functions.hpp"

using caffe::CometPayload;
using caffe::shared_ptr;
namespace mask = caffe::comet_mask;

namespace {

typedef std::chrono::steady_clock Clock;
int repeat = 5;
size_t bytes = 0;  // of one float blob, for GB/s

double Ms(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void Row(const char* where, const std::string& what, double ms) {
  std::printf("| %-6s | %-58s | %8.2f | %6.2f |\n", where, what.c_str(), ms, bytes / ms / 1e6);
}

// Best of `repeat` runs of f on the calling thread.
double Best(const std::function<void()>& f) {
  double best = 1e30;
  for (int r = 0; r < repeat; ++r) {
    const Clock::time_point start = Clock::now();
    f();
    best = std::min(best, Ms(start));
  }
  return best;
}

// The same on the worker's thread: its codecs run single-threaded there (CometWorker::OnWorker).
// The main thread polls, so that Wait does not run the job itself.
double BestOnWorker(caffe::CometWorker* worker, const std::function<void()>& f) {
  double best = 1e30;
  for (int r = 0; r < repeat; ++r) {
    double ms = 0;
    const uint64_t t = worker->Submit([&f, &ms] {
      const Clock::time_point start = Clock::now();
      f();
      ms = Ms(start);
    });
    while (!worker->Done(t)) std::this_thread::sleep_for(std::chrono::microseconds(200));
    worker->Wait(t);  // done: returns at once, and orders ms's write before the read
    best = std::min(best, ms);
  }
  return best;
}

void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "bench_loops: %s\n", what.c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int N = 32, C = 64, H = 56, W = 56;
  if (argc >= 5) {
    N = std::atoi(argv[1]);
    C = std::atoi(argv[2]);
    H = std::atoi(argv[3]);
    W = std::atoi(argv[4]);
  }
  if (argc >= 6) repeat = std::max(1, std::atoi(argv[5]));
  Check(N > 0 && C > 0 && H > 0 && W > 0, "usage: bench_loops [N C H W] [repeat]");
  const size_t plane = static_cast<size_t>(H) * W, count = plane * C * N, words = count / 32;
  bytes = count * sizeof(float);
  // x_norm_-like values (about unit variance per channel), Scale's factors and ReLU after them
  std::mt19937 rng(1701);
  std::normal_distribution<float> gauss(0.f, 1.f);
  std::uniform_real_distribution<float> uni(0.5f, 1.5f);
  std::vector<float> x(count), y(count), out(count), t(count);
  std::vector<float> a(C), b(C), deviation(C);
  for (int c = 0; c < C; ++c) {
    a[c] = uni(rng);
    b[c] = uni(rng) - 1.f;
    deviation[c] = uni(rng);
  }
  for (size_t i = 0; i < count; ++i) {
    x[i] = gauss(rng);
    const size_t c = (i / plane) % C;
    const float v = a[c] * x[i] + b[c];
    y[i] = v > 0.f ? v : 0.f;
    t[i] = gauss(rng);
  }
  std::printf("blob %dx%dx%dx%d (%.1f MB), best of %d, %u hardware threads\n\n", N, C, H, W,
              bytes / 1e6, repeat, std::thread::hardware_concurrency());
  std::printf("| where  | loop                                                       |       ms |   GB/s |\n");
  std::printf("|--------|------------------------------------------------------------|---------:|-------:|\n");

  caffe::CometWorker worker;
  // The sign mask's words, for the mask loops below
  shared_ptr<CometPayload> m = caffe::CometEncodeMask(y.data(), count, false, "y");
  Check(m.get() != NULL, "the mask of y failed");
  const uint32_t* bits = static_cast<const uint32_t*>(m->data());

  // 1. A lossy blob's signs and ReLU's gradient: per value (the functions the CUDA kernels use)
  //    against a word of 32 values at a time (comet_mask::word32)
  Row("worker", "signs, per value (apply_sign)", BestOnWorker(&worker, [&] {
    for (size_t w = 0; w < words; ++w)
      for (int k = 0; k < 32; ++k) out[32 * w + k] = mask::apply_sign(x[32 * w + k], bits[w], k);
  }));
  Row("worker", "signs, a word at a time (word32::apply_signs)", BestOnWorker(&worker, [&] {
    std::memcpy(out.data(), x.data(), 32 * words * sizeof(float));
    for (size_t w = 0; w < words; ++w) mask::word32::apply_signs(&out[32 * w], bits[w]);
  }));
  Row("worker", "ReLU's gradient, per value (comet_codes::relu_diff)", BestOnWorker(&worker, [&] {
    for (size_t w = 0; w < words; ++w)
      for (int k = 0; k < 32; ++k)
        out[32 * w + k] = caffe::comet_codes::relu_diff(t[32 * w + k], bits[w], k, 0.f);
  }));
  Row("worker", "ReLU's gradient, a word at a time (word32::relu_diff)", BestOnWorker(&worker, [&] {
    for (size_t w = 0; w < words; ++w) mask::word32::relu_diff(&t[32 * w], &out[32 * w], bits[w], 0.f);
  }));

  // 2. The sign mask's encode, alone and with the largest magnitude from the same pass
  float largest = 0;
  bool finite = true;
  Row("worker", "sign mask (CometEncodeMask)", BestOnWorker(&worker, [&] {
    caffe::CometEncodeMask(y.data(), count, false, "y");
  }));
  Row("worker", "sign mask and largest magnitude, one pass", BestOnWorker(&worker, [&] {
    caffe::CometEncodeMask(y.data(), count, false, "y", &largest);
  }));
  Row("worker", "largest magnitude alone (CometMaxAbs)", BestOnWorker(&worker, [&] {
    largest = caffe::CometMaxAbs(y.data(), count, &finite);
  }));
  Check(finite && largest > 0, "the largest magnitude of y");

  // 3. x_norm_'s stream, and a conv input rebuilt from it through Scale and ReLU
  const double eb = 0.02;
  std::vector<int> shape;
  shape.push_back(N);
  shape.push_back(C);
  shape.push_back(H);
  shape.push_back(W);
  shared_ptr<CometPayload> xs;
  Row("worker", "x_norm_'s lossy encode (eb 0.02)", BestOnWorker(&worker, [&] {
    xs = caffe::CometEncodeLossy(x.data(), shape, false, eb, "x_norm");
  }));
  Check(xs.get() != NULL, "the encode of x failed");
  std::string error;
  bool ok = true;
  Row("worker", "x_norm_'s decode", BestOnWorker(&worker, [&] {
    ok = ok && caffe::CometDecode(*xs, out.data(), &error);
  }));
  Check(ok, "the decode of x failed: " + error);
  shared_ptr<CometPayload> derived = caffe::CometMakeDerived(xs, a, b, plane, m, 0.f, "y");
  std::vector<float> rebuilt(count);
  Row("worker", "a x + b and ReLU from the mask (CometRebuild)", BestOnWorker(&worker, [&] {
    ok = ok && caffe::CometRebuild(*derived, out.data(), rebuilt.data(), &error);
  }));
  Check(ok, "the rebuild failed: " + error);
  Row("step", "the same rebuild with every core", Best([&] {
    ok = ok && caffe::CometRebuild(*derived, out.data(), rebuilt.data(), &error);
  }));
  Check(ok, "the rebuild failed: " + error);
  double worst = 0;
  for (size_t i = 0; i < count; ++i) worst = std::max(worst, std::fabs(double(rebuilt[i]) - y[i]));
  Check(worst <= eb * 1.5 * 1.01, "the rebuilt blob is off by more than a eb");

  // 4. BatchNorm's temp_: the forward's two products with vectors of ones (upstream; the step's
  //    in-step rebuild) against the per-plane fill the worker runs ahead (RebuildAhead)
  std::vector<float> ones_n(N, 1.f), ones_s(plane, 1.f), num_by_chans(static_cast<size_t>(N) * C);
  Row("step", "BatchNorm temp_: two products with ones (caffe_cpu_gemm)", Best([&] {
    caffe::caffe_cpu_gemm<float>(CblasNoTrans, CblasNoTrans, N, C, 1, 1.f, ones_n.data(),
                                 deviation.data(), 0.f, num_by_chans.data());
    caffe::caffe_cpu_gemm<float>(CblasNoTrans, CblasNoTrans, N * C, plane, 1, 1.f,
                                 num_by_chans.data(), ones_s.data(), 0.f, out.data());
  }));
  Row("worker", "BatchNorm temp_: a fill per plane", BestOnWorker(&worker, [&] {
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c) {
        float* o = rebuilt.data() + (static_cast<size_t>(n) * C + c) * plane;
        std::fill(o, o + plane, deviation[c]);
      }
  }));
  Check(std::memcmp(out.data(), rebuilt.data(), bytes) == 0, "the fill differs from the products");
  Row("worker", "Scale's copy of x_norm_ (memcpy)", BestOnWorker(&worker, [&] {
    std::memcpy(out.data(), x.data(), bytes);
  }));
  return 0;
}
