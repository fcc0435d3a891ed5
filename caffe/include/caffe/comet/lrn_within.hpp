#ifndef CAFFE_COMET_LRN_WITHIN_HPP_
#define CAFFE_COMET_LRN_WITHIN_HPP_

// COMET-Caffe: LRN within a channel from its input alone. Upstream computes it with a chain of
// internal layers (Split, Power x^2, average Pooling over the window, Power (1 + alpha mean)^-beta,
// Eltwise PROD) whose backward holds three internal outputs and five internal gradients, each as
// large as the input: on upstream's CIFAR-10 full net that chain was the training step's peak. On
// the CPU the store computes the input gradient from the input and the output gradient instead
// (docs/comet.md, "LRN within a channel"), with the chain's arithmetic in another order (the
// results agree to float rounding, not bit for bit).

#include "caffe/proto/caffe.pb.h"

namespace caffe {

// The scale S = (1 + alpha m)^-beta of `planes` planes of height x width, m the mean of x^2 over
// each local_size x local_size window (padded by (local_size - 1) / 2, divided by the window's
// size within the padded plane, as Caffe's average pooling divides): LRN's output is x S.
void CometLrnWithinScale(const LRNParameter& p, int planes, int height, int width, const float* x,
                         float* scale);

// LRN's input gradient dx = dy S - 2 alpha beta x P(dy x S / s), s = 1 + alpha m, P the average
// pooling's backward (each window's value shared out over its elements, divided by its size).
void CometLrnWithinBackward(const LRNParameter& p, int planes, int height, int width,
                            const float* x, const float* dy, float* dx);

}  // namespace caffe

#endif  // CAFFE_COMET_LRN_WITHIN_HPP_
