#ifndef CAFFE_COMET_LRN_WITHIN_HPP_
#define CAFFE_COMET_LRN_WITHIN_HPP_

// COMET-Caffe: LRN within a channel from its input alone. Upstream computes it with a chain of
// internal layers (Split, Power x^2, average Pooling over the window, Power (1 + alpha mean)^-beta,
// Eltwise PROD) whose backward holds three internal outputs and five internal gradients, each as
// large as the input: on upstream's CIFAR-10 full net that chain was the training step's peak. The
// store computes the input gradient from the input and the output gradient instead (docs/comet.md,
// "LRN within a channel"), on the CPU and on the GPU, with the chain's arithmetic in another order
// (the results agree to float rounding, not bit for bit). The per-element logic below is shared by
// the CPU code (lrn_within.cpp) and the CUDA kernel (lrn_within.cu), so the CPU tests cover both.

#include <cmath>

#include "caffe/comet/mask.hpp"  // COMET_HD
#include "caffe/proto/caffe.pb.h"

namespace caffe {

namespace comet_lrn {

// What the per-element functions need of an LRNParameter (a plain struct a kernel can take).
struct Geometry {
  int size;  // local_size: windows of size x size, padded by (size - 1) / 2
  int height, width;
  float alpha, beta;
};

// One window of Caffe's average pooling with stride 1 and pad (size - 1) / 2, at output (ph, pw):
// the rows [h0, h1) and columns [w0, w1) it covers inside the plane, and the size it divides by
// (its extent within the padded plane, as upstream's AVE pooling counts it).
struct Window {
  int h0, h1, w0, w1, count;
};

COMET_HD int imin(int a, int b) { return a < b ? a : b; }
COMET_HD int imax(int a, int b) { return a > b ? a : b; }

COMET_HD Window window_at(int ph, int pw, const Geometry& g) {
  const int pad = (g.size - 1) / 2;
  Window v;
  v.h0 = ph - pad;
  v.w0 = pw - pad;
  v.h1 = imin(v.h0 + g.size, g.height + pad);
  v.w1 = imin(v.w0 + g.size, g.width + pad);
  v.count = (v.h1 - v.h0) * (v.w1 - v.w0);
  v.h0 = imax(v.h0, 0);
  v.w0 = imax(v.w0, 0);
  v.h1 = imin(v.h1, g.height);
  v.w1 = imin(v.w1, g.width);
  return v;
}

// s = 1 + alpha m at (ph, pw) of one plane x, m the window's mean of x^2.
COMET_HD float denominator(const float* x, int ph, int pw, const Geometry& g) {
  const Window v = window_at(ph, pw, g);
  float sum = 0.f;
  for (int h = v.h0; h < v.h1; ++h)
    for (int w = v.w0; w < v.w1; ++w) sum += x[h * g.width + w] * x[h * g.width + w];
  return 1.f + g.alpha * (sum / v.count);
}

// The scale S = s^-beta, and the gradient's share through the scale at one element:
// t = dy x S / s (d/dm of (1 + alpha m)^-beta, without the factor -alpha beta).
COMET_HD float scale_of(float s, const Geometry& g) { return powf(s, -g.beta); }
COMET_HD float through_scale(float dy, float x, float s, const Geometry& g) {
  return dy * x * scale_of(s, g) / s;
}

// P(t) at (h, w): average pooling's backward, the sum of t / count over the windows that cover
// (h, w) (window (ph, pw) covers rows ph - pad .. ph - pad + size - 1). `t_at(ph, pw)` gives t.
template <typename T>
COMET_HD float shared_at(int h, int w, const Geometry& g, const T& t_at) {
  const int pad = (g.size - 1) / 2;
  const int ph0 = imax(h + pad - g.size + 1, 0), ph1 = imin(h + pad, g.height - 1);
  const int pw0 = imax(w + pad - g.size + 1, 0), pw1 = imin(w + pad, g.width - 1);
  float sum = 0.f;
  for (int ph = ph0; ph <= ph1; ++ph)
    for (int pw = pw0; pw <= pw1; ++pw) sum += t_at(ph, pw) / window_at(ph, pw, g).count;
  return sum;
}

// t read from a plane the CPU computed first.
struct TFromPlane {
  const float* t;
  int width;
  COMET_HD float operator()(int ph, int pw) const { return t[ph * width + pw]; }
};

// t computed where it is needed, from the plane's input and output gradient (the GPU's kernel:
// no buffer, each window's denominator computed again by each element it covers).
struct TFromInput {
  const float* x;
  const float* dy;
  Geometry g;
  COMET_HD float operator()(int ph, int pw) const {
    const int i = ph * g.width + pw;
    return through_scale(dy[i], x[i], denominator(x, ph, pw, g), g);
  }
};

// dx at (h, w) of one plane, from its input x and output gradient dy alone (what the GPU's
// kernel computes per element): dy S - 2 alpha beta x P(t).
COMET_HD float backward_at(const float* x, const float* dy, int h, int w, const Geometry& g) {
  const int i = h * g.width + w;
  const TFromInput t = {x, dy, g};
  return dy[i] * scale_of(denominator(x, h, w, g), g) -
         2.f * g.alpha * g.beta * x[i] * shared_at(h, w, g, t);
}

}  // namespace comet_lrn

comet_lrn::Geometry CometLrnGeometry(const LRNParameter& p, int height, int width);

// The scale S = (1 + alpha m)^-beta of `planes` planes of height x width, m the mean of x^2 over
// each local_size x local_size window (padded by (local_size - 1) / 2, divided by the window's
// size within the padded plane, as Caffe's average pooling divides): LRN's output is x S.
void CometLrnWithinScale(const LRNParameter& p, int planes, int height, int width, const float* x,
                         float* scale);

// LRN's input gradient dx = dy S - 2 alpha beta x P(dy x S / s), s = 1 + alpha m, P the average
// pooling's backward (each window's value shared out over its elements, divided by its size).
void CometLrnWithinBackward(const LRNParameter& p, int planes, int height, int width,
                            const float* x, const float* dy, float* dx);

#ifndef CPU_ONLY
// The same on the GPU (device pointers; on this thread's stream, stream.hpp): a thread per
// element, comet_lrn::backward_at.
void CometLrnWithinBackwardGpu(const LRNParameter& p, int planes, int height, int width,
                               const float* x, const float* dy, float* dx);
#endif

}  // namespace caffe

#endif  // CAFFE_COMET_LRN_WITHIN_HPP_
