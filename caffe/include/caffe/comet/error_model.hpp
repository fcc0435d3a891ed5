#ifndef CAFFE_COMET_ERROR_MODEL_HPP_
#define CAFFE_COMET_ERROR_MODEL_HPP_

// COMET-Caffe: the weight-gradient error an input stored lossy causes, measured on a sample of
// the weights (docs/comet.md#the-weight-rule-measured). sz's error e = x' - x is a function of
// the value alone (the nearest multiple of 2 eb), so equal neighbours (max pooling's repeated
// maxima) carry equal errors and the many small positives that round to 0 all err downwards: a
// weight gradient dW[o, c, k] = sum over n, p of dy[n, o, p] x[n, c, s p + k] adds them
// coherently, several times more than independent errors would on GoogLeNet's 7x7 and 14x14
// maps, and faster than in proportion to eb (more values round to 0 as eb grows). No model of
// either is needed: when the input is encoded a sample of its channels is kept dense (x is gone
// after), and before the layer's backward the error of the weights that pair those channels with
// some outputs is computed from them and the output gradient, as the layer would compute the
// weight gradient (it is linear in x), for the errors of a ladder of bounds around the current
// one. The rule then picks the bound where that error meets its target.

#include <cstddef>
#include <vector>

namespace caffe {

// How a weighted layer pairs input channels with outputs.
struct CometWeightGeometry {
  enum Kind { CONVOLUTION, INNER_PRODUCT };
  CometWeightGeometry()
      : kind(CONVOLUTION), group(1), kernel_h(1), kernel_w(1), stride_h(1), stride_w(1),
        pad_h(0), pad_w(0), dilation_h(1), dilation_w(1) {}
  Kind kind;     // INNER_PRODUCT: one "channel" per input feature
  int group;     // CONVOLUTION: channels and outputs in groups
  int kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
};

// Some channels of the first images of a stored input (maps of height x width; an InnerProduct
// input has height = width = 1 and one channel per feature), dense, taken when the input is
// encoded at bound eb (the errors at any bound follow from them).
struct CometErrorSample {
  CometErrorSample()
      : valid(false), eb(0), signs(false), num(0), images(0), height(0), width(0),
        per_group(0) {}
  bool valid;
  double eb;
  bool signs;                 // a sign mask is stored alongside: the decoder clamps signs
  int num, images;            // images in the batch, and sampled (the first ones)
  int height, width;
  std::vector<int> groups;    // the layer's groups they lie in, ascending (one without groups)
  int per_group;              // channels per group
  std::vector<int> channels;  // which, ascending
  std::vector<float> x;       // images x channels.size() x height x width
};

// Images a sample takes at most (the batch's order is random), values it holds at most (one
// channel at least); what the output gradient's part reads at most (one output at least).
const int kCometSampleImages = 8;
const size_t kCometErrorSample = size_t(1) << 15;
const size_t kCometGradientSample = size_t(1) << 18;
// A grouped convolution's weights differ group by group (a depthwise one's channel by channel),
// so its sample holds up to kCometGroupedSample values (1 MB) over at least kCometSampleGroups
// groups spread over the layer where it can, taking fewer images (down to 2) to reach them. Its
// middle group alone left ResNet-18's depthwise layers (made so) at 0.8% to 10.7% of their
// gradient against a 5% target (docs/comet.md, "Depthwise convolutions").
const int kCometSampleGroups = 8;
const size_t kCometGroupedSample = size_t(1) << 18;

// Samples x (host or device memory: num x channels x height x width), stored at bound eb; the
// channels are spread over the middle group of the layer reading x, or over several groups of a
// grouped convolution (above).
CometErrorSample CometSampleInput(const float* x, bool on_device, int num, int channels,
                                  int height, int width, double eb, bool signs,
                                  const CometWeightGeometry& g);

// The bounds the rule tries around eb: eb * 2^k for k = -kCometLadderSteps .. kCometLadderSteps.
const int kCometLadderSteps = 3;
std::vector<double> CometLadder(double eb);

// The RMS error of the weights pairing the sample's channels with some of the outputs (all of
// them on small layers), were the input stored at each of `bounds`, over all num images (from
// the sampled images' parts: their mean square and their mean product, which is what adds up
// coherently from image to image; exact when every image is sampled): x' as sz restores it
// (sz_restore_host), clamped by the sign mask where one is stored. dy (host or device) is the output
// gradient, num x out_channels x height x width.
std::vector<double> CometWeightErrors(const CometErrorSample& s, const float* dy, bool on_device,
                                      int out_channels, int height, int width,
                                      const CometWeightGeometry& g,
                                      const std::vector<double>& bounds);

// The RMS weight-gradient error at bound eb were the input's errors independent of the output
// gradient and uniform in [-eb, eb]: weight w reading output o errs with variance
// eb^2 / 3 * ||dy_o||^2 (over the values it pairs with), so eb sqrt(||dy||^2 / (3 O)) over the
// weights of a layer with O outputs (dy_sumsq: ||dy||^2 over all of them). Right for an input
// whose values are spread smoothly over many steps of 2 eb (a Scale's x_norm_); the sampled
// measurement above is for inputs with zeros and repeated values, whose errors add coherently.
double CometIndependentWeightError(double dy_sumsq, int outputs, double eb);

// BatchNorm's input gradient dx = (dy - mean(dy) - y mean(dy y)) / std, per channel, with its
// normalised output y off by errors e uniform in [-eb, eb]: dx moves by (e mean(dy y) +
// y mean(dy e)) / std, whose mean square over the channel's n values is eb^2 / 3 times what this
// returns: (mean(dy y)^2 (1 + 2 / n) + mean(y^2) mean(dy^2) / n) / std^2 (sums over the channel
// given). The terms in 1 / n matter where a channel has few values: BatchNorm after an
// InnerProduct, n the batch (scripts/fuzz_nets seed 246, at batch 4).
double CometBatchNormChannelError(double sum_dy_y, double sum_dy_sq, double sum_y_sq, double n,
                                  double std);

// The same errors as the weights of the Convolution or InnerProduct writing BatchNorm's input
// meet them: dW = sum x dx over the P positions a weight meets. The part e mean(dy y) / std is
// independent of x and adds up as sqrt(P). The part y mean(dy e) / std, negligible in dx where
// a channel has many values, lies along y, which is linear in x: it adds up coherently, P mean(x y)
// times mean(dy e) (about eb rms(dy) / sqrt(3 P)), with mean(x y) about rms(x) / sqrt(F) where
// a weight's F inputs are uncorrelated (scripts/fuzz_nets seeds 1582 and 1647: a 1x1 Convolution
// of 3 inputs at batch 4, 576 values a channel, BatchNorm at the cap of its own rule and the
// weight gradient 16% off, ten times the first part). The RMS error of dW:
// eb sqrt(P mean(x^2) (a + b / F) / 3), with a and b the means over the channels of
// mean(dy y)^2 / std^2 and mean(dy^2) / std^2.
double CometBatchNormWeightError(double a, double b, double positions, double fan_in,
                                 double x_mean_square, double eb);

// The bound at which the error reaches `target`, from errors measured at ascending bounds: where
// the curve's running maximum crosses it (a dip, where the errors of clustered values happen to
// cancel, is not counted on: it moves with the values), by log-log interpolation; beyond the measured bounds
// extrapolated with the end segment's slope clamped to [1, 4]. -1 where the errors say nothing
// (zero or not finite).
double CometBoundForError(const std::vector<double>& bounds, const std::vector<double>& errors,
                          double target);

// The error that curve gives at bound eb, as CometBoundForError reads it (its inverse): -1 where
// the errors say nothing.
double CometErrorAt(const std::vector<double>& bounds, const std::vector<double>& errors,
                    double eb);

// A bound picked from one batch's curve is used on the batches until the next measurement, whose
// curve can lie higher: the weight rule aims at target / margin. Given the margin so far and the
// error the last curve predicted at the bound in effect against what this one measured there
// (both relative to their step's gradient), the next margin: the largest surprise seen, its excess
// shrinking by a quarter in log per measurement (m^0.75), so one surprise keeps a layer careful
// for several updates; within [1, kCometMaxDriftMargin] (a bound then shrinks by m^(1/s) on a
// curve of log-log slope s). GoogLeNet at batch 32: inception_5b/3x3's error at a fixed bound
// moved 11x from one step to the next; with the excess halved each time (m^0.5) instead,
// inception_4d/5x5 still reached 15% (docs/comet.md#the-weight-rule-measured).
const double kCometMaxDriftMargin = 16;
// A layer's margin before any two of its curves have been compared: as if its last measurement had
// been a 2x surprise (its first pick aims at target / 2^0.75), since how far its curve moves
// between batches is not known yet. Small batches move it most: GoogLeNet at batch 8, margin
// starting at 1, 20 of 64 layers above 1.5x the target after two steps.
const double kCometFirstDriftMargin = 2;
double CometDriftMargin(double margin, double predicted, double measured);

// The standard deviation of up to kCometErrorSample of x's count values (host or device memory),
// read in runs spread over the whole array; non-finite values left out.
double CometSampledStd(const float* x, bool on_device, size_t count);

// Copies `rows` runs of `width` floats from src + offset + r * pitch (host or device memory) into
// one host array: how a channel block of an N x C x ... blob is read without touching the rest.
std::vector<float> CometGatherRows(const float* src, bool on_device, int rows, size_t pitch,
                                   size_t offset, size_t width);

}  // namespace caffe

#endif  // CAFFE_COMET_ERROR_MODEL_HPP_
