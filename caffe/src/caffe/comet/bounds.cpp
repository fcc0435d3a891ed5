// COMET-Caffe: error bounds and their adaptive rules (include/caffe/comet/bounds.hpp).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "caffe/comet/bounds.hpp"
#include "caffe/comet/layer_access.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/resume.hpp"
#include "caffe/util/io.hpp"

namespace caffe {

namespace {
std::string Num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
}  // namespace

template <typename Dtype>
void CometBounds<Dtype>::Reset(const CometPlan& plan) {
  std::map<std::string, float> old;
  for (int b = 0; b < bounds_.size(); ++b) old[bounds_[b].layer] = bounds_[b].eb;
  bounds_ = plan.bounds;
  for (int b = 0; b < bounds_.size(); ++b)
    if (old.count(bounds_[b].layer)) bounds_[b].eb = old[bounds_[b].layer];
  bound_of_layer_ = plan.bound_of_layer;
  measured_.assign(bound_of_layer_.size(), 0);
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

// Whether the layer's bound has a rule of its own to measure (adaptive, not following another,
// the layer runs backward; the weight rule needs weights).
template <typename Dtype>
bool CometBounds<Dtype>::Measures(int layer) const {
  if (bound_of_layer_[layer] < 0 || !net_->layer_need_backward()[layer]) return false;
  const CometPlanBound& bd = bounds_[bound_of_layer_[layer]];
  if (!bd.adapt || bd.follow >= 0) return false;
  return bd.rule != CometPlanBound::WEIGHT_GRADIENT || !net_->layers()[layer]->blobs().empty();
}

template <typename Dtype>
void CometBounds<Dtype>::BeforeBackward(int layer) {
  if (!Measures(layer)) return;
  switch (bounds_[bound_of_layer_[layer]].rule) {
    case CometPlanBound::BATCHNORM: measured_[layer] = BatchNormErrorScale(layer); break;
    case CometPlanBound::LRN: measured_[layer] = LrnErrorPerBound(layer); break;
    default: {
      // ||dy||^2 of the layer's output gradient, for the error estimate after its backward.
      const std::vector<Blob<Dtype>*>& tops = net_->top_vecs()[layer];
      double s = 0;
      for (int k = 0; k < tops.size(); ++k) s += static_cast<double>(tops[k]->sumsq_diff());
      measured_[layer] = s;
    }
  }
}

// eb such that the estimated gradient error (per_eb * eb) is adaptive_target times the
// gradient's RMS, clamped to [min_error_bound, max_error_bound].
template <typename Dtype>
void CometBounds<Dtype>::SetFrom(CometPlanBound* bd, double per_eb, double gradient_rms) {
  if (!(per_eb > 0) || !(gradient_rms > 0) || !std::isfinite(per_eb) ||
      !std::isfinite(gradient_rms)) {
    return;  // nothing to learn from this step (a zero or non-finite gradient)
  }
  double eb = param_.adaptive_target() * gradient_rms / per_eb;
  eb = std::min<double>(std::max<double>(eb, param_.min_error_bound()), param_.max_error_bound());
  bd->eb = static_cast<float>(eb);
}

template <typename Dtype>
void CometBounds<Dtype>::AfterBackward(int layer) {
  if (!Measures(layer)) return;
  CometPlanBound& bd = bounds_[bound_of_layer_[layer]];
  const Blob<Dtype>* bottom = net_->bottom_vecs()[layer][0];
  const double dx_rms = std::sqrt(static_cast<double>(bottom->sumsq_diff()) / bottom->count());
  if (bd.rule == CometPlanBound::LRN) {
    SetFrom(&bd, measured_[layer], dx_rms);  // LrnErrorPerBound: error / eb
  } else if (bd.rule == CometPlanBound::BATCHNORM) {
    // BatchNormErrorScale: RMS error of dx = eb * sqrt(S / (3 C)).
    const double channels = CometLayerAccess<Dtype>::bn_std(net_->layers()[layer].get())->count();
    SetFrom(&bd, std::sqrt(measured_[layer] / (3. * channels)), dx_rms);
  } else {
    // Weight gradient dW = sum x (x) dy. An input error uniform in [-eb, eb] gives each weight
    // an error of standard deviation eb/sqrt(3) * ||dy_o|| (dy_o: the output channel the weight
    // feeds), so the RMS error over the weights is eb * ||dy|| / sqrt(3 O), O output channels
    // (the gradient is still the raw data gradient: regularisation comes later, in ApplyUpdate).
    const Blob<Dtype>* w = net_->layers()[layer]->blobs()[0].get();
    const double grad_rms = std::sqrt(static_cast<double>(w->sumsq_diff()) / w->count());
    SetFrom(&bd, std::sqrt(measured_[layer]) / std::sqrt(3. * w->shape(0)), grad_rms);
  }
}

// LRN across channels: dx_i = dy_i s_i^-b - (2 a b / n) x_i sum_j dy_j y_j / s_j over the n
// channels j around i, s = k + (a / n) sum x^2 >= k. With errors e in x and f in y (each uniform in
// [-eb, eb]), the second term moves by (2 a b / n) sum_j (dy_j / s_j)(e_i y_j + x_i f_j): the e_i
// part is coherent over the window (at most n^2 E[dy^2 y^2] in square), the f_j parts add in
// squares (n E[x^2] E[dy^2]). The RMS error of dx is at most eb times the value returned,
// (2 a b / (n k sqrt 3)) sqrt(n^2 E[dy^2 y^2] + n E[x^2] E[dy^2]). (The scale itself is kept
// exact, or recomputed from the lossy input; recompute_lrn adds that term, not estimated here.)
template <typename Dtype>
double CometBounds<Dtype>::LrnErrorPerBound(int layer) const {
  const LRNParameter& p = net_->layers()[layer]->layer_param().lrn_param();
  const Blob<Dtype>* x = net_->bottom_vecs()[layer][0];
  const Blob<Dtype>* y = net_->top_vecs()[layer][0];
  const Dtype* xd = x->cpu_data();
  const Dtype* yd = y->cpu_data();
  const Dtype* dy = y->cpu_diff();
  double dyy = 0, xx = 0, dd = 0;
  for (int i = 0; i < y->count(); ++i) {
    const double g = dy[i], v = yd[i], u = xd[i];
    dyy += g * g * v * v;
    xx += u * u;
    dd += g * g;
  }
  const double count = y->count(), n = p.local_size();
  dyy /= count;
  xx /= count;
  dd /= count;
  return 2. * p.alpha() * p.beta() / (n * p.k() * std::sqrt(3.)) *
         std::sqrt(n * n * dyy + n * xx * dd);
}

// BatchNorm's input gradient is dx = (dy - mean(dy) - y mean(dy y)) / std per channel, y its
// normalised output. An error e in y (|e| <= eb, uniform) moves dx by about -e mean(dy y) / std
// (the term with mean(dy e) averages over the channel's N x H x W values and is negligible), so
// the RMS error of dx is eb * sqrt(S / (3 C)) with S = sum_c (mean_c(dy y) / std_c)^2. Returns S,
// computed from the y the backward is about to read.
template <typename Dtype>
double CometBounds<Dtype>::BatchNormErrorScale(int layer) const {
  Layer<Dtype>* l = net_->layers()[layer].get();
  const Blob<Dtype>* y = CometLayerAccess<Dtype>::bn_x_norm(l);
  const Blob<Dtype>* sd = CometLayerAccess<Dtype>::bn_std(l);
  const Blob<Dtype>* top = net_->top_vecs()[layer][0];
  const int num = y->shape(0), channels = sd->count();
  const int spatial = y->count() / (num * channels);
  const Dtype* yd = y->cpu_data();
  const Dtype* dy = top->cpu_diff();
  const Dtype* s = sd->cpu_data();
  double total = 0;
  for (int c = 0; c < channels; ++c) {
    double m1 = 0;
    for (int n = 0; n < num; ++n) {
      const size_t off = (static_cast<size_t>(n) * channels + c) * spatial;
      for (int i = 0; i < spatial; ++i) m1 += static_cast<double>(dy[off + i]) * yd[off + i];
    }
    m1 /= static_cast<double>(num) * spatial;
    const double r = m1 / s[c];
    total += r * r;
  }
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
    CometFatal("COMET: " + filename + " belongs to iteration " + Num(state.iter()) +
               ", the solver state to iteration " + Num(iter));
  int restored = 0;
  for (int i = 0; i < state.bound_size(); ++i) {
    const float eb = state.bound(i).error_bound();
    if (!(eb > 0) || !std::isfinite(eb))
      CometFatal("COMET: bad error bound " + Num(eb) + " for layer " + state.bound(i).layer() +
                 " in " + filename);
    bool known = false;
    for (int b = 0; b < bounds_.size(); ++b) {
      if (bounds_[b].layer != state.bound(i).layer()) continue;
      known = true;
      if (!bounds_[b].fixed) {
        bounds_[b].eb = eb;
        ++restored;
      }
    }
    if (!known)
      CometFatal("COMET: " + filename + " has a bound for layer " + state.bound(i).layer() +
                 ", which this net does not store lossy (another net's state?)");
  }
  LOG(INFO) << "COMET: restored " << restored << " error bounds from " << filename;
}

INSTANTIATE_CLASS(CometBounds);

}  // namespace caffe
