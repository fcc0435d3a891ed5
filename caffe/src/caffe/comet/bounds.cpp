// COMET-Caffe: error bounds and their adaptive rules (include/caffe/comet/bounds.hpp).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "caffe/comet/bounds.hpp"
#include "caffe/comet/layer_access.hpp"
#include "caffe/comet/lrn_within.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/payload_gpu.hpp"
#include "caffe/comet/resume.hpp"
#include "caffe/util/io.hpp"

namespace caffe {

namespace {

// Whether layer j has a learnt weight per channel that multiplies its input: a Scale of one
// bottom (axis 1, one axis) or a PReLU (a slope per channel). Each weight meets the values of its
// channel, one input each (F = 1), the output linear in it (PReLU's where the input is negative).
template <typename Dtype>
bool ChannelWeights(const Net<Dtype>& net, int j) {
  Layer<Dtype>& l = *net.layers()[j];  // (blobs() is not const)
  if (net.bottom_ids(j).size() != 1 || l.blobs().empty() ||
      net.bottom_vecs()[j][0]->num_axes() < 2) {
    return false;
  }
  if (l.type() == std::string("PReLU")) return !l.layer_param().prelu_param().channel_shared();
  const ScaleParameter& p = l.layer_param().scale_param();
  return l.type() == std::string("Scale") &&
         net.bottom_vecs()[j][0]->CanonicalAxisIndex(p.axis()) == 1 && p.num_axes() == 1;
}

// The Convolution or InnerProduct (one bottom, one top, weights), or a layer of ChannelWeights,
// whose output is layer i's first input, through Splits, ReLUs and poolings (each passes a
// gradient on to about one value below, where it is not zero) and Reshapes that keep the first
// two axes (a 3-D Convolution's 5-axis output folded back to 4 for a BatchNorm: each channel's
// values stay that channel's); -1 where another layer writes it. A Scale between two BatchNorms
// has a true gradient of about 0 (the second normalises its scale away), which the second's
// errors alone would make (scripts/fuzz_nets seed 2553: 73% of the floor the fuzzer measures
// against).
template <typename Dtype>
int WeightsBelow(const Net<Dtype>& net, int i) {
  const int j = CometWriterBelow(net, i, [&net](int k) {
    const std::string type = net.layers()[k]->type();
    if (type == "Split" || type == "ReLU" || type == "Pooling") return true;
    const Blob<Dtype>& in = *net.bottom_vecs()[k][0];
    const Blob<Dtype>& out = *net.top_vecs()[k][0];
    return type == "Reshape" && in.num_axes() >= 2 && out.num_axes() >= 2 &&
           in.shape(0) == out.shape(0) && in.shape(1) == out.shape(1);
  });
  if (j < 0) return -1;
  if (ChannelWeights(net, j)) return j;
  Layer<Dtype>& l = *net.layers()[j];  // (blobs() is not const)
  const bool weighted = l.type() == std::string("Convolution") ||
                        l.type() == std::string("InnerProduct");
  return weighted && net.top_ids(j).size() == 1 && net.bottom_ids(j).size() == 1 &&
                 !l.blobs().empty() ? j : -1;
}

// The Convolutions and InnerProducts (one bottom, one top, weights) whose outputs layer i's first
// input holds, through Splits, ReLUs, poolings, Reshapes and Flattens (each passes a gradient on to
// about one value below), Slices and Concats (each part to its own); parts that other layers
// wrote are left out.
template <typename Dtype>
std::vector<int> WeightedLayersBelow(const Net<Dtype>& net, int i) {
  std::set<int> found;
  // (blob, the layer that reads it) to follow down
  std::vector<std::pair<int, int> > todo(1, std::make_pair(net.bottom_ids(i)[0], i));
  while (!todo.empty()) {
    const std::pair<int, int> part = todo.back();
    todo.pop_back();
    const int j = CometLastWriter(net, part.first, part.second);
    if (j < 0 || net.bottom_ids(j).empty()) continue;
    Layer<Dtype>& l = *net.layers()[j];  // (blobs() is not const)
    const std::string type = l.type();
    if (type == "Split" || type == "ReLU" || type == "Pooling" || type == "Reshape" ||
        type == "Flatten" || type == "Slice") {
      todo.push_back(std::make_pair(net.bottom_ids(j)[0], j));
    } else if (type == "Concat") {
      for (int b = 0; b < net.bottom_ids(j).size(); ++b)
        todo.push_back(std::make_pair(net.bottom_ids(j)[b], j));
    } else if ((type == "Convolution" || type == "InnerProduct") && net.top_ids(j).size() == 1 &&
               net.bottom_ids(j).size() == 1 && !l.blobs().empty()) {
      found.insert(j);
    }
  }
  return std::vector<int>(found.begin(), found.end());
}

}  // namespace

template <typename Dtype>
void CometBounds<Dtype>::Reset(const CometPlan& plan) {
  std::map<std::string, float> old;
  std::set<std::string> audited;
  for (int b = 0; b < bounds_.size(); ++b) {
    old[bounds_[b].layer] = bounds_[b].eb;
    if (audited_[b]) audited.insert(bounds_[b].layer);
  }
  bounds_ = plan.bounds;
  audited_.assign(bounds_.size(), false);
  for (int b = 0; b < bounds_.size(); ++b) {
    if (old.count(bounds_[b].layer)) bounds_[b].eb = old[bounds_[b].layer];
    audited_[b] = audited.count(bounds_[b].layer) > 0;
  }
  bound_of_layer_ = plan.bound_of_layer;
  measured_.assign(bound_of_layer_.size(), 0);
  spread_.assign(bound_of_layer_.size(), 0);
  input_std_.assign(bound_of_layer_.size(), 0);
  derivative_.clear();
  for (int i = 0; i < plan.facts.size(); ++i) derivative_.push_back(plan.facts[i].derivative);
  ladder_.assign(bound_of_layer_.size(), Ladder());
  errors_.assign(bounds_.size(), CometErrorSample());
  drift_.resize(bounds_.size());
  weights_below_.assign(bound_of_layer_.size(), -1);
  derivative_below_.assign(bound_of_layer_.size(), std::vector<int>());
  bn_weight_terms_.assign(2 * bound_of_layer_.size(), 0);
  below_.assign(bound_of_layer_.size(), std::vector<LossyAbove>());
  for (int b = 0; b < bounds_.size(); ++b) {
    if (bounds_[b].rule == CometPlanBound::BATCHNORM)
      weights_below_[bounds_[b].layer_id] = WeightsBelow(*net_, bounds_[b].layer_id);
    if (bounds_[b].rule == CometPlanBound::DERIVATIVE)
      derivative_below_[bounds_[b].layer_id] = WeightedLayersBelow(*net_, bounds_[b].layer_id);
  }
}

template <typename Dtype>
float CometBounds<Dtype>::Of(int b) const {
  return bounds_[b].follow >= 0 ? bounds_[bounds_[b].follow].eb : bounds_[b].eb;
}

template <typename Dtype>
float CometBounds<Dtype>::Of(const std::string& layer) const {
  for (int b = 0; b < bounds_.size(); ++b) if (bounds_[b].layer == layer) return Of(b);
  return -1;
}

template <typename Dtype>
void CometBounds<Dtype>::Set(const std::string& layer, float eb) {
  for (int b = 0; b < bounds_.size(); ++b) if (bounds_[b].layer == layer) bounds_[b].eb = eb;
}

template <typename Dtype>
float CometBounds<Dtype>::ForEntry(const CometPlanEntry& e) const {
  float eb = Of(e.eb_layers[0]);
  for (int i = 1; i < e.eb_layers.size(); ++i) eb = std::min(eb, Of(e.eb_layers[i]));
  return eb;
}

namespace {
// One of Convolution's repeated spatial fields: one value for both axes, or one per axis (H, W).
int Spatial(const google::protobuf::RepeatedField<uint32_t>& v, int axis, int otherwise) {
  return v.size() == 0 ? otherwise : v.Get(std::min(axis, v.size() - 1));
}

// How a weighted layer pairs input channels with outputs; false for a layer the measurement does
// not cover (its rule takes the errors as independent).
bool WeightGeometry(const LayerParameter& lp, const std::vector<int>& in_shape,
                    CometWeightGeometry* g) {
  if (lp.type() == "InnerProduct") {
    g->kind = CometWeightGeometry::INNER_PRODUCT;
    return true;
  }
  // Not Scale: its input is BatchNorm's x_norm_ (smooth, zero mean and unit variance per
  // channel), whose errors are a sawtooth of the value, uncorrelated with dy, so the independent
  // estimate holds (CometIndependentWeightError), while a sample of it would hold one channel of
  // a 56x56 map at batch 8 and more: ResNet-18's Scales ended 5x above their target with it.
  if (lp.type() != "Convolution" || in_shape.size() != 4) return false;
  const ConvolutionParameter& cp = lp.convolution_param();
  g->kind = CometWeightGeometry::CONVOLUTION;
  g->group = cp.group();
  g->kernel_h = cp.has_kernel_h() ? cp.kernel_h() : Spatial(cp.kernel_size(), 0, 1);
  g->kernel_w = cp.has_kernel_w() ? cp.kernel_w() : Spatial(cp.kernel_size(), 1, 1);
  g->stride_h = cp.has_stride_h() ? cp.stride_h() : Spatial(cp.stride(), 0, 1);
  g->stride_w = cp.has_stride_w() ? cp.stride_w() : Spatial(cp.stride(), 1, 1);
  g->pad_h = cp.has_pad_h() ? cp.pad_h() : Spatial(cp.pad(), 0, 0);
  g->pad_w = cp.has_pad_w() ? cp.pad_w() : Spatial(cp.pad(), 1, 0);
  g->dilation_h = Spatial(cp.dilation(), 0, 1);
  g->dilation_w = Spatial(cp.dilation(), 1, 1);
  return cp.axis() == 1;
}

// num x channels x height x width of a blob read by a layer of this kind (InnerProduct: rows x
// features at its axis, as 1x1 maps; otherwise N x C x H x rest).
void Maps(const LayerParameter& lp, const std::vector<int>& shape, int* num, int* channels,
          int* height, int* width) {
  *num = 1;
  *channels = 1;
  *height = 1;
  *width = 1;
  if (lp.type() == "InnerProduct") {
    int axis = lp.inner_product_param().axis();
    if (axis < 0) axis += shape.size();
    for (int i = 0; i < shape.size(); ++i) (i < axis ? *num : *channels) *= shape[i];
    return;
  }
  *num = shape[0];
  *channels = shape[1];
  if (shape.size() > 2) *height = shape[2];
  for (int i = 3; i < shape.size(); ++i) *width *= shape[i];
}

// Whether layer i is a Scale whose scale is its second bottom (SENet's channel attention).
template <typename Dtype>
bool ScaleByBottom(const Net<Dtype>& net, int i) {
  return net.layers()[i]->type() == std::string("Scale") && net.bottom_vecs()[i].size() > 1;
}

// The gradient the weight rule watches at layer i: its weights' (its first parameter's), or that
// of a Scale's second bottom, the scale; NULL without either.
template <typename Dtype>
const Blob<Dtype>* WatchedGradient(const Net<Dtype>& net, int i) {
  if (ScaleByBottom(net, i)) return net.bottom_vecs()[i][1];
  Layer<Dtype>& l = *net.layers()[i];
  return l.blobs().empty() ? NULL : l.blobs()[0].get();
}

// How many output channels a layer's weights feed (O of the independent-error estimate): the
// weights' first axis, but Deconvolution's second (times its groups; its weights are input x
// output / group x kernel), and 1 for a 0-D weight (PReLU's channel_shared slope). For a
// Deconvolution of stride s each weight meets about 1 / s^2 of its channel's dy, so the estimate
// then errs high (by about s). A Scale by its second bottom: every element of that bottom sums
// its own part of dy.
template <typename Dtype>
int WeightOutputs(const Net<Dtype>& net, int i) {
  if (ScaleByBottom(net, i)) return net.bottom_vecs()[i][1]->count();
  Layer<Dtype>& l = *net.layers()[i];
  const Blob<Dtype>& w = *l.blobs()[0];
  if (w.num_axes() == 0) return 1;
  if (l.type() == std::string("Deconvolution") && w.num_axes() > 1)
    return w.shape(1) * l.layer_param().convolution_param().group();
  if (l.type() == std::string("InnerProduct") && w.num_axes() > 1 &&
      l.layer_param().inner_product_param().transpose())
    return w.shape(1);  // stored inputs x outputs
  return w.shape(0);
}

// The standard deviation of n values from their sum and sum of squares.
double StdOf(double sum, double sumsq, double n) {
  n = std::max(n, 1.);
  return std::sqrt(std::max(sumsq / n - (sum / n) * (sum / n), 0.));
}

const float* DiffOf(const Blob<float>* b, bool dev) { return dev ? b->gpu_diff() : b->cpu_diff(); }
const float* DiffOf(const Blob<double>*, bool) { return NULL; }  // the store keeps floats only

// A blob's values (or gradient) where a rule reads them on the host. Values that live on the
// device alone are copied into `copy`: cpu_data() would give the blob a pinned host buffer
// (cudaMallocHost), held until the store frees the blob and then given back with cudaFreeHost,
// which waits for the whole device, for every blob a measuring iteration reads. A blob held as
// a device payload (not decoded ahead) is restored on the device by gpu_data() and copied too:
// its head says UNINITIALIZED, which the host branch would take.
template <typename Dtype>
const Dtype* HostValues(const Blob<Dtype>* b, bool diff, std::vector<Dtype>* copy) {
  SyncedMemory* m = (diff ? b->diff() : b->data()).get();
  const bool device_payload = m->comet_payload() && m->comet_payload()->on_device();
  if (Caffe::mode() == Caffe::CPU ||
      (m->head() != SyncedMemory::HEAD_AT_GPU && !device_payload))
    return diff ? b->cpu_diff() : b->cpu_data();  // on the host already, or the store restores it
  copy->resize(b->count());
  CometCopyToHost(copy->data(), diff ? b->gpu_diff() : b->gpu_data(), b->count() * sizeof(Dtype));
  return copy->data();
}

}  // namespace

// Whether the layer's bound has a rule of its own to measure (adaptive, or fixed and not yet
// audited; not following another; the layer runs backward; the weight rule needs a gradient to
// watch).
template <typename Dtype>
bool CometBounds<Dtype>::Measures(int layer) const {
  if (bound_of_layer_[layer] < 0 || !net_->layer_need_backward()[layer]) return false;
  const int b = bound_of_layer_[layer];
  const CometPlanBound& bd = bounds_[b];
  if (bd.follow >= 0 || (bd.fixed ? !bd.measurable || audited_[b] : !bd.adapt)) return false;
  return bd.rule != CometPlanBound::WEIGHT_GRADIENT || WatchedGradient(*net_, layer) != NULL;
}

template <typename Dtype>
bool CometBounds<Dtype>::Audits() const {
  for (int b = 0; b < bounds_.size(); ++b)
    if (bounds_[b].fixed && bounds_[b].measurable && !audited_[b]) return true;
  return false;
}

template <typename Dtype>
void CometBounds<Dtype>::EndAudit() {
  for (int b = 0; b < bounds_.size(); ++b) audited_[b] = audited_[b] || bounds_[b].fixed;
}

template <typename Dtype>
void CometBounds<Dtype>::NoteStoredInput(const CometPlanEntry& e, const float* data,
                                         bool on_device, const std::vector<int>& shape, float eb) {
  for (int i = 0; i < e.eb_layers.size(); ++i) {
    const int b = e.eb_layers[i];
    const CometPlanBound& bd = bounds_[b];
    if (bd.rule != CometPlanBound::WEIGHT_GRADIENT || !Measures(bd.layer_id)) continue;
    const LayerParameter& lp = net_->layers()[bd.layer_id]->layer_param();
    CometWeightGeometry g;
    if (!WeightGeometry(lp, shape, &g)) {  // the independent estimate, capped by the input's spread
      size_t count = 1;
      for (int k = 0; k < shape.size(); ++k) count *= shape[k];
      input_std_[bd.layer_id] = CometSampledStd(data, on_device, count);
      continue;
    }
    int num, channels, height, width;
    Maps(lp, shape, &num, &channels, &height, &width);
    errors_[b] = CometSampleInput(data, on_device, num, channels, height, width, eb, e.signs, g);
  }
}

template <typename Dtype>
size_t CometBounds<Dtype>::SampleBytes() const {
  size_t n = 0;
  for (size_t b = 0; b < errors_.size(); ++b)
    n += errors_[b].x.capacity() * sizeof(float) + errors_[b].channels.capacity() * sizeof(int) +
         errors_[b].groups.capacity() * sizeof(int);
  return n;
}

template <typename Dtype>
void CometBounds<Dtype>::BeforeBackward(int layer) {
  if (!Measures(layer)) return;
  switch (bounds_[bound_of_layer_[layer]].rule) {
    case CometPlanBound::BATCHNORM:
      measured_[layer] = BatchNormErrorScale(layer, &spread_[layer], &bn_weight_terms_[2 * layer]);
      break;
    case CometPlanBound::LRN: measured_[layer] = LrnErrorPerBound(layer); break;
    case CometPlanBound::DERIVATIVE:
      measured_[layer] = DerivativeErrorPerBound(layer, &spread_[layer]);
      break;
    default: MeasureWeightErrors(layer);
  }
}

// The weight rule, before the backward (an in-place layer overwrites the output gradient it
// reads): the RMS error of a sample of the weights at a ladder of bounds around the current one
// (error_model.hpp). Where the input was not sampled this iteration (a layer kind the sample does
// not cover, a Scale's x_norm_, an input kept dense this step), the errors are taken as
// independent and uniform in [-eb, eb] (CometIndependentWeightError per unit of bound, in
// measured_).
template <typename Dtype>
void CometBounds<Dtype>::MeasureWeightErrors(int layer) {
  const std::vector<Blob<Dtype>*>& tops = net_->top_vecs()[layer];
  Layer<Dtype>* l = net_->layers()[layer].get();
  CometErrorSample& sample = errors_[bound_of_layer_[layer]];
  Ladder& ladder = ladder_[layer];
  ladder = Ladder();
  const bool dev = Caffe::mode() == Caffe::GPU;
  const float* dy = DiffOf(tops[0], dev);
  CometWeightGeometry g;
  if (sample.valid && dy && tops.size() == 1 &&
      WeightGeometry(l->layer_param(), net_->bottom_vecs()[layer][0]->shape(), &g)) {
    int num, channels, height, width;
    Maps(l->layer_param(), tops[0]->shape(), &num, &channels, &height, &width);
    ladder.bounds = CometLadder(sample.eb);
    double sq = 0;
    for (size_t i = 0; i < sample.x.size(); ++i) sq += static_cast<double>(sample.x[i]) * sample.x[i];
    ladder.input_rms = std::sqrt(sq / std::max<size_t>(sample.x.size(), 1));
    ladder.errors = CometWeightErrors(sample, dy, dev, channels, height, width, g, ladder.bounds);
  } else {
    double s = 0;
    for (int k = 0; k < tops.size(); ++k) s += static_cast<double>(tops[k]->sumsq_diff());
    measured_[layer] = CometIndependentWeightError(s, WeightOutputs(*net_, layer), 1.);
  }
  sample = CometErrorSample();  // used once: the next measuring iteration samples again
}

// eb such that the estimated gradient error (per_eb * eb) is adaptive_target times the
// gradient's RMS, at most cap where one is given (from the stored values' spread or RMS); -1
// where there is nothing to learn from this step (a zero or non-finite gradient).
template <typename Dtype>
double CometBounds<Dtype>::RuleBound(double per_eb, double gradient_rms, double cap) const {
  if (!(per_eb > 0) || !(gradient_rms > 0) || !std::isfinite(per_eb) ||
      !std::isfinite(gradient_rms)) {
    return -1;
  }
  double eb = param_.adaptive_target() * gradient_rms / per_eb;
  if (cap > 0 && std::isfinite(cap)) eb = std::min(eb, cap);
  return eb;
}

// That bound, clamped to [min_error_bound, max_error_bound].
template <typename Dtype>
void CometBounds<Dtype>::SetFrom(CometPlanBound* bd, double per_eb, double gradient_rms,
                                 double cap) {
  const double eb = RuleBound(per_eb, gradient_rms, cap);
  if (eb >= 0) Clamped(bd, eb);
}

// The weight rule's pick from a measured curve for an error of `target`: where the curve is
// steeper than quadratic (the bound nears the activations' size and most of them round to 0), a
// small change of the activations moves the error a lot, so the bound also stays at half the one
// with 4x the error. A bound near the input's size rounds most values to 0 or one step: the
// error is then a coarse function of each batch's values, and a curve measured on one batch says
// little about the next (GoogLeNet at batch 32: inception_5b/5x5 at 1.6x its input's RMS, 51% on
// the next step; every bound at most 0.62x its input's RMS, at most 6.3%). <= 0 or not finite
// where the curve says nothing.
template <typename Dtype>
double CometBounds<Dtype>::LadderBound(const Ladder& ladder, double target) const {
  double eb = CometBoundForError(ladder.bounds, ladder.errors, target);
  const double steep = CometBoundForError(ladder.bounds, ladder.errors, 4 * target);
  if (steep > 0) eb = std::min(eb, steep / 2);
  if (ladder.input_rms > 0) eb = std::min(eb, kCometBoundPerInputRms * ladder.input_rms);
  return eb;
}

// A fixed bound is what the user asked for; the log says what the rule estimates of it: an INFO
// line for each, a warning where the gradient is estimated more than kCometFixedBoundWarning off,
// or the bound is above the rule's cap (where the values vary by little more than the bound,
// sz rounds most of them to their prediction and the errors follow the values; scripts/fuzz_nets
// seed 800: inputs of spread below 1e-3 before a BatchNorm, a weight gradient 95% off at FIXED
// 1e-3).
template <typename Dtype>
void CometBounds<Dtype>::Audit(const CometPlanBound& bd, double error, double cap,
                               double picked) const {
  const bool weights = bd.rule == CometPlanBound::WEIGHT_GRADIENT;
  const char* gradient = weights ? "weight gradient" : "input gradient";
  std::ostringstream what;
  what << "COMET: layer " << bd.layer << "'s fixed error bound " << bd.eb;
  if (error >= 0) {
    what << " puts its " << gradient << " an estimated " << std::setprecision(2) << 100 * error
         << "% off (RMS)";
  } else {
    what << " (its " << gradient << "'s error not estimated)";
  }
  const bool above_cap = cap > 0 && bd.eb > cap;
  if (!(error > kCometFixedBoundWarning) && !above_cap) {
    LOG(INFO) << what.str();
    return;
  }
  if (above_cap) {
    what << "; it is above " << (weights ? kCometBoundPerInputRms : kCometBoundPerStoredStd)
         << "x the " << (weights ? "RMS" : "standard deviation") << " of the values stored for it ("
         << cap << "), where the errors follow the values and estimates stop holding";
  }
  what << ". The bound is absolute: ";
  if (picked > 0 && std::isfinite(picked)) {
    what << "eb_mode: ADAPTIVE would pick " << std::setprecision(2) << picked << " here for "
         << 100 * param_.adaptive_target() << "%, ";
  } else {
    what << "eb_mode: ADAPTIVE, ";
  }
  what << "or a smaller comet_param { error_bound } on " << bd.layer << ".";
  LOG(WARNING) << what.str();
}

// Within [min_error_bound, max_error_bound], and, once a bound has been measured, at most twice
// what it was: a bound is used until the next measuring iteration, and early in training the
// activations' scale can fall several times between two of them. A bound near the activations'
// size rounds most of them to 0, and the error then rises steeply (GoogLeNet at batch 32 after 5
// steps: 1% of the gradient at a bound of 0.23, 53% at 0.63 one step later). Shrinking is not
// limited.
template <typename Dtype>
void CometBounds<Dtype>::Clamped(CometPlanBound* bd, double eb) {
  if (settled_.count(bd->layer)) eb = std::min<double>(eb, 2. * bd->eb);
  settled_.insert(bd->layer);
  eb = std::min<double>(std::max<double>(eb, param_.min_error_bound()), param_.max_error_bound());
  bd->eb = static_cast<float>(eb);
}

template <typename Dtype>
void CometBounds<Dtype>::AfterBackward(int layer) {
  if (!below_[layer].empty()) BoundByWeightsBelow(layer);
  if (!Measures(layer)) return;
  CometPlanBound& bd = bounds_[bound_of_layer_[layer]];
  const Blob<Dtype>* bottom = net_->bottom_vecs()[layer][0];
  const double dx_rms = std::sqrt(static_cast<double>(bottom->sumsq_diff()) / bottom->count());
  // A rule whose error is per_eb * eb: sets the bound, or audits a fixed one.
  const auto linear = [&](double per_eb, double rms, double cap) {
    if (!bd.fixed) return SetFrom(&bd, per_eb, rms, cap);
    const double picked = RuleBound(per_eb, rms, cap);
    if (picked >= 0) Audit(bd, per_eb * bd.eb / rms, cap, picked);
  };
  if (bd.rule == CometPlanBound::LRN) {
    linear(measured_[layer], dx_rms, 0);  // LrnErrorPerBound: error / eb
  } else if (bd.rule == CometPlanBound::DERIVATIVE) {
    // DerivativeErrorPerBound: error / eb
    const double cap = kCometBoundPerStoredStd * spread_[layer];
    linear(measured_[layer], dx_rms, cap);
    const std::vector<int>& below = derivative_below_[layer];
    for (size_t k = 0; k < below.size() && !bd.fixed; ++k) {
      // dx's errors, each its own, meet the weights once each: dW's RMS error is
      // eb sqrt(E mean(x^2) / (3 O)), E the sum of the squared errors of dx / eb^2 that the layer's
      // outputs hold (all of them, at most, where a Concat joined others: eb measured_ sqrt(count
      // / O), count dx's values), x its input, O its output channels
      const int w = below[k];
      below_[w].push_back(
          {layer, measured_[layer] * std::sqrt(bottom->count() / WeightOutputs(*net_, w)), cap});
    }
  } else if (bd.rule == CometPlanBound::BATCHNORM) {
    // BatchNormErrorScale: RMS error of dx = eb * sqrt(S / (3 C)).
    const double channels = CometLayerAccess<Dtype>::bn_std(net_->layers()[layer].get())->count();
    const double cap = kCometBoundPerStoredStd * spread_[layer];
    linear(std::sqrt(measured_[layer] / (3. * channels)), dx_rms, cap);
    const int w = weights_below_[layer];
    if (w >= 0 && !bd.fixed) {
      const Blob<Dtype>& weights = *net_->layers()[w]->blobs()[0];
      const double outputs = WeightOutputs(*net_, w);
      // the values a channel of BatchNorm's input has: each meets these weights once
      const double positions = net_->bottom_vecs()[layer][0]->count() / channels;
      const double fan_in = weights.count() / outputs;
      const double* t = &bn_weight_terms_[2 * layer];
      below_[w].push_back({layer, CometBatchNormWeightError(t[0] / channels, t[1] / channels,
                                                            positions, fan_in, 1., 1.), cap});
    }
  } else {
    // Weight gradient dW = sum x (x) dy, still the raw data gradient here (regularisation
    // comes later, in ApplyUpdate): the bound where the error measured before the backward
    // reaches the target, or the independent-error estimate.
    const Blob<Dtype>* w = WatchedGradient(*net_, layer);
    const double grad_rms = std::sqrt(static_cast<double>(w->sumsq_diff()) / w->count());
    Ladder& ladder = ladder_[layer];
    if (ladder.bounds.empty()) {
      // the error per unit of bound; 0: the input was not stored this iteration, no cap
      linear(measured_[layer], grad_rms, kCometBoundPerStoredStd * input_std_[layer]);
      input_std_[layer] = 0;
    } else if (bd.fixed) {
      // The curve was measured around the bound the input was stored at (a tighter reader's,
      // where it has one); read at this layer's own.
      const double cap = ladder.input_rms > 0 ? kCometBoundPerInputRms * ladder.input_rms : 0;
      const double at = CometErrorAt(ladder.bounds, ladder.errors, bd.eb);
      if (grad_rms > 0 && std::isfinite(grad_rms)) {
        Audit(bd, at >= 0 ? at / grad_rms : -1, cap,
              LadderBound(ladder, param_.adaptive_target() * grad_rms));
      }
    } else if (grad_rms > 0 && std::isfinite(grad_rms)) {
      const double margin = DriftMargin(bound_of_layer_[layer], ladder, grad_rms);
      const double eb = LadderBound(ladder, param_.adaptive_target() * grad_rms / margin);
      if (eb > 0 && std::isfinite(eb)) Clamped(&bd, eb);
    }
    ladder = Ladder();
  }
}

// After the backward of the Convolution or InnerProduct below an adaptive BatchNorm or derivative
// rule: the bound at which that layer's input gradient error, as these weights meet it
// (CometBatchNormWeightError; for a derivative, dx's independent errors), is the target of their
// gradient; the layer's bound is lowered to it where it is lower.
template <typename Dtype>
void CometBounds<Dtype>::BoundByWeightsBelow(int layer) {
  std::vector<LossyAbove> above;
  above.swap(below_[layer]);
  Layer<Dtype>& l = *net_->layers()[layer];
  if (!l.param_propagate_down(0)) return;  // frozen: its input may not even have been restored
  const Blob<Dtype>& w = *l.blobs()[0];
  // the input the weights met: an in-place Scale's or PReLU's is its copy (its bottom holds what
  // the layers above wrote, maybe freed by now)
  const Blob<Dtype>* in = net_->bottom_vecs()[layer][0];
  if (in == net_->top_vecs()[layer][0] && ChannelWeights(*net_, layer))
    in = CometLayerAccess<Dtype>::in_place_input_copy(&l);
  const Blob<Dtype>& x = *in;
  const double grad_rms = std::sqrt(static_cast<double>(w.sumsq_diff()) / w.count());
  const double x_rms = std::sqrt(static_cast<double>(x.sumsq_data()) / x.count());
  for (size_t k = 0; k < above.size(); ++k) {
    CometPlanBound& bd = bounds_[bound_of_layer_[above[k].layer]];
    const double eb = RuleBound(above[k].per_eb * x_rms, grad_rms, above[k].cap);
    if (eb >= 0 && eb < bd.eb) Clamped(&bd, eb);
  }
}

// The weight rule's margin (CometDriftMargin) from this curve and the last, both relative to
// their step's gradient, at the bound in effect: the ladder's middle, where the last pick was used.
template <typename Dtype>
double CometBounds<Dtype>::DriftMargin(int b, const Ladder& now, double grad_rms) {
  Drift& d = drift_[b];
  Ladder rel = now;
  for (int i = 0; i < rel.errors.size(); ++i) rel.errors[i] /= grad_rms;
  const double at = rel.bounds[kCometLadderSteps];
  const double before = CometErrorAt(d.last.bounds, d.last.errors, at);
  const double after = CometErrorAt(rel.bounds, rel.errors, at);
  d.margin = CometDriftMargin(d.margin, before, after);
  d.last = rel;
  VLOG(1) << "COMET: " << bounds_[b].layer << " at eb " << at << ": weight error " << after
          << " of the gradient (predicted " << before << "), margin " << d.margin << "; input RMS " << now.input_rms;
  return d.margin;
}

// LRN across channels: dx_i = dy_i s_i^-b - (2 a b / n) x_i sum_j dy_j y_j / s_j over the n
// channels j around i, s = k + (a / n) sum x^2 >= k. With errors e in x and f in y (each uniform in
// [-eb, eb]), the second term moves by (2 a b / n) sum_j (dy_j / s_j)(e_i y_j + x_i f_j): the e_i
// part is coherent over the window (at most n^2 E[dy^2 y^2] in square), the f_j parts add in
// squares (n E[x^2] E[dy^2]). The RMS error of dx is at most eb times the value returned,
// (2 a b / (n k sqrt 3)) sqrt(n^2 E[dy^2 y^2] + n E[x^2] E[dy^2]). (The scale itself is kept
// exact, or recomputed from the lossy input; recompute_lrn adds that term, not estimated here.)
// Within a channel the same form holds over the n = local_size^2 values of a spatial window, with
// k = 1 (Caffe's internal power layer computes (1 + a mean x^2)^-b).
template <typename Dtype>
double CometBounds<Dtype>::LrnErrorPerBound(int layer) const {
  Layer<Dtype>* l = net_->layers()[layer].get();
  const LRNParameter& p = l->layer_param().lrn_param();
  const bool across = p.norm_region() == LRNParameter_NormRegion_ACROSS_CHANNELS;
  const Blob<Dtype>* x = net_->bottom_vecs()[layer][0];
  const Blob<Dtype>* y = net_->top_vecs()[layer][0];
  std::vector<Dtype> x_copy, dy_copy, y_copy, s_copy;
  const Dtype* xd = HostValues(x, false, &x_copy);
  const Dtype* dy = HostValues(y, true, &dy_copy);
  // An output not held as values now (freed, or kept for other readers: a ReLU's sign mask, a
  // lossy copy, which keep_compressed leaves on it after their backward) is not read: LRN's CPU
  // backward across channels computes it again (patch 0027), within a channel its backward never
  // reads it. y = x s^-b, as Forward computed it, from the scale (across: s, raised to -b here;
  // within: computed from x, as the internal outputs may be freed too).
  const bool freed = y->data()->comet_payload() ||
                     y->data()->head() == SyncedMemory::UNINITIALIZED;
  const Dtype* yd = freed ? NULL : HostValues(y, false, &y_copy);
  const Dtype* sd =
      freed && across ? HostValues(CometLayerAccess<Dtype>::lrn_scale(l), false, &s_copy) : NULL;
  std::vector<float> within;  // s^-b
  if (freed && !across) {
    std::vector<float> xf(xd, xd + x->count());
    within.resize(x->count());
    CometLrnWithinScale(p, x->shape(0) * x->shape(1), x->shape(2), x->shape(3), xf.data(),
                        within.data());
  }
  const float minus_beta = -p.beta();
  double dyy = 0, xx = 0, dd = 0;
  for (int i = 0; i < y->count(); ++i) {
    const double g = dy[i], u = xd[i];
    const double v = !freed ? yd[i]
                     : across ? xd[i] * std::pow(static_cast<float>(sd[i]), minus_beta)
                              : xd[i] * within[i];
    dyy += g * g * v * v;
    xx += u * u;
    dd += g * g;
  }
  const double count = y->count();
  const double n = across ? p.local_size() : p.local_size() * p.local_size();
  const double k = across ? p.k() : 1.;
  dyy /= count;
  xx /= count;
  dd /= count;
  return 2. * p.alpha() * p.beta() / (n * k * std::sqrt(3.)) * std::sqrt(n * n * dyy + n * xx * dd);
}

// Sigmoid, TanH, ELU and Exp compute dx = dy f'(y) from their output y: f' = y (1 - y), 1 - y^2,
// alpha + y where x <= 0 (ELU; 1 elsewhere, from x's exact sign), or c y (Exp, c = log(base)
// scale). An error e in y (|e| <= eb, uniform) moves f' by e (1 - 2y) - e^2, -(2 y e + e^2), e
// or c e; to first order the RMS error of dx is eb sqrt(E[dy^2 g^2] / 3), g = 1 - 2y, 2y, 1 where
// y <= 0 and 0 elsewhere, or c (each element's error is its own: nothing sums errors over values,
// so their correlation does not matter). The e^2 term stays below eb times the first one
// wherever |g| >= eb (for Sigmoid, y no nearer 0.5 than eb / 2).
// Softmax computes dx_i = y_i (dy_i - s), s = sum_j dy_j y_j along its axis: an error e moves it
// by e_i (dy_i - s) - y_i sum_j dy_j e_j, an RMS of eb sqrt(E[(dy_i - s)^2 + y_i^2 sum_j dy_j^2]
// / 3) with the errors independent along the axis (their sum over j is the one place they meet).
// Swish (not in place) computes dx = dy f'(x) from its input: e in x moves dx by e dy f''(x),
// f''(x) = beta s (1 - s) (2 + beta x (1 - 2 s)), s = sigma(beta x) (|f''| <= beta / 2), an RMS
// of eb sqrt(E[dy^2 f''^2] / 3) the same way. In place it reads the sigmoid's input u = beta x
// instead: e in u moves dx by e dy f''(x) / beta.
// Returns that per unit of bound, from the y (Swish: x, or u) the backward is about to read.
template <typename Dtype>
double CometBounds<Dtype>::DerivativeErrorPerBound(int layer, double* spread) const {
  const CometLayerFacts::Derivative kind = derivative_[layer];
  CHECK_NE(kind, CometLayerFacts::NO_DERIVATIVE) << net_->layer_names()[layer];
  const bool scaled = kind == CometLayerFacts::SWISH_OF_SCALED_INPUT;
  const bool of_input = kind == CometLayerFacts::SWISH_OF_INPUT || scaled;
  const Blob<Dtype>* y =
      scaled     ? CometLayerAccess<Dtype>::swish_sigmoid(net_->layers()[layer].get(), 0)
      : of_input ? net_->bottom_vecs()[layer][0]
                 : net_->top_vecs()[layer][0];
  const LayerParameter& lp = net_->layers()[layer]->layer_param();
  std::vector<Dtype> y_copy, dy_copy;
  const Dtype* yd = HostValues(y, false, &y_copy);
  const Dtype* dy = HostValues(net_->top_vecs()[layer][0], true, &dy_copy);
  const double beta = lp.swish_param().beta();
  double sum = 0, m1 = 0, m2 = 0;
  if (kind == CometLayerFacts::SOFTMAX_OF_OUTPUT) {
    const int axis = y->CanonicalAxisIndex(lp.softmax_param().axis());
    const int outer = y->count(0, axis), channels = y->shape(axis), inner = y->count(axis + 1);
    for (int o = 0; o < outer; ++o) {
      for (int k = 0; k < inner; ++k) {
        const size_t at = static_cast<size_t>(o) * channels * inner + k;
        double s = 0, d = 0;
        for (int c = 0; c < channels; ++c) {
          s += static_cast<double>(dy[at + c * inner]) * yd[at + c * inner];
          d += static_cast<double>(dy[at + c * inner]) * dy[at + c * inner];
        }
        for (int c = 0; c < channels; ++c) {
          const double g = dy[at + c * inner] - s, v = yd[at + c * inner];
          sum += g * g + v * v * d;
        }
      }
    }
  }
  const ExpParameter& ep = lp.exp_param();
  const double c = ep.scale() * (ep.base() == -1 ? 1. : std::log(static_cast<double>(ep.base())));
  for (int i = 0; i < y->count(); ++i) {
    if (kind != CometLayerFacts::SOFTMAX_OF_OUTPUT) {
      double g;
      if (of_input) {
        const double bx = scaled ? yd[i] : beta * yd[i], s = 0.5 * std::tanh(0.5 * bx) + 0.5;
        g = (scaled ? 1. : beta) * s * (1. - s) * (2. + bx * (1. - 2. * s));
      } else {
        g = kind == CometLayerFacts::SIGMOID_OF_OUTPUT ? 1. - 2. * yd[i]
            : kind == CometLayerFacts::TANH_OF_OUTPUT  ? 2. * yd[i]
            : kind == CometLayerFacts::EXP_OF_OUTPUT   ? c
                                                       : yd[i] <= 0;  // ELU
      }
      sum += static_cast<double>(dy[i]) * dy[i] * g * g;
    }
    m1 += yd[i];
    m2 += static_cast<double>(yd[i]) * yd[i];
  }
  *spread = StdOf(m1, m2, y->count());
  return std::sqrt(sum / (3. * std::max(y->count(), 1)));
}

// BatchNorm's input gradient is dx = (dy - mean(dy) - y mean(dy y)) / std per channel, y its
// normalised output. An error e in y (|e| <= eb, uniform) moves dx by e mean(dy y) / std and by
// y mean(dy e) / std, which averages over the channel's N x H x W values (negligible unless they
// are few), so the RMS error of dx is eb * sqrt(S / (3 C)) with S the sum over the channels of
// CometBatchNormChannelError (about (mean_c(dy y) / std_c)^2). Returns S, computed from the y
// the backward is about to read.
template <typename Dtype>
double CometBounds<Dtype>::BatchNormErrorScale(int layer, double* spread,
                                               double weight_terms[2]) const {
  Layer<Dtype>* l = net_->layers()[layer].get();
  const Blob<Dtype>* y = CometLayerAccess<Dtype>::bn_x_norm(l);
  const Blob<Dtype>* sd = CometLayerAccess<Dtype>::bn_std(l);
  const Blob<Dtype>* top = net_->top_vecs()[layer][0];
  const int num = y->shape(0), channels = sd->count();
  const int spatial = y->count() / (num * channels);
  std::vector<Dtype> y_copy, dy_copy, s_copy;
  const Dtype* yd = HostValues(y, false, &y_copy);
  const Dtype* dy = HostValues(top, true, &dy_copy);
  const Dtype* s = HostValues(sd, false, &s_copy);
  double total = 0, y1 = 0, y2 = 0;
  weight_terms[0] = weight_terms[1] = 0;
  const double per_channel = static_cast<double>(num) * spatial;
  for (int c = 0; c < channels; ++c) {
    double m1 = 0, dy2 = 0, yy = 0;
    for (int n = 0; n < num; ++n) {
      const size_t off = (static_cast<size_t>(n) * channels + c) * spatial;
      for (int i = 0; i < spatial; ++i) {
        m1 += static_cast<double>(dy[off + i]) * yd[off + i];
        dy2 += static_cast<double>(dy[off + i]) * dy[off + i];
        yy += static_cast<double>(yd[off + i]) * yd[off + i];
        y1 += yd[off + i];
      }
    }
    y2 += yy;
    total += CometBatchNormChannelError(m1, dy2, yy, per_channel, s[c]);
    if (s[c] > 0) {  // CometBatchNormWeightError's a and b, summed
      const double var = static_cast<double>(s[c]) * s[c];
      weight_terms[0] += (m1 / per_channel) * (m1 / per_channel) / var;
      weight_terms[1] += dy2 / per_channel / var;
    }
  }
  *spread = StdOf(y1, y2, y->count());
  return total;
}

template <typename Dtype>
void CometBounds<Dtype>::Save(const std::string& filename, int iter) const {
  CometState state;
  state.set_iter(iter);
  for (int b = 0; b < bounds_.size(); ++b) {
    CometState::LayerBound* lb = state.add_bound();
    lb->set_layer(bounds_[b].layer);
    lb->set_error_bound(bounds_[b].eb);
    if (b < drift_.size() && !drift_[b].last.bounds.empty()) {  // an exact resume needs them
      lb->set_margin(drift_[b].margin);
      for (int i = 0; i < drift_[b].last.bounds.size(); ++i) {
        lb->add_curve_bound(drift_[b].last.bounds[i]);
        lb->add_curve_error(drift_[b].last.errors[i]);
      }
    }
  }
  LOG(INFO) << "COMET: saving error bounds to " << filename;
  WriteProtoToTextFile(state, filename);
}

template <typename Dtype>
void CometBounds<Dtype>::Load(const std::string& solverstate_filename, int iter) {
  const std::string filename = CometFileBeside(solverstate_filename, ".cometstate");
  std::ifstream probe(filename.c_str());
  if (!probe.good()) {
    LOG(WARNING) << "COMET: no " << filename << " beside the snapshot; error bounds start over";
    return;
  }
  CometState state;
  if (!ReadProtoFromTextFile(filename, &state)) CometFatal("COMET: cannot parse " + filename);
  if (!state.has_iter() && state.bound_size() == 0)
    CometFatal("COMET: " + filename + " is empty; delete it to start the error bounds over");
  if (state.iter() != iter)
    CometFatal("COMET: " + filename + " belongs to iteration " + CometNum(state.iter()) +
               ", the solver state to iteration " + CometNum(iter));
  int restored = 0;
  for (int i = 0; i < state.bound_size(); ++i) {
    const CometState::LayerBound& lb = state.bound(i);
    const float eb = lb.error_bound();
    if (!(eb > 0) || !std::isfinite(eb))
      CometFatal("COMET: bad error bound " + CometNum(eb) + " for layer " + lb.layer() +
                 " in " + filename);
    bool curve_ok = lb.curve_bound_size() == lb.curve_error_size() &&
                    (!lb.has_margin() || (lb.margin() >= 1 && lb.margin() <= 16));
    for (int k = 0; k < lb.curve_bound_size(); ++k)
      curve_ok = curve_ok && lb.curve_bound(k) > 0 && std::isfinite(lb.curve_bound(k)) &&
                 lb.curve_error(k) >= 0 && std::isfinite(lb.curve_error(k));
    if (!curve_ok)
      CometFatal("COMET: bad weight-rule curve or margin for layer " + lb.layer() + " in " +
                 filename);
    bool known = false;
    for (int b = 0; b < bounds_.size(); ++b) {
      if (bounds_[b].layer != lb.layer()) continue;
      known = true;
      if (!bounds_[b].fixed) {
        bounds_[b].eb = eb;
        settled_.insert(bounds_[b].layer);
        Drift& d = drift_[b];
        d = Drift();
        if (lb.has_margin()) d.margin = lb.margin();
        d.last.bounds.assign(lb.curve_bound().begin(), lb.curve_bound().end());
        d.last.errors.assign(lb.curve_error().begin(), lb.curve_error().end());
        ++restored;
      }
    }
    if (!known)
      CometFatal("COMET: " + filename + " has a bound for layer " + lb.layer() +
                 ", which this net does not store lossy (another net's state?)");
  }
  LOG(INFO) << "COMET: restored " << restored << " error bounds from " << filename;
}

INSTANTIATE_CLASS(CometBounds);

}  // namespace caffe
