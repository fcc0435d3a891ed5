// bench_weight_rule.cpp - what the weight rule's measurement costs per layer (error_model.hpp):
// the sample taken when an input is encoded (CometSampleInput) and the ladder of errors computed
// from it and the output gradient before the layer's backward (CometWeightErrors), on the layer
// shapes of ResNet-18, CaffeNet's grouped conv2 and depthwise convolutions. Built and run by
// scripts/bench_weight_rule against the CPU build (build/cpu); see docs/comet.md.
//
//   bench_weight_rule [batch] [repeat]     (default 32 5)
//
// Inputs: a third zeros, the rest uniform in [0, 2) (as after a ReLU); output gradients uniform in
// [-1, 1). Times are the best of `repeat` runs; exits 1 when an error of the ladder is not a
// positive finite number or is less than half the one at the bound below (errors grow with it).
#include <chrono>  // NOLINT(build/c++11)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "caffe/comet/error_model.hpp"

using caffe::CometErrorSample;
using caffe::CometWeightGeometry;

struct Shape {
  const char* name;
  int channels, size, group, kernel, stride;
};

int main(int argc, char** argv) {
  const int batch = argc > 1 ? atoi(argv[1]) : 32;
  const int repeat = argc > 2 ? atoi(argv[2]) : 5;
  const Shape shapes[] = {
      {"ResNet-18 res2 3x3", 64, 56, 1, 3, 1},     {"ResNet-18 res3 3x3", 128, 28, 1, 3, 1},
      {"ResNet-18 res4 3x3", 256, 14, 1, 3, 1},    {"ResNet-18 res5 3x3", 512, 7, 1, 3, 1},
      {"CaffeNet conv2 (2 groups)", 96, 27, 2, 5, 1}, {"depthwise 3x3, 56x56", 64, 56, 64, 3, 1},
      {"depthwise 3x3, 28x28", 128, 28, 128, 3, 1}, {"depthwise 3x3, 14x14", 256, 14, 256, 3, 1},
      {"depthwise 3x3 stride 2", 128, 56, 128, 3, 2}};
  std::mt19937 rng(1701);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  bool ok = true;
  printf("batch %d, best of %d runs, one thread\n\n", batch, repeat);
  printf("| layer input | channels x size | groups | sampled: channels x images | sample | ms |\n");
  printf("|---|---:|---:|---:|---:|---:|\n");
  for (const Shape& sh : shapes) {
    const int out = (sh.size + 2 * (sh.kernel / 2) - sh.kernel) / sh.stride + 1;
    std::vector<float> x(static_cast<size_t>(batch) * sh.channels * sh.size * sh.size);
    std::vector<float> dy(static_cast<size_t>(batch) * sh.channels * out * out);
    for (float& v : x) v = u(rng) < 1.f / 3 ? 0.f : 2.f * u(rng);
    for (float& v : dy) v = 2.f * u(rng) - 1.f;
    CometWeightGeometry g;
    g.kernel_h = g.kernel_w = sh.kernel;
    g.pad_h = g.pad_w = sh.kernel / 2;
    g.stride_h = g.stride_w = sh.stride;
    g.group = sh.group;
    const std::vector<double> ladder = caffe::CometLadder(1e-2);
    double best = 1e30;
    CometErrorSample s;
    std::vector<double> errors;
    for (int r = 0; r < repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      s = caffe::CometSampleInput(x.data(), false, batch, sh.channels, sh.size, sh.size, 1e-2,
                                  true, g);
      errors = caffe::CometWeightErrors(s, dy.data(), false, sh.channels, out, out, g, ladder);
      const std::chrono::duration<double, std::milli> ms = std::chrono::steady_clock::now() - t0;
      best = std::min(best, ms.count());
    }
    for (size_t b = 0; b < errors.size(); ++b) {
      const bool falls = b > 0 && errors[b] < errors[b - 1] * 0.5;
      if (!(errors[b] > 0) || !std::isfinite(errors[b]) || falls) {
        fprintf(stderr, "%s: error %g at bound %g\n", sh.name, errors[b], ladder[b]);
        ok = false;
      }
    }
    printf("| %s | %d x %dx%d | %d | %zu x %d | %.0f KB | %.1f |\n", sh.name, sh.channels, sh.size,
           sh.size, sh.group, s.channels.size(), s.images, s.x.size() * 4 / 1024., best);
  }
  return ok ? 0 : 1;
}
