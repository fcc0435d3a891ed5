// COMET-Caffe: LRN within a channel from its input alone (include/caffe/comet/lrn_within.hpp).
#include <vector>

#include "caffe/comet/lrn_within.hpp"

namespace caffe {

comet_lrn::Geometry CometLrnGeometry(const LRNParameter& p, int height, int width) {
  comet_lrn::Geometry g;
  g.size = p.local_size();
  g.height = height;
  g.width = width;
  g.alpha = p.alpha();
  g.beta = p.beta();
  return g;
}

void CometLrnWithinScale(const LRNParameter& p, int planes, int height, int width, const float* x,
                         float* scale) {
  const comet_lrn::Geometry g = CometLrnGeometry(p, height, width);
  const int hw = height * width;
  for (int c = 0; c < planes; ++c) {
    const float* xp = x + static_cast<size_t>(c) * hw;
    float* s = scale + static_cast<size_t>(c) * hw;
    for (int h = 0; h < height; ++h)
      for (int w = 0; w < width; ++w)
        s[h * width + w] = comet_lrn::scale_of(comet_lrn::denominator(xp, h, w, g), g);
  }
}

// Per plane: the denominators and t once (a window's t is shared by every element it covers),
// then each element's gradient from them; the GPU's kernel computes t where it needs it.
void CometLrnWithinBackward(const LRNParameter& p, int planes, int height, int width,
                            const float* x, const float* dy, float* dx) {
  const comet_lrn::Geometry g = CometLrnGeometry(p, height, width);
  const int hw = height * width;
  std::vector<float> scale(hw), t(hw);
  const float two_alpha_beta = 2.f * g.alpha * g.beta;
  const comet_lrn::TFromPlane t_at = {t.data(), width};
  for (int c = 0; c < planes; ++c) {
    const size_t off = static_cast<size_t>(c) * hw;
    const float* xp = x + off;
    const float* gp = dy + off;
    float* out = dx + off;
    for (int h = 0; h < height; ++h) {
      for (int w = 0; w < width; ++w) {
        const int i = h * width + w;
        const float s = comet_lrn::denominator(xp, h, w, g);
        scale[i] = comet_lrn::scale_of(s, g);
        t[i] = comet_lrn::through_scale(gp[i], xp[i], s, g);
      }
    }
    for (int h = 0; h < height; ++h) {
      for (int w = 0; w < width; ++w) {
        const int i = h * width + w;
        out[i] = gp[i] * scale[i] - two_alpha_beta * xp[i] * comet_lrn::shared_at(h, w, g, t_at);
      }
    }
  }
}

}  // namespace caffe
