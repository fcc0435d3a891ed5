#ifndef CAFFE_COMET_BATCHNORM_MOMENTS_HPP_
#define CAFFE_COMET_BATCHNORM_MOMENTS_HPP_

// COMET-Caffe: BatchNorm's x_norm_ read back lossy, moved back to the moments the exact one has
// before BatchNorm's backward reads it (docs/comet.md, "BatchNorm's x_norm_").
//
// With batch statistics, BatchNorm's forward makes each channel of y = x_norm_ = (x - mean) / std
// of mean 0 and mean square q = var / (var + eps) = 1 - eps / std^2, exactly, and its backward
// dx = (dy - mean(dy) - y mean(dy y)) / std relies on it: the exact dx sums to 0 over the channel
// and is orthogonal to y (up to eps). The errors e of a lossy y' = y + e have, over a channel's n
// values, a mean and a component along y of their own (about eb / sqrt(3 n) each), which the
// backward turns into gradient along y: the one direction the layers below meet coherently (y is
// linear in the weights of a Convolution below it). Where n is small (after an InnerProduct, n is
// the batch) that is most of the gradient error below BatchNorm (scripts/fuzz_nets seeds 246, 762
// and 1427: 20%, 51% and 32% of a weight gradient; 5.7%, 3.7% and 21% moved back).
//
// So each channel becomes y'' = (y' - mean(y')) a, with a such that the mean square of y'' is
// q: y'' lies where the exact y does. The move also shrinks y by about eb^2 / (6 q) on average (a
// rotated vector of the same length is shorter along the old direction), a bias along y that the
// correction outweighs only where the errors' component along y, about eb / sqrt(3 n q) of it,
// is the larger: n eb^2 < 12 q. Elsewhere (many values a channel: ResNet-18's BatchNorms at a
// bound of 0.25 from 784 values up) the channel is left as it is. The values move by mean(e) and
// (1 - a) y, both of order eb / sqrt(n): BatchNorm's backward reads values within eb of the
// exact ones plus that (where n is 4, up to about 2.5 eb).
//
// Errors are not always independent of the values: where many values are equal (BatchNorm after a
// ReLU: its zeros all become -mean / std) sz reconstructs a run of them with one common error (each
// is predicted from the last one reconstructed, and the residual rounds to 0), a mean and a
// component along y far above eb / sqrt(3 n). There every channel is moved, at any n (the plan's
// x_norm_ties): scripts/fuzz_nets seed 1582, 576 values a channel, a weight gradient below 17%
// off at a bound of 0.146 unmoved, 6.1% moved. (Elsewhere, near the cap of BatchNorm's rule,
// errors follow the values too, but moving them there can lose: seed 1513, a BatchNorm over a
// product of Sigmoid and Softmax outputs, 14% unmoved and 28% moved, below another BatchNorm that
// cancels most of the true gradient.)
//
// The per-channel arithmetic is shared by the CPU loop and the CUDA kernel
// (batchnorm_moments.cu), so the CPU tests cover both.

#include <cmath>

#include "caffe/comet/mask.hpp"  // COMET_HD

namespace caffe {

namespace comet_bn {

// What a channel becomes: y'' = (y' - m) a.
struct Move {
  float m, a;
};

// The exact mean square of a channel of x_norm_: q = 1 - eps / std^2.
COMET_HD double exact_mean_square(double std, double eps) {
  const double q = 1. - eps / (std * std);
  return q > 0 ? q : 0;
}

// Whether moving a channel of n values stored at bound eb gains (n eb^2 < 12 q): decided before
// its values are read, so a channel of many values costs nothing.
COMET_HD bool worth_moving(double n, double std, double eps, double eb) {
  return n * eb * eb < 12. * exact_mean_square(std, eps);
}

// The move of such a channel with sum s1 and sum of squares s2: to mean 0 and mean square q;
// none (m 0, a 1) where the values do not vary.
COMET_HD Move moment_move(double s1, double s2, double n, double std, double eps) {
  Move move;
  move.m = 0.f;
  move.a = 1.f;
  const double m = s1 / n;
  const double var = s2 / n - m * m;
  if (!(var > 0)) return move;
  move.m = static_cast<float>(m);
  move.a = static_cast<float>(sqrt(exact_mean_square(std, eps) / var));
  return move;
}

// BatchNorm after a ReLU (the plan's x_norm_ties) holds the ReLU's zeros as one value t = -mean /
// std a channel, and sz's quantizer, a grid through 0 (sz/src/quantizer.h), gives every one of them
// the same error: a shift of all the zeros, which the move above only partly undoes (scripts/
// fuzz_nets seed 314: a weight gradient below 9.6% off at a bound of 0.25, 8.6% moved). Stored as
// y - t they are 0, exact, and t is added back after decoding (4.3%). A channel's offset t; 0 (none)
// where t is not finite or beyond sqrt(n): no value of x_norm_ lies there (sum y^2 <= n), so the
// channel has no zeros.
COMET_HD float tie_offset(float mean, float std, double n) {
  const float t = -mean / std;
  return fabs(static_cast<double>(t)) <= sqrt(n) ? t : 0.f;  // (false for NaN)
}

// What the two roundings of y - t and y' + t may add to the error of y (|y|, |t| <= sqrt(n)): the
// shifted values are encoded at eb less this, so that x_norm_ comes back within eb.
inline double tie_shift_slack(double n, double eb) { return ldexp(3. * sqrt(n) + eb, -23); }

}  // namespace comet_bn

// x_norm_ y of num x channels x spatial values (host or device memory), stored at bound eb: each
// channel worth it (comet_bn::worth_moving), or every channel where y has runs of one value
// (ties), moved by comet_bn::moment_move; std: BatchNorm's variance_ after its forward
// (sqrt(var + eps)), on the same side.
void CometMatchBatchNormMoments(int num, int channels, int spatial, const float* std, float eps,
                                double eb, bool ties, float* y);
void CometMatchBatchNormMomentsGpu(int num, int channels, int spatial, const float* std,
                                   float eps, double eb, bool ties, float* y);

// offsets[c] = comet_bn::tie_offset(mean[c], std[c], n) (all three on the same side).
void CometTieOffsets(int channels, const float* mean, const float* std, double n, float* offsets);
void CometTieOffsetsGpu(int channels, const float* mean, const float* std, double n,
                        float* offsets);
// y += sign * offsets[c] over count values, `inner` a channel and image in a row (sign -1 before
// the encode, +1 after the decode).
void CometAddChannelOffsets(size_t count, int channels, size_t inner, const float* offsets,
                            float sign, float* y);
void CometAddChannelOffsetsGpu(size_t count, int channels, size_t inner, const float* offsets,
                               float sign, float* y);

}  // namespace caffe

#endif  // CAFFE_COMET_BATCHNORM_MOMENTS_HPP_
