// COMET-Caffe: the weight-gradient error of an input stored lossy, measured on a sample of the
// weights (include/caffe/comet/error_model.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "caffe/common.hpp"
#include "caffe/comet/error_model.hpp"
#include "caffe/comet/mask.hpp"
#include "caffe/comet/stream.hpp"
#include "sz/sz.h"

namespace caffe {

namespace {
// `count` of a layer's `group` groups, spread evenly over them (the middle one when one).
std::vector<int> PickGroups(int group, int count) {
  std::vector<int> picked;
  for (int k = 0; k < count; ++k)
    picked.push_back(static_cast<int>((2 * k + 1) * static_cast<int64_t>(group) / (2 * count)));
  return picked;
}

// The channels a sample reads: about `count` whole channels (at least one in each group), split
// evenly over `groups` (of per_group channels each), spread over each in runs of neighbours,
// 32 runs at most but one a group (an Inception output concatenates branches whose errors
// differ: a block of neighbours would see one branch only). Runs keep the copies from device
// memory few.
std::vector<int> Spread(const std::vector<int>& groups, int per_group, int count) {
  std::vector<int> picked;
  const int ng = groups.size();
  for (int k = 0; k < ng; ++k) {
    const int in_group = std::min(std::max(count * (k + 1) / ng - count * k / ng, 1), per_group);
    const int runs = std::min(in_group, std::max(32 / ng, 1));
    const int first = groups[k] * per_group;
    for (int r = 0; r < runs; ++r) {
      // Run r of about in_group / runs channels, centred in its slot of about per_group / runs:
      // all channels when in_group is per_group.
      const int slot = first + per_group * r / runs, slot_end = first + per_group * (r + 1) / runs;
      const int run = std::min(in_group * (r + 1) / runs - in_group * r / runs, slot_end - slot);
      for (int i = 0; i < run; ++i) picked.push_back(slot + (slot_end - slot - run) / 2 + i);
    }
  }
  return picked;
}

// The first output position o >= 0 with o * stride >= first_in: for first_in = -offset, the
// first whose input position o * stride + offset is inside the input; for size - offset, the
// first past it.
int FirstInside(int first_in, int stride) {
  return first_in <= 0 ? 0 : (first_in + stride - 1) / stride;
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
      std::copy(part.begin() + n * (j - i) * plane, part.begin() + (n + 1) * (j - i) * plane,
                out.begin() + (n * picked.size() + i) * plane);
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
  const int group = g.kind == CometWeightGeometry::CONVOLUTION ? std::max(g.group, 1) : 1;
  const int per_group = std::max(channels / group, 1);
  const int wanted = std::min(group, kCometSampleGroups);
  int images = std::min(num, kCometSampleImages);
  // A grouped layer: a larger sample, and fewer images before fewer groups.
  const size_t cap = group > 1 ? kCometGroupedSample : kCometErrorSample;
  while (group > 1 && images > 2 && cap / (images * plane) < wanted) --images;
  const int count = static_cast<int>(std::max<size_t>(
      1, std::min<size_t>(static_cast<size_t>(per_group) * group, cap / (images * plane))));
  const int ngroups = std::min(group, std::max(std::min(wanted, count),
                                               (count + per_group - 1) / per_group));
  s.images = images;
  s.per_group = per_group;
  s.groups = PickGroups(group, ngroups);
  s.channels = Spread(s.groups, per_group, count);
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
  const size_t values = s.x.size();
  const size_t plane = static_cast<size_t>(height) * width;
  const size_t in_plane = static_cast<size_t>(s.height) * s.width;
  const int images = s.images, in_count = s.channels.size();
  // Convolution; InnerProduct as a 1x1 convolution of 1x1 maps. Each output pairs with the
  // sampled channels of its own group; the work, outputs x channels x kernel x images x plane x
  // bounds products, at most about 2^25.
  const bool conv = g.kind == CometWeightGeometry::CONVOLUTION;
  const int kh_n = conv ? g.kernel_h : 1, kw_n = conv ? g.kernel_w : 1;
  const int ngroups = s.groups.size();
  const int out_per_group = std::max(out_channels / (conv ? std::max(g.group, 1) : 1), 1);
  int in_per_group = 0;  // the most sampled channels in one group
  for (int k = 0, c = 0; k < ngroups; ++k) {
    int here = 0;
    for (; c < in_count && s.channels[c] / s.per_group == s.groups[k]; ++c) ++here;
    in_per_group = std::max(in_per_group, here);
  }
  const double per_output = static_cast<double>(in_per_group) * kh_n * kw_n * images * plane * nb;
  const size_t cap = std::min<double>(kCometGradientSample,
                                      33554432. / per_output * images * plane);
  const int budget = static_cast<int>(std::max<size_t>(
      1, std::min<size_t>(static_cast<size_t>(out_per_group) * ngroups, cap / (images * plane))));
  const std::vector<int> outputs = Spread(s.groups, out_per_group, budget);
  const int count = outputs.size();
  const std::vector<float> d = GatherChannels(dy, on_device, images, out_channels, plane,
                                              outputs);
  // For each kernel position kh x kw: the outputs whose window puts it inside the input,
  // [h0, h1) x [w0, w1), and the input position of the first of them (ih0, iw0).
  struct Window {
    int h0, h1, w0, w1, ih0, iw0;
  };
  std::vector<Window> windows;
  for (int kh = 0; kh < kh_n; ++kh) {
    for (int kw = 0; kw < kw_n; ++kw) {
      Window w = {0, 1, 0, 1, 0, 0};  // InnerProduct: one position
      if (conv) {
        const int off_h = kh * g.dilation_h - g.pad_h, off_w = kw * g.dilation_w - g.pad_w;
        w.h0 = FirstInside(-off_h, g.stride_h);
        w.h1 = std::min(height, FirstInside(s.height - off_h, g.stride_h));
        w.w0 = FirstInside(-off_w, g.stride_w);
        w.w1 = std::min(width, FirstInside(s.width - off_w, g.stride_w));
        w.ih0 = w.h0 * g.stride_h + off_h;
        w.iw0 = w.w0 * g.stride_w + off_w;
      }
      windows.push_back(w);
    }
  }
  const int sh = conv ? g.stride_h : 1, sw = conv ? g.stride_w : 1;
  // Per weight and bound: the error is a sum over the num images of per-image parts a_n. From
  // the sampled images, E[a_n^2] (self) and E[a_n a_m], n != m (cross: what adds coherently
  // from image to image) give E[(sum a_n)^2] = num self + num (num - 1) cross, exact when every
  // image is sampled. One bound at a time: the sample's errors at it are as large as the sample.
  std::vector<double> rms(nb);
  std::vector<float> e(values);
  for (int b = 0; b < nb; ++b) {
    // x' as sz restores it (a block holding a NaN or Inf would come back exactly: rare enough
    // not to model), clamped as the sign mask does
    CHECK_EQ(sz_restore_host(s.x.data(), values, bounds[b], e.data()), SZ_OK);
    for (size_t i = 0; i < values; ++i) {
      const float r = s.signs ? comet_mask::apply_sign(e[i], comet_mask::bit_of(s.x[i]), 0) : e[i];
      e[i] = r - s.x[i];
    }
    double self = 0, cross = 0, weights = 0;
    for (int o = 0; o < count; ++o) {
      for (int c = 0; c < in_count; ++c) {
        if (s.channels[c] / s.per_group != outputs[o] / out_per_group) continue;
        for (const Window& w : windows) {
          double sum = 0, sq = 0;
          for (int n = 0; n < images; ++n) {
            double part = 0;
            const float* dp = &d[(static_cast<size_t>(n) * count + o) * plane];
            const float* ep = &e[(static_cast<size_t>(n) * in_count + c) * in_plane];
            for (int ph = w.h0, ih = w.ih0; ph < w.h1; ++ph, ih += sh) {
              const float* dy_row = dp + ph * width;
              const float* e_row = ep + ih * s.width;
              for (int pw = w.w0, iw = w.iw0; pw < w.w1; ++pw, iw += sw)
                part += static_cast<double>(dy_row[pw]) * e_row[iw];
            }
            sum += part;
            sq += part * part;
          }
          self += sq / images;
          if (images > 1) cross += (sum * sum - sq) / (images * (images - 1.));
          weights += 1;
        }
      }
    }
    const double n = s.num;
    const double self_b = self / std::max(weights, 1.), cross_b = cross / std::max(weights, 1.);
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

double CometBatchNormChannelError(double sum_dy_y, double sum_dy_sq, double sum_y_sq, double n,
                                  double std) {
  if (!(n > 0) || !(std > 0)) return 0;
  const double m1 = sum_dy_y / n;
  return (m1 * m1 * (1 + 2 / n) + (sum_y_sq / n) * (sum_dy_sq / n) / n) / (std * std);
}

double CometBatchNormWeightError(double a, double b, double positions, double fan_in,
                                 double x_mean_square, double eb) {
  if (!(positions > 0) || !(fan_in > 0) || !(x_mean_square >= 0)) return 0;
  return eb * std::sqrt(positions * x_mean_square * (a + b / fan_in) / 3.);
}

double CometSampledStd(const float* x, bool on_device, size_t count) {
  if (count == 0) return 0;
  const int rows = static_cast<int>(std::min<size_t>(count, 256));
  const size_t pitch = count / rows;
  const size_t width = std::max<size_t>(1, std::min(pitch, kCometErrorSample / rows));
  const std::vector<float> v = CometGatherRows(x, on_device, rows, pitch, 0, width);
  double sum = 0, sq = 0;
  size_t n = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) continue;
    sum += v[i];
    sq += static_cast<double>(v[i]) * v[i];
    ++n;
  }
  if (!n) return 0;
  const double mean = sum / n;
  return std::sqrt(std::max(sq / n - mean * mean, 0.));
}

std::vector<float> CometGatherRows(const float* src, bool on_device, int rows, size_t pitch,
                                   size_t offset, size_t width) {
  std::vector<float> out(static_cast<size_t>(rows) * width);
  if (out.empty()) return out;
  if (on_device) {
#ifndef CPU_ONLY
    COMET_CUDA_CHECK(cudaMemcpy2D(out.data(), width * sizeof(float), src + offset,
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
