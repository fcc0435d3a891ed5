// COMET-Caffe: the weight-gradient error of an input stored lossy, measured on a sample of the
// weights (include/caffe/comet/error_model.hpp).
#include <algorithm>
#include <cmath>
#include <vector>

#include "caffe/common.hpp"
#include "caffe/comet/error_model.hpp"
#include "caffe/comet/mask.hpp"
#include "sz/sz.h"

namespace caffe {

namespace {
// The channels a sample reads: whole channels (values_per_channel each), at most `cap` values and
// at least one channel, spread evenly over the middle group in at most 32 runs of neighbours
// (an Inception output concatenates branches whose errors differ: a block of neighbours would
// see one branch only). Runs keep the copies from device memory few.
std::vector<int> Spread(int channels, int group, size_t values_per_channel, size_t cap) {
  const int per_group = std::max(channels / std::max(group, 1), 1);
  const int count = static_cast<int>(std::max<size_t>(
      1, std::min<size_t>(per_group, cap / std::max<size_t>(values_per_channel, 1))));
  const int runs = std::min(count, 32);
  const int first = (group / 2) * per_group;
  std::vector<int> picked;
  for (int r = 0; r < runs; ++r) {
    // Run r of about count / runs channels, centred in its slot of about per_group / runs: all
    // channels when count is per_group.
    const int slot = first + per_group * r / runs, slot_end = first + per_group * (r + 1) / runs;
    const int run = std::min(count * (r + 1) / runs - count * r / runs, slot_end - slot);
    for (int i = 0; i < run; ++i) picked.push_back(slot + (slot_end - slot - run) / 2 + i);
  }
  return picked;
}

// Those channels of the first num images of an N x channels x plane blob: num x picked x plane.
std::vector<float> GatherChannels(const float* src, bool on_device, int num, int channels,
                                  size_t plane, const std::vector<int>& picked) {
  std::vector<float> out(static_cast<size_t>(num) * picked.size() * plane);
  for (size_t i = 0; i < picked.size();) {
    size_t j = i + 1;  // a run of neighbouring channels: one copy
    while (j < picked.size() && picked[j] == picked[j - 1] + 1) ++j;
    const std::vector<float> part = CometGatherRows(src, on_device, num, channels * plane,
                                                    picked[i] * plane, (j - i) * plane);
    for (int n = 0; n < num; ++n)
      std::copy(&part[n * (j - i) * plane], &part[(n + 1) * (j - i) * plane],
                &out[(n * picked.size() + i) * plane]);
    i = j;
  }
  return out;
}

}  // namespace

CometErrorSample CometSampleInput(const float* x, bool on_device, int num, int channels,
                                  int height, int width, double eb, bool signs,
                                  const CometWeightGeometry& g) {
  CometErrorSample s;
  if (!(eb > 0) || num <= 0 || channels <= 0 || height <= 0 || width <= 0) return s;
  const size_t plane = static_cast<size_t>(height) * width;
  s.images = std::min(num, kCometSampleImages);
  s.channels = Spread(channels, g.kind == CometWeightGeometry::CONVOLUTION ? g.group : 1,
                      s.images * plane, kCometErrorSample);
  s.x = GatherChannels(x, on_device, s.images, channels, plane, s.channels);
  s.eb = eb;
  s.signs = signs;
  s.num = num;
  s.height = height;
  s.width = width;
  s.valid = true;
  return s;
}

std::vector<double> CometLadder(double eb) {
  std::vector<double> bounds;
  for (int k = -kCometLadderSteps; k <= kCometLadderSteps; ++k) bounds.push_back(std::ldexp(eb, k));
  return bounds;
}

std::vector<double> CometWeightErrors(const CometErrorSample& s, const float* dy, bool on_device,
                                      int out_channels, int height, int width,
                                      const CometWeightGeometry& g,
                                      const std::vector<double>& bounds) {
  const int nb = bounds.size();
  // The sample's errors at each bound: nb x values.
  const size_t values = s.x.size();
  std::vector<float> e(nb * values);
  for (int b = 0; b < nb; ++b) {
    // x' as sz restores it (a block holding a NaN or Inf would come back exactly: rare enough
    // not to model), clamped as the sign mask does
    float* err = &e[b * values];
    CHECK_EQ(sz_restore_host(s.x.data(), values, bounds[b], err), SZ_OK);
    for (size_t i = 0; i < values; ++i) {
      const float r = s.signs ? comet_mask::apply_sign(err[i], comet_mask::bit_of(s.x[i]), 0)
                              : err[i];
      err[i] = r - s.x[i];
    }
  }
  const size_t plane = static_cast<size_t>(height) * width;
  const size_t in_plane = static_cast<size_t>(s.height) * s.width;
  const int images = s.images, in_count = s.channels.size();
  // Per weight and bound: the error is a sum over the num images of per-image parts a_n. From
  // the sampled images, E[a_n^2] (self) and E[a_n a_m], n != m (cross: what adds coherently
  // from image to image) give E[(sum a_n)^2] = num self + num (num - 1) cross, exact when every
  // image is sampled.
  std::vector<double> self(nb, 0.), cross(nb, 0.), part(nb), sum(nb), sq(nb);
  double weights = 0;
  const auto begin_weight = [&]() {
    std::fill(sum.begin(), sum.end(), 0.);
    std::fill(sq.begin(), sq.end(), 0.);
  };
  const auto end_image = [&]() {
    for (int b = 0; b < nb; ++b) {
      sum[b] += part[b];
      sq[b] += part[b] * part[b];
    }
  };
  const auto end_weight = [&]() {
    for (int b = 0; b < nb; ++b) {
      self[b] += sq[b] / images;
      if (images > 1) cross[b] += (sum[b] * sum[b] - sq[b]) / (images * (images - 1.));
    }
    weights += 1;
  };
  // Convolution; InnerProduct as a 1x1 convolution of 1x1 maps. Outputs in the group of the
  // sampled channels; the work, outputs x channels x kernel x images x plane x bounds
  // products, at most about 2^25.
  const bool conv = g.kind == CometWeightGeometry::CONVOLUTION;
  const int kh_n = conv ? g.kernel_h : 1, kw_n = conv ? g.kernel_w : 1;
  const double per_output = static_cast<double>(in_count) * kh_n * kw_n * images * plane * nb;
  const size_t cap = std::min<double>(kCometGradientSample,
                                      33554432. / per_output * images * plane);
  const std::vector<int> outputs = Spread(out_channels, conv ? g.group : 1, images * plane, cap);
  const int count = outputs.size();
  const std::vector<float> d = GatherChannels(dy, on_device, images, out_channels, plane,
                                              outputs);
  for (int o = 0; o < count; ++o) {
    for (int c = 0; c < in_count; ++c) {
      for (int kh = 0; kh < kh_n; ++kh) {
        for (int kw = 0; kw < kw_n; ++kw) {
          begin_weight();
          for (int n = 0; n < images; ++n) {
            std::fill(part.begin(), part.end(), 0.);
            const float* dp = &d[(static_cast<size_t>(n) * count + o) * plane];
            const size_t ep = (static_cast<size_t>(n) * in_count + c) * in_plane;
            for (int ph = 0; ph < height; ++ph) {
              const int ih = conv ? ph * g.stride_h - g.pad_h + kh * g.dilation_h : 0;
              if (ih < 0 || ih >= s.height) continue;
              for (int pw = 0; pw < width; ++pw) {
                const int iw = conv ? pw * g.stride_w - g.pad_w + kw * g.dilation_w : 0;
                if (iw < 0 || iw >= s.width) continue;
                const double v = dp[ph * width + pw];
                const size_t i = ep + ih * s.width + iw;
                for (int b = 0; b < nb; ++b) part[b] += v * e[b * values + i];
              }
            }
            end_image();
          }
          end_weight();
        }
      }
    }
  }
  std::vector<double> rms(nb);
  const double n = s.num;
  for (int b = 0; b < nb; ++b) {
    const double self_b = self[b] / std::max(weights, 1.), cross_b = cross[b] / std::max(weights, 1.);
    // Noise in a negative cross term can outweigh the rest: never below one image's share.
    rms[b] = std::sqrt(std::max(n * self_b + n * (n - 1) * cross_b, self_b));
  }
  return rms;
}

namespace {
// log-log slope of the error between two bounds.
double Slope(double b0, double e0, double b1, double e1) {
  return (std::log(e1) - std::log(e0)) / (std::log(b1) - std::log(b0));
}
// The bound where the line of this slope through (b, e) reaches the target.
double Along(double b, double e, double slope, double target) {
  return b * std::exp((std::log(target) - std::log(e)) / slope);
}
// Beyond the measured bounds: the end segment's slope clamped to [1, 4] (the error grows at
// least in proportion to the bound, and no faster than its fourth power).
double Clamp14(double slope) { return std::min(std::max(slope, 1.), 4.); }
// The curve as both readers of it take it: its running maximum (a dip, where the errors of
// clustered values happen to cancel, is not counted on). False where an error is zero or not
// finite: the errors then say nothing.
bool RunningMax(const std::vector<double>& errors, std::vector<double>* up) {
  *up = errors;
  for (int i = 0; i < up->size(); ++i) {
    if (!((*up)[i] > 0) || !std::isfinite((*up)[i])) return false;
    if (i > 0) (*up)[i] = std::max((*up)[i], (*up)[i - 1]);
  }
  return true;
}
// The line (log-log) through (bound, error) that both readers follow near a point.
struct Segment {
  double bound, error, slope;
};
// The segment that serves x, an error (x_is_error) or a bound: the one that ends at the first
// measured point past x; before the first point or past the last, the end segment with its slope
// clamped. False where the curve says nothing.
bool SegmentAt(const std::vector<double>& bounds, const std::vector<double>& errors, double x,
               bool x_is_error, Segment* seg) {
  const int n = bounds.size();
  if (n < 2 || !(x > 0)) return false;
  std::vector<double> up;
  if (!RunningMax(errors, &up)) return false;
  int k = 0;  // the first measured point past x
  while (k < n && !(x_is_error ? up[k] > x : x <= bounds[k])) ++k;
  // Between two points, that segment's own slope (> 0 where the curve crosses an error from below).
  const int at = k == 0 ? 0 : k - 1;  // the point the line goes through
  const int from = k == 0 ? 0 : k == n ? n - 2 : k - 1;
  seg->bound = bounds[at];
  seg->error = up[at];
  seg->slope = Slope(bounds[from], up[from], bounds[from + 1], up[from + 1]);
  if (k == 0 || k == n) seg->slope = Clamp14(seg->slope);
  return true;
}
}  // namespace

double CometIndependentWeightError(double dy_sumsq, int outputs, double eb) {
  return eb * std::sqrt(dy_sumsq / (3. * std::max(outputs, 1)));
}

double CometBoundForError(const std::vector<double>& bounds, const std::vector<double>& errors,
                          double target) {
  Segment s;
  if (!SegmentAt(bounds, errors, target, true, &s)) return -1;
  return Along(s.bound, s.error, s.slope, target);
}

double CometErrorAt(const std::vector<double>& bounds, const std::vector<double>& errors,
                    double eb) {
  Segment s;
  if (!SegmentAt(bounds, errors, eb, false, &s)) return -1;
  return s.error * std::exp(s.slope * std::log(eb / s.bound));
}

double CometDriftMargin(double margin, double predicted, double measured) {
  double m = std::pow(std::max(margin, 1.), 0.75);
  if (predicted > 0 && measured > 0 && std::isfinite(predicted) && std::isfinite(measured))
    m = std::max(m, measured / predicted);
  return std::min(std::max(m, 1.), kCometMaxDriftMargin);
}

std::vector<float> CometGatherRows(const float* src, bool on_device, int rows, size_t pitch,
                                   size_t offset, size_t width) {
  std::vector<float> out(static_cast<size_t>(rows) * width);
  if (out.empty()) return out;
  if (on_device) {
#ifndef CPU_ONLY
    CUDA_CHECK(cudaMemcpy2D(out.data(), width * sizeof(float), src + offset,
                            pitch * sizeof(float), width * sizeof(float), rows,
                            cudaMemcpyDeviceToHost));
#else
    NO_GPU;
#endif
  } else {
    for (int r = 0; r < rows; ++r)
      std::copy(src + offset + r * pitch, src + offset + r * pitch + width, &out[r * width]);
  }
  return out;
}

}  // namespace caffe
