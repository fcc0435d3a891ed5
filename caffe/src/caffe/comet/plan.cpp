// COMET-Caffe: the store's plan (include/caffe/comet/plan.hpp).
#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "caffe/comet/plan.hpp"

namespace caffe {

const char* CometActions::ActionName(Action a) {
  static const char* names[] = {"keep",   "release", "lossy", "mask",
                                "argmax", "binary",  "scale", "rebuild"};
  return names[a];
}

namespace {

// Union-find over blob ids.
class Groups {
 public:
  explicit Groups(int n) : parent_(n) {
    for (int i = 0; i < n; ++i) parent_[i] = i;
  }
  int Find(int i) { return parent_[i] == i ? i : (parent_[i] = Find(parent_[i])); }
  void Join(int a, int b) {
    a = Find(a);
    b = Find(b);
    if (a != b) parent_[std::max(a, b)] = std::min(a, b);
  }
  // Dense group numbers 0..G-1 in blob order.
  std::vector<int> Number(int* count) {
    std::map<int, int> id;
    std::vector<int> out(parent_.size());
    for (int i = 0; i < out.size(); ++i) {
      const int r = Find(i);
      if (!id.count(r)) id[r] = static_cast<int>(id.size());
      out[i] = id[r];
    }
    *count = id.size();
    return out;
  }

 private:
  std::vector<int> parent_;
};

// Blobs that share memory: what the layer facts say a layer shares (Split's tops are its bottom
// after Forward, Flatten's diff after Backward), what is shared already (in-place layers are one
// blob; Reshape shares at setup), and what was found sharing at run time.
template <typename Dtype>
std::vector<int> MemoryGroups(const Net<Dtype>& net, const std::vector<CometLayerFacts>& facts,
                              bool diff, const CometAliases& aliases, int* count) {
  const int B = net.blobs().size();
  Groups g(B);
  for (int i = 0; i < facts.size(); ++i) {
    const std::vector<int>& of = diff ? facts[i].top_diff_of : facts[i].top_data_of;
    for (int k = 0; k < of.size(); ++k)
      if (of[k] >= 0) g.Join(net.top_ids(i)[k], net.bottom_ids(i)[of[k]]);
  }
  std::map<const SyncedMemory*, int> first;
  for (int b = 0; b < B; ++b) {
    const SyncedMemory* mem = (diff ? net.blobs()[b]->diff() : net.blobs()[b]->data()).get();
    if (!mem) continue;
    std::map<const SyncedMemory*, int>::iterator it = first.find(mem);
    if (it == first.end()) first[mem] = b;
    else g.Join(b, it->second);
  }
  for (int a = 0; a < aliases.size(); ++a) g.Join(aliases[a].first, aliases[a].second);
  return g.Number(count);
}

// The bound of layer i (created once), for a stored input it reads.
template <typename Dtype>
int BoundOf(CometPlan* plan, const Net<Dtype>& net, const CometParameter& param, int i,
            CometPlanBound::Rule rule) {
  if (plan->bound_of_layer[i] >= 0) return plan->bound_of_layer[i];
  const LayerParameter& lp = net.layers()[i]->layer_param();
  const bool own = lp.has_comet_param() && lp.comet_param().has_error_bound();
  CometPlanBound bd;
  bd.rule = rule;
  bd.layer = lp.name();
  bd.layer_id = i;
  bd.fixed = own || param.eb_mode() == CometParameter_ErrorBoundMode_FIXED;
  bd.eb = own ? lp.comet_param().error_bound() : param.error_bound();
  CHECK_GT(bd.eb, 0) << "comet_param.error_bound of " << lp.name() << " must be > 0";
  bd.measurable = rule != CometPlanBound::WEIGHT_GRADIENT || plan->facts[i].adaptive;
  bd.adapt = !bd.fixed && bd.measurable;
  bd.follow = -1;
  plan->bound_of_layer[i] = plan->bounds.size();
  plan->bounds.push_back(bd);
  return plan->bound_of_layer[i];
}

// The rule that bounds the error a lossy read by a layer with these facts causes.
CometPlanBound::Rule RuleOf(const CometLayerFacts& f) {
  if (f.private_buffer == CometLayerFacts::LRN_SCALE ||
      f.private_buffer == CometLayerFacts::LRN_WITHIN) {
    return CometPlanBound::LRN;
  }
  if (f.derivative != CometLayerFacts::NO_DERIVATIVE) return CometPlanBound::DERIVATIVE;
  return CometPlanBound::WEIGHT_GRADIENT;
}

// Whether layer i may store its input (or, for BatchNorm, its x_norm_) lossy.
bool LossyAllowed(const LayerParameter& lp, const std::set<std::string>& lossy_types) {
  return lossy_types.count(lp.type()) && (!lp.has_comet_param() || lp.comet_param().compress());
}

}  // namespace

template <typename Dtype>
int CometLastWriter(const Net<Dtype>& net, int blob, int before) {
  for (int j = before - 1; j >= 0; --j) {
    const std::vector<int>& tops = net.top_ids(j);
    if (std::find(tops.begin(), tops.end(), blob) != tops.end()) return j;
  }
  return -1;
}

template <typename Dtype>
int CometWriterBelow(const Net<Dtype>& net, int i, const std::function<bool(int)>& through) {
  int j = CometLastWriter(net, net.bottom_ids(i)[0], i);
  while (j >= 0 && !net.bottom_ids(j).empty() && through(j))
    j = CometLastWriter(net, net.bottom_ids(j)[0], j);
  return j;
}

namespace {

// Whether layer i's first input has runs of one value, for its x_norm_ to hold them too: written by
// a ReLU (its zeros), through Splits, poolings, Reshapes and Flattens, which keep them.
template <typename Dtype>
bool InputHasTies(const Net<Dtype>& net, int i) {
  const std::set<std::string> keep = {"Split", "Pooling", "Reshape", "Flatten"};
  const int j =
      CometWriterBelow(net, i, [&](int k) { return keep.count(net.layers()[k]->type()) > 0; });
  if (j < 0) return false;
  const LayerParameter& lp = net.layers()[j]->layer_param();
  return lp.type() == "ReLU" && lp.relu_param().negative_slope() == 0;
}

}  // namespace

template <typename Dtype>
CometPlan MakeCometPlan(const Net<Dtype>& net, const CometParameter& param,
                        const CometAliases& data_aliases, const CometAliases& diff_aliases) {
  CometPlan plan;
  const int L = net.layers().size();
  const int B = net.blobs().size();
  for (int i = 0; i < L; ++i) {
    plan.facts.push_back(CometFactsRegistry<Dtype>::Of(*net.layers()[i], net.bottom_vecs()[i],
                                                       net.top_vecs()[i]));
  }
  std::set<std::string> lossy_types;
  for (int i = 0; i < param.compress_type_size(); ++i) lossy_types.insert(param.compress_type(i));
  if (lossy_types.empty()) {
    lossy_types.insert("Swish");
    lossy_types.insert("Convolution");
    lossy_types.insert("InnerProduct");
    lossy_types.insert("LRN");
    lossy_types.insert("BatchNorm");
    lossy_types.insert("Sigmoid");
    lossy_types.insert("TanH");
    lossy_types.insert("PReLU");
    lossy_types.insert("ELU");
    lossy_types.insert("Exp");
    lossy_types.insert("Softmax");
    lossy_types.insert("Deconvolution");
    lossy_types.insert("Scale");
  }

  // Blobs whose data the store never touches: what callers read or set from outside (inputs,
  // outputs, losses whose diff holds the weight), the tops of source layers (some write them
  // once at setup: constant DummyData, Parameter's learnable blob), and every blob of a layer
  // whose class has no fact row (a Python layer may keep pointers into them).
  std::vector<bool> protect(B, false);
  for (int i = 0; i < net.input_blob_indices().size(); ++i)
    protect[net.input_blob_indices()[i]] = true;
  for (int i = 0; i < net.output_blob_indices().size(); ++i)
    protect[net.output_blob_indices()[i]] = true;
  for (int b = 0; b < B; ++b)
    if (net.blob_loss_weights()[b] != Dtype(0)) protect[b] = true;
  for (int i = 0; i < L; ++i) {
    const bool source = net.bottom_ids(i).empty();
    const bool unknown = !plan.facts[i].known;
    if (!source && !unknown) continue;
    for (int k = 0; k < net.top_ids(i).size(); ++k) protect[net.top_ids(i)[k]] = true;
    if (!unknown) continue;
    for (int k = 0; k < net.bottom_ids(i).size(); ++k) protect[net.bottom_ids(i)[k]] = true;
    plan.notes.push_back("layer " + net.layer_names()[i] + " (" + net.layers()[i]->type() +
                         "): no COMET fact row for its class; its blobs stay dense");
  }

  // Fine-tuning's trap: Net decides whether a layer runs a backward from the prototxt's
  // ParamSpecs, and counts a missing one as lr_mult 1, while BatchNorm gives its three
  // statistics lr_mult 0 only in its own copy. Behind frozen layers such a BatchNorm runs a
  // backward for nothing, and so does every layer after it: their blobs are kept for it.
  for (int i = 0; i < L; ++i) {
    const Layer<Dtype>& layer = *net.layers()[i];
    if (layer.type() != std::string("BatchNorm") || !net.layer_need_backward()[i]) continue;
    bool learns = false;
    for (int k = 0; k < net.bottom_need_backward()[i].size(); ++k)
      learns = learns || net.bottom_need_backward()[i][k];
    for (int k = 0; k < layer.layer_param().param_size(); ++k)
      learns = learns || layer.layer_param().param(k).lr_mult() != 0;
    if (learns) continue;
    plan.notes.push_back("layer " + net.layer_names()[i] + " (BatchNorm) runs a backward although "
                         "nothing below it learns: Net counts its statistics as learnable (lr_mult "
                         "1) without `param { lr_mult: 0 }` lines in the prototxt, one for each of "
                         "the three, and every layer after it runs a backward too; give it the "
                         "three lines to freeze it");
  }

  int G = 0, GD = 0;
  plan.data_group = MemoryGroups(net, plan.facts, false, data_aliases, &G);
  plan.diff_group = MemoryGroups(net, plan.facts, true, diff_aliases, &GD);
  const std::vector<int>& group = plan.data_group;
  std::vector<std::vector<int> > members(G);
  for (int b = 0; b < B; ++b) members[group[b]].push_back(b);

  std::vector<int> last_fwd(G, -1), last_bwd(G, L);
  std::vector<bool> prot(G, false), sign_only(G, true), any_sign(G, false), lossy_ok(G, true),
      lossy_reader(G, false);
  std::vector<std::vector<int> > readers(G);
  plan.bound_of_layer.assign(L, -1);
  plan.tops_written.assign(L, std::vector<int>());
  for (int b = 0; b < B; ++b) if (protect[b]) prot[group[b]] = true;

  for (int i = 0; i < L; ++i) {
    const CometLayerFacts& f = plan.facts[i];
    const LayerParameter& lp = net.layers()[i]->layer_param();
    const bool runs_backward = net.layer_need_backward()[i];
    const bool layer_lossy = f.lossy_input && LossyAllowed(lp, lossy_types);
    for (int side = 0; side < 2; ++side) {
      const std::vector<int>& ids = side == 0 ? net.bottom_ids(i) : net.top_ids(i);
      for (int k = 0; k < ids.size(); ++k) {
        const int g = group[ids[k]];
        const CometRead read = side == 0 ? f.read_bottom(k) : f.read_top(k);
        last_fwd[g] = std::max(last_fwd[g], i);
        if (!runs_backward || read == COMET_READS_NOTHING) continue;
        readers[g].push_back(i);
        last_bwd[g] = std::min(last_bwd[g], i);
        // Only ReLU's backward is served from a sign mask (the store computes it); any other
        // layer that asks a sign reads the blob's memory, which must then hold values with
        // exact signs (ELU with alpha < 0): it keeps the blob from being a mask alone.
        if (read != COMET_READS_SIGN || !(f.relu_from_mask && param.relu_masks()))
          sign_only[g] = false;
        if (read == COMET_READS_SIGN || f.exact_sign) any_sign[g] = true;
        const bool strict = !layer_lossy || (side == 0 && k == f.exact_bottom);
        if (read == COMET_READS_VALUE && strict) lossy_ok[g] = false;
        if (read == COMET_READS_VALUE && !strict) lossy_reader[g] = true;
      }
    }
    const std::vector<int>& tops = net.top_ids(i);
    const std::vector<int>& bottoms = net.bottom_ids(i);
    for (int k = 0; k < tops.size(); ++k) {
      bool shared = false;
      for (int j = 0; j < bottoms.size(); ++j)
        if (group[bottoms[j]] == group[tops[k]]) shared = true;
      if (!shared) plan.tops_written[i].push_back(tops[k]);
    }
  }

  plan.after_forward.assign(L, std::vector<int>());
  plan.after_backward.assign(L, std::vector<int>());
  plan.entry_of_blob.assign(B, -1);
  for (int g = 0; g < G; ++g) {
    if (prot[g] || last_fwd[g] < 0) continue;
    CometPlanEntry e;
    e.blob = net.blob_names()[members[g][0]];
    e.blob_ids = members[g];
    e.last_forward = last_fwd[g];
    e.last_backward = readers[g].empty() ? -1 : last_bwd[g];
    if (readers[g].empty()) {
      if (!param.release_unused()) continue;
      e.action = CometActions::RELEASE;
      e.name = e.blob;
    } else if (sign_only[g]) {
      e.action = CometActions::MASK;
      e.name = net.layer_names()[readers[g][0]];
    } else if (lossy_ok[g] && lossy_reader[g]) {  // without a lossy reader: signs alone, dense
      e.action = CometActions::LOSSY;
      e.signs = any_sign[g];
      std::set<int> seen;
      for (int r = 0; r < readers[g].size(); ++r) {
        const int i = readers[g][r];
        if (!seen.insert(i).second || plan.facts[i].relu_from_mask) continue;  // sign mask
        if (!e.name.empty()) e.name += "+";
        e.name += net.layer_names()[i];
        e.eb_layers.push_back(BoundOf(&plan, net, param, i, RuleOf(plan.facts[i])));
      }
    } else {
      continue;  // KEEP: some reader needs it exactly
    }
    for (int k = 0; k < e.blob_ids.size(); ++k) plan.entry_of_blob[e.blob_ids[k]] = plan.entries.size();
    plan.after_forward[e.last_forward].push_back(plan.entries.size());
    if (e.last_backward >= 0) plan.after_backward[e.last_backward].push_back(plan.entries.size());
    plan.entries.push_back(e);
  }
  // An LRN bound follows, in ADAPTIVE mode, the weight-gradient bound of a layer that reads the
  // same stored blob, or LRN's output (norm1 -> conv2 in CaffeNet; LRN's CPU backward reads its
  // input only, patch 0027); without one (GoogLeNet's norm2, followed by max pooling) its own
  // rule sets it.
  const auto adaptive_in = [&plan](const std::vector<int>& ls) {  // the last one, or -1
    int adaptive = -1;
    for (int k = 0; k < ls.size(); ++k) {
      const CometPlanBound& bd = plan.bounds[ls[k]];
      if (bd.adapt && bd.rule == CometPlanBound::WEIGHT_GRADIENT) adaptive = ls[k];
    }
    return adaptive;
  };
  for (int e = 0; e < plan.entries.size(); ++e) {
    const std::vector<int>& ls = plan.entries[e].eb_layers;
    for (int k = 0; k < ls.size(); ++k) {
      CometPlanBound& lrn = plan.bounds[ls[k]];
      if (lrn.rule != CometPlanBound::LRN || lrn.fixed || lrn.follow >= 0) continue;
      lrn.follow = adaptive_in(ls);
      const int out = plan.entry_of_blob[net.top_ids(lrn.layer_id)[0]];
      if (lrn.follow < 0 && out >= 0) lrn.follow = adaptive_in(plan.entries[out].eb_layers);
    }
  }

  // Layer-private buffers that only the layer's own backward reads. A layer that runs no
  // backward (frozen: below every learning layer, or behind propagate_down: false) reads them in
  // its forward only, and they are freed after it (with release_unused), as its blobs are; without
  // this a net fine-tuned with its lower layers frozen kept them all, dense, through the step.
  plan.private_of_layer.assign(L, std::vector<int>());
  plan.lossy_x_norm.assign(L, -1);
  plan.x_norm_ties.assign(L, false);
  std::vector<int> global_x_norms;  // entries of x_norm_ of BatchNorms with global statistics
  for (int i = 0; i < L && param.layer_buffers(); ++i) {
    const bool runs_backward = net.layer_need_backward()[i];
    if (!runs_backward && !param.release_unused()) continue;
    CometPlanEntry e;
    e.layer = i;
    e.name = net.layer_names()[i];
    switch (plan.facts[i].private_buffer) {
      case CometLayerFacts::MAX_ARGMAX: e.action = CometActions::ARGMAX; e.blob = e.name + " argmax"; break;
      case CometLayerFacts::DROPOUT_MASK: e.action = CometActions::BINARY; e.blob = e.name + " mask"; break;
      case CometLayerFacts::LRN_SCALE: e.action = CometActions::RECOMPUTE; e.blob = e.name + " scale"; break;
      case CometLayerFacts::LRN_WITHIN:  // named below
        e.action = CometActions::RECOMPUTE;
        e.unread = plan.facts[i].lrn_from_input;
        break;
      case CometLayerFacts::SWISH_SIGMOID: e.action = CometActions::RECOMPUTE; e.unread = true; break;
      case CometLayerFacts::BN_TEMP: e.action = CometActions::REBUILD; e.blob = e.name + " temp"; break;
      case CometLayerFacts::MVN_TEMP:
        e.action = CometActions::REBUILD;
        e.blob = e.name + " temp";
        e.unread = true;
        break;
      case CometLayerFacts::SCALE_COPY: {
        // In place, Scale copies its input: when BatchNorm wrote it (no layer in between), the
        // copy is bit for bit BatchNorm's x_norm_, which lives until BatchNorm's backward.
        const int b = net.top_ids(i)[0];
        int writer = -1;
        for (int j = i - 1; j >= 0 && writer < 0; --j) {
          const std::vector<int>& tops = net.top_ids(j);
          if (std::find(tops.begin(), tops.end(), b) != tops.end()) writer = j;
        }
        e.action = CometActions::REBUILD;
        e.blob = e.name + " copy";
        if (!runs_backward) break;  // freed after its forward, whoever wrote its input
        if (writer < 0 || plan.facts[writer].private_buffer != CometLayerFacts::BN_TEMP) continue;
        e.source = writer;
        break;
      }
      case CometLayerFacts::PRELU_COPY: {
        // In-place PReLU's copy of its input: lossy with its signs exact, under PReLU's weight
        // rule (its slope's gradient), or kept dense and counted.
        e.blob = e.name + " copy";
        e.action = CometActions::KEEP;
        if (!runs_backward || !LossyAllowed(net.layers()[i]->layer_param(), lossy_types)) break;
        e.action = CometActions::LOSSY;
        e.signs = true;
        e.eb_layers.push_back(BoundOf(&plan, net, param, i, CometPlanBound::WEIGHT_GRADIENT));
        break;
      }
      case CometLayerFacts::SWISH_IN_PLACE:
        // In-place Swish's sigmoid input (beta x, which its backward reads: patch 0038): lossy
        // under the derivative rule, or kept dense and counted; its output, unread, below.
        e.blob = e.name + " sigmoid_input";
        e.action = CometActions::KEEP;
        if (!runs_backward || !LossyAllowed(net.layers()[i]->layer_param(), lossy_types)) break;
        e.action = CometActions::LOSSY;
        e.eb_layers.push_back(BoundOf(&plan, net, param, i, CometPlanBound::DERIVATIVE));
        break;
      default: continue;
    }
    e.buffer = e.action;
    if (!runs_backward) e.action = CometActions::RELEASE;
    e.last_forward = i;
    e.last_backward = runs_backward ? i : -1;
    // LRN within a channel: its internal layers' outputs, one entry each; Swish: its sigmoid's
    // input and output, never read after the forward (in place: its output).
    const char* within[] = {" squares", " means", " scale"};  // of x^2 over the windows; s^-beta
    const char* swish[] = {" sigmoid_input", " sigmoid_output"};  // one word: cometctl plan
    const bool lrn_within = plan.facts[i].private_buffer == CometLayerFacts::LRN_WITHIN;
    const bool sigmoids = plan.facts[i].private_buffer == CometLayerFacts::SWISH_SIGMOID;
    const bool swish_in_place = plan.facts[i].private_buffer == CometLayerFacts::SWISH_IN_PLACE;
    for (int part = 0; part < (lrn_within ? 3 : sigmoids || swish_in_place ? 2 : 1); ++part) {
      if (lrn_within) e.blob = e.name + within[part];
      if (sigmoids) e.blob = e.name + swish[part];
      if (swish_in_place && part == 1) {
        e.blob = e.name + swish[1];
        e.buffer = CometActions::RECOMPUTE;
        e.action = runs_backward ? CometActions::RECOMPUTE : CometActions::RELEASE;
        e.eb_layers.clear();
        e.unread = true;
      }
      e.part = part;
      plan.private_of_layer[i].push_back(plan.entries.size());
      plan.after_forward[i].push_back(plan.entries.size());
      if (runs_backward) plan.after_backward[i].push_back(plan.entries.size());
      plan.entries.push_back(e);
    }
    if (plan.facts[i].private_buffer == CometLayerFacts::BN_TEMP) {
      // BatchNorm's x_norm_, a copy of its output that its backward reads (and an in-place Scale
      // after it, through the copy rebuilt from it): lossy at the tighter of BatchNorm's own bound
      // and that Scale's; else kept dense, listed so that the layer-buffer figures count it. With
      // global statistics, decided below; without a backward, released like temp_.
      const LayerParameter& lp = net.layers()[i]->layer_param();
      const bool global = lp.batch_norm_param().has_use_global_stats()
                              ? lp.batch_norm_param().use_global_stats()
                              : net.phase() == TEST;
      e.blob = e.name + " x_norm";
      e.buffer = CometActions::KEEP;
      if (runs_backward && !global && LossyAllowed(lp, lossy_types)) {
        e.action = CometActions::LOSSY;
        e.eb_layers.push_back(BoundOf(&plan, net, param, i, CometPlanBound::BATCHNORM));
        plan.after_backward[i].push_back(plan.entries.size());
        plan.lossy_x_norm[i] = plan.entries.size();
        plan.x_norm_ties[i] = InputHasTies(net, i);
      } else if (runs_backward) {
        e.action = CometActions::KEEP;
        if (global) global_x_norms.push_back(plan.entries.size());
      }  // without a backward: RELEASE, as temp_'s entry
      plan.private_of_layer[i].push_back(plan.entries.size());
      plan.after_forward[i].push_back(plan.entries.size());
      plan.entries.push_back(e);
    }
  }
  // With global statistics (use_global_stats: fine-tuning with frozen statistics) BatchNorm's
  // backward divides by the deviation (temp_) and never reads x_norm_: only an in-place Scale
  // whose copy is rebuilt from it does, and then it is stored lossy at that Scale's bound (the
  // join below); with none, nobody reads it after the forward. Kept dense until 2026-12-06.
  for (int k = 0; k < global_x_norms.size(); ++k) {
    CometPlanEntry& xn = plan.entries[global_x_norms[k]];
    bool copied = false;
    for (int c = 0; c < plan.entries.size(); ++c)
      copied = copied || (plan.entries[c].action == CometActions::REBUILD &&
                          plan.entries[c].source == xn.layer);
    if (copied && LossyAllowed(net.layers()[xn.layer]->layer_param(), lossy_types)) {
      xn.action = CometActions::LOSSY;
      plan.after_backward[xn.layer].push_back(global_x_norms[k]);
    } else if (!copied && param.release_unused()) {
      xn.action = CometActions::RELEASE;
      xn.last_backward = -1;
    }
  }
  // A Scale whose copy is rebuilt from a lossy x_norm_ reads it too: its bound joins the entry.
  for (int e = 0; e < plan.entries.size(); ++e) {
    const CometPlanEntry& copy = plan.entries[e];
    if (copy.action != CometActions::REBUILD || copy.source < 0) continue;
    for (int x = 0; x < plan.entries.size(); ++x) {
      CometPlanEntry& xn = plan.entries[x];
      if (xn.layer != copy.source || xn.action != CometActions::LOSSY) continue;
      const CometParameter& p = param;
      xn.eb_layers.push_back(BoundOf(&plan, net, p, copy.layer, CometPlanBound::WEIGHT_GRADIENT));
      xn.name += "+" + net.layer_names()[copy.layer];
    }
  }

  // A lossy conv input that an in-place Scale (with ReLU in place after it, or not) made from
  // BatchNorm's output: on the CPU it is rebuilt from that BatchNorm's lossy x_norm_ instead of
  // being stored a second time (ResNet's branch2b inputs). The blob's last writers must be exactly
  // BatchNorm, that Scale (per channel, its copy rebuilt from BatchNorm) and the ReLU.
  for (int x = 0; x < plan.entries.size() && param.rebuild_from_batchnorm(); ++x) {
    CometPlanEntry& e = plan.entries[x];
    if (e.layer >= 0 || e.action != CometActions::LOSSY) continue;
    const std::set<int> ids(e.blob_ids.begin(), e.blob_ids.end());
    std::vector<int> writers;  // layers that write the blob's memory, in forward order
    for (int i = 0; i <= e.last_forward; ++i) {
      const std::vector<int>& tops = net.top_ids(i);
      const std::vector<int>& shares = plan.facts[i].top_data_of;
      for (int k = 0; k < tops.size(); ++k) {
        if (!ids.count(tops[k]) || (k < shares.size() && shares[k] >= 0)) continue;
        writers.push_back(i);
        break;
      }
    }
    int n = writers.size(), relu = -1;
    if (n && net.layers()[writers[n - 1]]->type() == std::string("ReLU")) relu = writers[--n];
    if (n < 2 || (relu >= 0) != e.signs) continue;  // the sign mask is ReLU's, and only ReLU's
    if (relu >= 0 && net.layers()[relu]->layer_param().relu_param().negative_slope() < 0) continue;
    const int scale = writers[n - 1], bn = writers[n - 2];
    const ScaleParameter& sp = net.layers()[scale]->layer_param().scale_param();
    if (net.layers()[scale]->type() != std::string("Scale") || net.bottom_ids(scale).size() != 1 ||
        sp.axis() != 1 || sp.num_axes() != 1) {
      continue;
    }
    int copy = -1, xn = -1;
    for (int c = 0; c < plan.entries.size(); ++c) {
      const CometPlanEntry& o = plan.entries[c];
      if (o.layer == scale && o.action == CometActions::REBUILD && o.source == bn) copy = c;
      if (o.layer == bn && o.action == CometActions::LOSSY && o.rebuilds < 0) xn = c;
    }
    if (copy < 0 || xn < 0) continue;
    e.rebuild_from = xn;
    e.rebuild_scale = scale;
    e.rebuild_relu = relu;
    plan.entries[xn].rebuilds = x;
  }

  // Activation diffs: freed after the last layer whose backward touches them. Only diffs that a
  // backward writes: one nobody writes (a Split top feeding Accuracy) holds zeros that the next
  // step reads again, and freeing it would lose them.
  plan.diff_release.assign(L, std::vector<int>());
  if (param.release_diffs()) {
    std::vector<bool> dprot(GD, false), written(GD, false);
    std::vector<int> last_use(GD, L);
    for (int b = 0; b < B; ++b) if (protect[b]) dprot[plan.diff_group[b]] = true;
    for (int i = 0; i < L; ++i) {
      if (!net.layer_need_backward()[i]) continue;
      for (int k = 0; k < net.bottom_ids(i).size(); ++k)
        if (net.bottom_need_backward()[i][k]) written[plan.diff_group[net.bottom_ids(i)[k]]] = true;
      for (int side = 0; side < 2; ++side) {
        const std::vector<int>& ids = side == 0 ? net.bottom_ids(i) : net.top_ids(i);
        for (int k = 0; k < ids.size(); ++k) {
          const int d = plan.diff_group[ids[k]];
          last_use[d] = std::min(last_use[d], i);
        }
      }
    }
    std::set<int> done;
    for (int b = 0; b < B; ++b) {
      const int d = plan.diff_group[b];
      if (dprot[d] || !written[d] || last_use[d] >= L || !done.insert(d).second) continue;
      plan.diff_release[last_use[d]].push_back(b);
    }
  }

  // What each backward decodes (comet { decode_ahead } starts it one layer early): lossy blobs
  // read for their values (a ReLU served from the sign mask decodes nothing), packed codes, and
  // x_norm_ for BatchNorm and for the Scale whose copy is rebuilt from it.
  plan.backward_reads.assign(L, std::vector<int>());
  for (int x = 0; x < plan.entries.size(); ++x) {
    const CometPlanEntry& e = plan.entries[x];
    std::set<int> readers;
    if (e.layer >= 0) {
      if (e.action != CometActions::LOSSY && e.action != CometActions::ARGMAX &&
          e.action != CometActions::BINARY) continue;
      readers.insert(e.layer);
      for (int c = 0; c < plan.entries.size() && e.action == CometActions::LOSSY; ++c)
        if (plan.entries[c].action == CometActions::REBUILD && plan.entries[c].source == e.layer)
          readers.insert(plan.entries[c].layer);
    } else if (e.action == CometActions::LOSSY) {
      const std::set<int> ids(e.blob_ids.begin(), e.blob_ids.end());
      for (int i = 0; i < L; ++i) {
        if (!net.layer_need_backward()[i]) continue;
        const CometLayerFacts& f = plan.facts[i];
        for (int side = 0; side < 2; ++side) {
          const std::vector<int>& blobs = side == 0 ? net.bottom_ids(i) : net.top_ids(i);
          for (int k = 0; k < blobs.size(); ++k) {
            if (!ids.count(blobs[k])) continue;
            const CometRead read = side == 0 ? f.read_bottom(k) : f.read_top(k);
            if (read == COMET_READS_VALUE ||
                (read == COMET_READS_SIGN && !(f.relu_from_mask && param.relu_masks())))
              readers.insert(i);
          }
        }
      }
    }
    for (std::set<int>::const_iterator i = readers.begin(); i != readers.end(); ++i)
      plan.backward_reads[*i].push_back(x);
  }
  return plan;
}

template <typename Dtype>
std::string DescribeCometPlan(const CometPlan& plan, const Net<Dtype>& net,
                              const CometParameter& param) {
  std::ostringstream os;
  for (int e = 0; e < plan.entries.size(); ++e) {
    const CometPlanEntry& en = plan.entries[e];
    os << "COMET plan: blob " << en.blob << " -> ";
    if (en.action == CometActions::KEEP) {
      os << "kept dense (" << en.name << " backward reads it)";
    } else if (en.action == CometActions::REBUILD && en.unread) {
      os << "freed after " << en.name << " forward, not read: " << en.name
         << "'s backward writes it anew";
    } else if (en.action == CometActions::REBUILD) {
      os << "freed after " << en.name << " forward, rebuilt before its backward";
      if (en.source >= 0) os << " from " << net.layer_names()[en.source] << "'s output";
    } else if (en.action == CometActions::RECOMPUTE && en.unread &&
               (plan.facts[en.layer].private_buffer == CometLayerFacts::SWISH_SIGMOID ||
                plan.facts[en.layer].private_buffer == CometLayerFacts::SWISH_IN_PLACE)) {
      os << "freed after " << en.name << " forward, not read: " << en.name
         << "'s backward works from its "
         << (plan.facts[en.layer].private_buffer == CometLayerFacts::SWISH_IN_PLACE
                 ? "sigmoid's input" : "input");
    } else if (en.action == CometActions::RECOMPUTE && en.unread) {
      os << "freed after " << en.name << " forward, not read: the store computes " << en.name
         << "'s backward from its input";
    } else if (en.action == CometActions::RECOMPUTE && !param.recompute_lrn()) {
      os << "freed after " << en.name << " backward";
    } else if (en.action == CometActions::RECOMPUTE) {
      os << "freed after " << en.name << " forward, recomputed before its backward";
    } else {
      os << CometActions::ActionName(en.action) << " after "
         << net.layer_names()[en.last_forward] << " forward";
    }
    if (en.action == CometActions::LOSSY || en.action == CometActions::MASK)
      os << ", for " << en.name << " backward";
    if (en.signs) os << " (+ sign mask)";
    if (en.rebuild_from >= 0) {
      os << "; on the CPU rebuilt from " << plan.entries[en.rebuild_from].blob << " through "
         << net.layer_names()[en.rebuild_scale];
      if (en.rebuild_relu >= 0) os << " and " << net.layer_names()[en.rebuild_relu];
      os << " instead";
    }
    os << "\n";
  }
  for (int n = 0; n < plan.notes.size(); ++n) os << "COMET plan: " << plan.notes[n] << "\n";
  std::string s = os.str();
  if (!s.empty()) s.erase(s.size() - 1);
  return s;
}

template CometPlan MakeCometPlan<float>(const Net<float>&, const CometParameter&,
                                        const CometAliases&, const CometAliases&);
template CometPlan MakeCometPlan<double>(const Net<double>&, const CometParameter&,
                                         const CometAliases&, const CometAliases&);
template int CometLastWriter<float>(const Net<float>&, int, int);
template int CometLastWriter<double>(const Net<double>&, int, int);
template int CometWriterBelow<float>(const Net<float>&, int, const std::function<bool(int)>&);
template int CometWriterBelow<double>(const Net<double>&, int, const std::function<bool(int)>&);
template std::string DescribeCometPlan<float>(const CometPlan&, const Net<float>&,
                                              const CometParameter&);
template std::string DescribeCometPlan<double>(const CometPlan&, const Net<double>&,
                                               const CometParameter&);

}  // namespace caffe
