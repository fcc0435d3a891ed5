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

void CometTieOffsets(int channels, const float* mean, const float* std, double n, float* offsets) {
  for (int c = 0; c < channels; ++c) offsets[c] = comet_bn::tie_offset(mean[c], std[c], n);
}

void CometAddChannelOffsets(size_t count, int channels, size_t inner, const float* offsets,
                            float sign, float* y) {
  for (size_t i = 0; i < count; i += inner) {
    const float o = sign * offsets[(i / inner) % channels];
    if (o == 0) continue;
    float* p = y + i;
    for (size_t k = 0; k < inner; ++k) p[k] += o;
  }
}

}  // namespace caffe
