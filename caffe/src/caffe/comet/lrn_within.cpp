// COMET-Caffe: LRN within a channel from its input alone (include/caffe/comet/lrn_within.hpp).
#include <algorithm>
#include <cmath>
#include <vector>

#include "caffe/comet/lrn_within.hpp"

namespace caffe {

namespace {

// One window of Caffe's average pooling with stride 1 and pad (size - 1) / 2, at output (ph, pw):
// the rows and columns it covers inside the plane and the size it divides by.
struct Window {
  Window(int ph, int pw, int size, int height, int width) {
    const int pad = (size - 1) / 2;
    h0 = ph - pad;
    w0 = pw - pad;
    h1 = std::min(h0 + size, height + pad);
    w1 = std::min(w0 + size, width + pad);
    count = (h1 - h0) * (w1 - w0);
    h0 = std::max(h0, 0);
    w0 = std::max(w0, 0);
    h1 = std::min(h1, height);
    w1 = std::min(w1, width);
  }
  int h0, h1, w0, w1, count;
};

// s = 1 + alpha m over one plane.
void PlaneDenominator(const LRNParameter& p, int height, int width, const float* x, float* s) {
  for (int ph = 0; ph < height; ++ph) {
    for (int pw = 0; pw < width; ++pw) {
      const Window win(ph, pw, p.local_size(), height, width);
      float sum = 0;
      for (int h = win.h0; h < win.h1; ++h)
        for (int w = win.w0; w < win.w1; ++w) sum += x[h * width + w] * x[h * width + w];
      s[ph * width + pw] = 1.f + p.alpha() * (sum / win.count);
    }
  }
}

}  // namespace

void CometLrnWithinScale(const LRNParameter& p, int planes, int height, int width, const float* x,
                         float* scale) {
  const int hw = height * width;
  for (int c = 0; c < planes; ++c) {
    float* s = scale + static_cast<size_t>(c) * hw;
    PlaneDenominator(p, height, width, x + static_cast<size_t>(c) * hw, s);
    for (int i = 0; i < hw; ++i) s[i] = std::pow(s[i], -p.beta());
  }
}

void CometLrnWithinBackward(const LRNParameter& p, int planes, int height, int width,
                            const float* x, const float* dy, float* dx) {
  const int hw = height * width;
  std::vector<float> s(hw), t(hw), shared(hw);
  const float two_alpha_beta = 2.f * p.alpha() * p.beta();
  for (int c = 0; c < planes; ++c) {
    const size_t off = static_cast<size_t>(c) * hw;
    const float* xp = x + off;
    const float* g = dy + off;
    float* out = dx + off;
    PlaneDenominator(p, height, width, xp, s.data());
    for (int i = 0; i < hw; ++i) {
      const float scale = std::pow(s[i], -p.beta());
      out[i] = g[i] * scale;            // through the product's input
      t[i] = g[i] * xp[i] * scale / s[i];  // through the scale: d/dm of (1 + alpha m)^-beta
    }
    std::fill(shared.begin(), shared.end(), 0.f);
    for (int ph = 0; ph < height; ++ph) {
      for (int pw = 0; pw < width; ++pw) {
        const Window win(ph, pw, p.local_size(), height, width);
        const float share = t[ph * width + pw] / win.count;
        for (int h = win.h0; h < win.h1; ++h)
          for (int w = win.w0; w < win.w1; ++w) shared[h * width + w] += share;
      }
    }
    for (int i = 0; i < hw; ++i) out[i] -= two_alpha_beta * xp[i] * shared[i];
  }
}

}  // namespace caffe
