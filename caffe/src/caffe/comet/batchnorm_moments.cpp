// COMET-Caffe: BatchNorm's lossy x_norm_ moved back to its exact moments, on the CPU
// (include/caffe/comet/batchnorm_moments.hpp).
#include "caffe/comet/batchnorm_moments.hpp"

#include <cstddef>

namespace caffe {

void CometMatchBatchNormMoments(int num, int channels, int spatial, const float* std, float eps,
                                double eb, bool ties, float* y) {
  const double n = static_cast<double>(num) * spatial;
  for (int c = 0; c < channels; ++c) {
    if (!ties && !comet_bn::worth_moving(n, std[c], eps, eb)) continue;
    double s1 = 0, s2 = 0;
    for (int k = 0; k < num; ++k) {
      const float* p = y + (static_cast<size_t>(k) * channels + c) * spatial;
      for (int i = 0; i < spatial; ++i) {
        s1 += p[i];
        s2 += static_cast<double>(p[i]) * p[i];
      }
    }
    const comet_bn::Move move = comet_bn::moment_move(s1, s2, n, std[c], eps);
    for (int k = 0; k < num; ++k) {
      float* p = y + (static_cast<size_t>(k) * channels + c) * spatial;
      for (int i = 0; i < spatial; ++i) p[i] = (p[i] - move.m) * move.a;
    }
  }
}

}  // namespace caffe
