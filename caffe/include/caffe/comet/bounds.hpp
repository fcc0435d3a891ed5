#ifndef CAFFE_COMET_BOUNDS_HPP_
#define CAFFE_COMET_BOUNDS_HPP_

// COMET-Caffe: the error bounds of a train net's lossy entries and the adaptive rules that set
// them (docs/comet.md#adaptive-error-bounds-the-derivation). The store asks for the bound of an
// entry before it encodes, and on measuring iterations calls BeforeBackward/AfterBackward around
// each layer's backward; the rule of the layer's bound measures what it needs and sets it.

#include <set>
#include <string>
#include <vector>

#include "caffe/comet/error_model.hpp"
#include "caffe/comet/plan.hpp"
#include "caffe/net.hpp"
#include "caffe/proto/caffe.pb.h"

namespace caffe {

// The weight rule's bound stays at most this times the RMS of the sample of its input that its
// error curve is measured on.
const double kCometBoundPerInputRms = 0.5;
// The BatchNorm and derivative rules' bounds, and the weight rule's where it has no curve (the
// independent estimate: PReLU's slope, Scale, Deconvolution), stay at most this times the
// standard deviation of the values stored (x_norm_, Sigmoid's, TanH's or ELU's output, the
// layer's input). Their estimates take the errors as independent of the values, which holds
// while the bound is small against the values' spread; near it sz rounds many values to their
// prediction, the error follows the values, and the gradients see it (docs/comet.md: upstream's
// CIFAR-10 Sigmoid net; a PReLU summing a gradient of one sign, from a Reduction loss on its
// output, reached a bound of 0.97 and its slope gradient 16% off at a 5% target:
// scripts/fuzz_nets seed 70).
const double kCometBoundPerStoredStd = 0.25;
// A fixed bound (eb_mode FIXED, a layer's comet_param.error_bound) is set by no rule, but the first
// step that measures (the first step, in FIXED mode) estimates the gradient error it gives, and
// the log warns where that is above this fraction of the gradient's RMS (or where the bound is
// above the rule's cap, where the estimate stops holding).
const double kCometFixedBoundWarning = 0.25;

template <typename Dtype>
class CometBounds {
 public:
  CometBounds(const Net<Dtype>* net, const CometParameter& param) : net_(net), param_(param) {}

  // Takes a new plan's bounds; a layer's bound keeps the value it had under the old plan.
  void Reset(const CometPlan& plan);
  const std::vector<CometPlanBound>& all() const { return bounds_; }
  float Of(int b) const;  // the bound in effect (an LRN that follows takes its leader's)
  float Of(const std::string& layer) const;  // -1 for a layer without a bound
  void Set(const std::string& layer, float eb);
  float ForEntry(const CometPlanEntry& e) const;  // the tightest bound of its readers

  // Measuring iterations: when a lossy entry is encoded (data: its dense values, on the device
  // or not, of the given shape, stored at eb), the error statistics its weighted readers' rule
  // needs; then around the backward of each layer whose adaptive rule applies.
  void NoteStoredInput(const CometPlanEntry& e, const float* data, bool on_device,
                       const std::vector<int>& shape, float eb);
  void BeforeBackward(int layer);
  void AfterBackward(int layer);
  // Fixed bounds whose error no step has estimated yet: the next step should measure.
  bool Audits() const;
  void EndAudit();  // a step that measured has ended: every fixed bound had its chance
  // Host memory the samples hold, each from its input's encode to its layer's backward.
  size_t SampleBytes() const;

  // <prefix>_iter_N.cometstate beside the solver state: written at snapshots, and read back on
  // restore, where a file that is empty, foreign or of another iteration is refused.
  void Save(const std::string& filename, int iter) const;
  void Load(const std::string& solverstate_filename, int iter);

 private:
  bool Measures(int layer) const;
  // *spread: the standard deviation of the stored values the rule reads; weight_terms: the sums
  // over the channels of CometBatchNormWeightError's a and b.
  double BatchNormErrorScale(int layer, double* spread, double weight_terms[2]) const;
  // A BatchNorm or a derivative-rule layer (TanH, Sigmoid, ...) whose input this Convolution or
  // InnerProduct wrote has set its bound from its input gradient's error; that error also reaches
  // this layer's weight gradient, where a true gradient that its terms cancel shows it more: the
  // bound is lowered where this layer's weight gradient needs it (docs/comet.md, "BatchNorm's
  // x_norm_": the weights below; "The weights below a derivative rule").
  void BoundByWeightsBelow(int layer);
  double LrnErrorPerBound(int layer) const;
  double DerivativeErrorPerBound(int layer, double* spread) const;
  void MeasureWeightErrors(int layer);
  double RuleBound(double per_eb, double gradient_rms, double cap) const;
  void SetFrom(CometPlanBound* bd, double per_eb, double gradient_rms, double cap = 0);
  // A fixed bound's estimate: its gradient's relative RMS error at the bound, the cap the rule
  // would hold it under (0: none), and the bound the rule would pick (-1: none).
  void Audit(const CometPlanBound& bd, double error, double cap, double picked) const;
  void Clamped(CometPlanBound* bd, double eb);  // sets it within the limits

  const Net<Dtype>* net_;
  CometParameter param_;
  std::vector<CometPlanBound> bounds_;
  std::vector<int> bound_of_layer_;  // layer -> bound or -1
  std::vector<double> measured_;     // layer -> what BeforeBackward measured
  std::vector<double> spread_;       // layer -> its stored values' spread, where the rule caps by it
  std::vector<double> input_std_;    // layer -> its stored input's spread (the independent estimate)
  std::vector<CometLayerFacts::Derivative> derivative_;  // layer -> how f' follows from its output
  std::vector<CometErrorSample> errors_;  // bound -> its input's sample, this measuring iteration
  struct Ladder {
    std::vector<double> bounds, errors;  // the weight rule's RMS errors at these bounds
    double input_rms = 0;  // of the sampled input values
  };
  std::vector<Ladder> ladder_;       // layer -> measured before its backward
  double LadderBound(const Ladder& ladder, double target) const;  // the weight rule's pick
  // The weight rule's drift: a bound is picked from one batch's curve and used on the batches
  // until the next measurement, whose curve can lie higher. Per bound: the last curve (errors
  // relative to the gradient's RMS) and the margin its successors have needed (>= 1).
  struct Drift {
    Drift() : margin(kCometFirstDriftMargin) {}
    Ladder last;
    double margin;
  };
  std::vector<Drift> drift_;
  double DriftMargin(int b, const Ladder& now, double grad_rms);  // updates drift_[b]
  std::set<std::string> settled_;    // bounds measured (or restored) once: they grow at most 2x
  std::vector<bool> audited_;        // bound -> a fixed one whose estimate a step has made
  std::vector<int> weights_below_;  // BatchNorm layer -> the weighted layer below it, or -1
  // derivative-rule layer -> the weighted layers below it
  std::vector<std::vector<int> > derivative_below_;
  std::vector<double> bn_weight_terms_;  // BatchNorm layer -> 2 channel sums, this step
  struct LossyAbove {
    int layer;      // its bound to lower after the weighted layer's backward, this step
    double per_eb;  // the weight gradient's RMS error per unit of eb and of the input's RMS
    double cap;     // the layer's own rule's cap
  };
  std::vector<std::vector<LossyAbove> > below_;  // weighted layer -> the layers above to bound
};

}  // namespace caffe

#endif  // CAFFE_COMET_BOUNDS_HPP_
