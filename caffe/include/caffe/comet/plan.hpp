#ifndef CAFFE_COMET_PLAN_HPP_
#define CAFFE_COMET_PLAN_HPP_

// COMET-Caffe: the store's plan, a pure function of a built net and the comet { } settings
// (docs/comet.md#the-plan). It says, for every group of blobs sharing memory and every large
// layer-private buffer, what happens to it after its last forward reader and when it is freed
// again in backward. CometStore executes it; test_comet_plan.cpp tests it on branching nets.

#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "caffe/comet/layer_facts.hpp"
#include "caffe/net.hpp"
#include "caffe/proto/caffe.pb.h"

namespace caffe {

struct CometActions {
  // LOSSY, MASK, RELEASE, KEEP: net blobs. ARGMAX, BINARY, RECOMPUTE, REBUILD: a layer's private
  // buffer (max pooling's argmax and Dropout's mask as packed codes; LRN's scale freed and
  // recomputed by LRN's forward; BatchNorm's and in-place Scale's temp_ freed after the forward
  // and rebuilt exactly before the backward).
  enum Action { KEEP = 0, RELEASE, LOSSY, MASK, ARGMAX, BINARY, RECOMPUTE, REBUILD };
  static const char* ActionName(Action a);
};

struct CometPlanEntry : public CometActions {
  CometPlanEntry()
      : layer(-1), source(-1), action(KEEP), buffer(KEEP), part(0), unread(false), signs(false),
        last_forward(-1), last_backward(-1), rebuild_from(-1), rebuild_scale(-1),
        rebuild_relu(-1), rebuilds(-1) {}
  std::string name;            // what the log calls it: the reading layer(s)
  std::string blob;            // first blob name, or "<layer> argmax|mask|scale"
  std::vector<int> blob_ids;   // empty for a layer-private buffer
  int layer;                   // the layer owning a private buffer, else -1
  int source;                  // REBUILD of Scale's copy: the BatchNorm layer it copied, else -1
  Action action;
  // A private buffer: which one, named by the action that stores it when its layer runs backward
  // (ARGMAX, BINARY: Dropout's mask, RECOMPUTE: LRN's scale, REBUILD: BatchNorm's temp_ or
  // Scale's copy, KEEP or LOSSY: BatchNorm's x_norm_ or in-place PReLU's copy of its input).
  // `action` is the same, but RELEASE for a layer that runs no backward: nobody reads its
  // buffers after its forward.
  Action buffer;
  int part;  // which of the layer's buffers of that kind (RECOMPUTE within a channel: LRN's 0-2)
  // RECOMPUTE: freed after the forward and not computed again, as the layer's backward is computed
  // without it (LRN within a channel by the store, CometLayerFacts::lrn_from_input; Swish's sigmoid
  // buffers, patch 0038). REBUILD: freed after the forward and not rebuilt, as the layer's backward
  // writes it whole before reading it (MVN's temp_): only that write may touch it in between.
  bool unread;
  bool signs;                  // LOSSY read by ReLU or PReLU too: a sign mask is stored alongside
  int last_forward;            // compress/release after this layer's forward
  int last_backward;           // free again after this layer's backward (-1: none)
  std::vector<int> eb_layers;  // LOSSY: indices into the plan's bounds of the layers reading it
  // LOSSY net blob that in-place Scale (rebuild_scale) and ReLU (rebuild_relu, or -1) made from
  // BatchNorm's output (comet { rebuild_from_batchnorm }): the entry of that BatchNorm's x_norm_,
  // from which CPU mode rebuilds it instead of storing it; on that entry, `rebuilds` names it.
  int rebuild_from, rebuild_scale, rebuild_relu, rebuilds;
};

// The error bound of one layer whose input is stored lossy.
struct CometPlanBound {
  // How the adaptive rule estimates the gradient error an input error eb causes: a weight
  // gradient sum x (x) dy (Convolution, InnerProduct, Scale's scale), or BatchNorm's input
  // gradient from its normalised output (docs/comet.md#adaptive-error-bounds-the-derivation).
  // LRN: its input gradient from its lossy input and output, used when no layer with an
  // adaptive rule reads the same stored blob (else LRN follows that layer's bound).
  // DERIVATIVE: Sigmoid's, TanH's or ELU's input gradient dy f'(y) from its lossy output y.
  enum Rule { WEIGHT_GRADIENT = 0, BATCHNORM, LRN, DERIVATIVE };
  Rule rule;
  std::string layer;
  int layer_id;
  float eb;
  bool fixed;  // set by the layer's comet_param.error_bound, or eb_mode FIXED
  bool measurable;  // the layer's rule can estimate its error (the layer's facts say so)
  bool adapt;       // measurable and not fixed: the adaptive rule sets it
  int follow;  // in ADAPTIVE mode, LRN follows this bound when a weighted layer shares its blob
};

struct CometPlan {
  std::vector<CometLayerFacts> facts;         // layer -> its row
  std::vector<int> data_group, diff_group;    // blob -> memory it shares with others
  std::vector<CometPlanEntry> entries;
  std::vector<CometPlanBound> bounds;
  std::vector<std::vector<int> > after_forward;     // layer -> entries
  std::vector<std::vector<int> > after_backward;    // layer -> entries
  std::vector<std::vector<int> > private_of_layer;  // layer -> its private-buffer entries
  std::vector<std::vector<int> > backward_reads;    // layer -> entries its backward decodes
  std::vector<std::vector<int> > diff_release;      // layer -> blob ids whose diff is freed after
  std::vector<std::vector<int> > tops_written;      // layer -> blob ids its forward overwrites
  std::vector<int> entry_of_blob;                   // blob -> entry or -1
  std::vector<int> bound_of_layer;                  // layer -> bound or -1
  // layer -> the entry of its x_norm_ where BatchNorm with batch statistics stores it lossy, else
  // -1: after that backward the store takes each channel's mean out of the input gradient
  // (CometLayerAccess::CentreBatchNormInputGradient says why).
  std::vector<int> lossy_x_norm;
  // layer -> that x_norm_ has runs of one value (a ReLU's zeros below BatchNorm), whose errors sz
  // makes alike: every channel is moved back to its moments (batchnorm_moments.hpp)
  std::vector<bool> x_norm_ties;
  std::vector<std::string> notes;                   // what stays dense and why, once each
};

// Pairs of blob ids found to share data (diff) memory at run time that the facts did not name;
// they are planned as one group.
typedef std::vector<std::pair<int, int> > CometAliases;

template <typename Dtype>
CometPlan MakeCometPlan(const Net<Dtype>& net, const CometParameter& param,
                        const CometAliases& data_aliases, const CometAliases& diff_aliases);

// The last layer below layer `before` that writes blob `blob` (an id of net.blobs()); -1 for none.
template <typename Dtype>
int CometLastWriter(const Net<Dtype>& net, int blob, int before);

// The layer below layer i that wrote its first input, looking through the layers j for which
// through(j) holds (each passes the blob's values, or their gradient, on to its own first
// bottom); -1 for none (a net input).
template <typename Dtype>
int CometWriterBelow(const Net<Dtype>& net, int i, const std::function<bool(int)>& through);

// Human-readable plan, one line per entry, then the notes.
template <typename Dtype>
std::string DescribeCometPlan(const CometPlan& plan, const Net<Dtype>& net,
                              const CometParameter& param);

}  // namespace caffe

#endif  // CAFFE_COMET_PLAN_HPP_
