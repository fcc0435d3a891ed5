// COMET-Caffe: the activation store (see include/caffe/comet/store.hpp and docs/comet.md).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "caffe/comet/layer_access.hpp"
#include "caffe/comet/store.hpp"
#include "caffe/layer_factory.hpp"
#include "caffe/util/benchmark.hpp"
#include "caffe/util/io.hpp"
#include "caffe/util/math_functions.hpp"

namespace caffe {


// Forwards one of Net's four per-layer callbacks to the store.
template <typename Dtype>
class CometStore<Dtype>::Hook : public Net<Dtype>::Callback {
 public:
  enum When { BEFORE_FORWARD, AFTER_FORWARD, BEFORE_BACKWARD, AFTER_BACKWARD };
  Hook(CometStore<Dtype>* store, When when) : store_(store), when_(when) {}

 protected:
  virtual void run(int layer) {
    switch (when_) {
      case BEFORE_FORWARD: store_->BeforeForward(layer); break;
      case AFTER_FORWARD: store_->AfterForward(layer); break;
      case BEFORE_BACKWARD: store_->BeforeBackward(layer); break;
      case AFTER_BACKWARD: store_->AfterBackward(layer); break;
    }
  }

 private:
  CometStore<Dtype>* store_;
  When when_;
};

namespace {


bool OnDevice(const SyncedMemory* mem) {
  return Caffe::mode() == Caffe::GPU &&
         (mem->head() == SyncedMemory::HEAD_AT_GPU || mem->head() == SyncedMemory::SYNCED);
}

}  // namespace

template <typename Dtype>
shared_ptr<CometStore<Dtype> > CometStore<Dtype>::Attach(Solver<Dtype>* solver) {
  const SolverParameter& sp = solver->param();
  if (!sp.has_comet() || !sp.comet().enabled()) return shared_ptr<CometStore<Dtype> >();
  if (sizeof(Dtype) != sizeof(float)) {
    LOG(WARNING) << "COMET: only float nets are compressed; this double solver runs without";
    return shared_ptr<CometStore<Dtype> >();
  }
  return shared_ptr<CometStore<Dtype> >(new CometStore<Dtype>(solver, sp.comet()));
}

namespace {

// Settings that would do nothing or fail late are refused before training starts, each with
// the field's name.
template <typename Dtype>
void CheckSettings(const CometParameter& p, const Net<Dtype>& net) {
  struct Positive { const char* field; double value; } positive[] = {
      {"error_bound", p.error_bound()}, {"min_error_bound", p.min_error_bound()},
      {"max_error_bound", p.max_error_bound()}, {"adaptive_target", p.adaptive_target()}};
  for (int i = 0; i < 4; ++i) {
    if (!(positive[i].value > 0) || !std::isfinite(positive[i].value))
      CometFatal(std::string("comet.") + positive[i].field + " must be a finite number > 0 (got " +
                 CometNum(positive[i].value) + ")");
  }
  if (p.min_error_bound() > p.max_error_bound())
    CometFatal("comet.min_error_bound (" + CometNum(p.min_error_bound()) + ") exceeds "
               "comet.max_error_bound (" + CometNum(p.max_error_bound()) + ")");
  if (p.eb_mode() == CometParameter_ErrorBoundMode_ADAPTIVE && p.update_interval() <= 0)
    CometFatal("comet.update_interval must be > 0 with eb_mode ADAPTIVE (got " +
               CometNum(p.update_interval()) + "): the bounds would never adapt; use eb_mode FIXED");
  if (!(p.memory_pool_headroom() >= 0) || !std::isfinite(p.memory_pool_headroom()))
    CometFatal("comet.memory_pool_headroom must be a finite number >= 0 (got " +
               CometNum(p.memory_pool_headroom()) + ")");
  const std::vector<std::string> types = LayerRegistry<Dtype>::LayerTypeList();
  for (int i = 0; i < p.compress_type_size(); ++i) {
    const std::string& t = p.compress_type(i);
    if (t != "None" && std::find(types.begin(), types.end(), t) == types.end())
      CometFatal("comet.compress_type '" + t + "' is not a layer type of this build ('None' "
                 "stores nothing lossy)");
  }
  for (int i = 0; i < net.layers().size(); ++i) {
    const LayerParameter& lp = net.layers()[i]->layer_param();
    if (lp.has_comet_param() && lp.comet_param().has_error_bound()) {
      const double eb = lp.comet_param().error_bound();
      if (!(eb > 0) || !std::isfinite(eb))
        CometFatal("comet_param.error_bound of layer " + lp.name() + " must be a finite "
                   "number > 0 (got " + CometNum(eb) + ")");
    }
  }
}

}  // namespace

template <typename Dtype>
CometStore<Dtype>::CometStore(Solver<Dtype>* solver, const CometParameter& param)
    : solver_(solver), net_(solver->net().get()), param_(param), bounds_(net_, param_),
      stats_(net_, param_), context_layer_(-1), context_iter_(-1),
      context_pass_("before the first training step"), measuring_(false) {
  CheckSettings(param_, *net_);
  relu_skipped_.assign(net_->layers().size(), false);
  MakePlan();
  reader_.reset(new Reader(this));
  CometSetReadContext(reader_.get());
  typedef typename CometStore<Dtype>::Hook H;
  hooks_.push_back(shared_ptr<H>(new H(this, H::BEFORE_FORWARD)));
  hooks_.push_back(shared_ptr<H>(new H(this, H::AFTER_FORWARD)));
  hooks_.push_back(shared_ptr<H>(new H(this, H::BEFORE_BACKWARD)));
  hooks_.push_back(shared_ptr<H>(new H(this, H::AFTER_BACKWARD)));
  net_->add_before_forward(hooks_[0].get());
  net_->add_after_forward(hooks_[1].get());
  net_->add_before_backward(hooks_[2].get());
  net_->add_after_backward(hooks_[3].get());
  solver_->add_callback(this);
  if (param_.memory_pool()) {
    CometHostPoolEnable(true);
    CometGpuPoolEnable(true);
    CometPoolsSetHeadroom(param_.memory_pool_headroom());
  }

  std::string stats_path = param_.stats_file();
  if (stats_path.empty() && solver->param().has_snapshot_prefix())
    stats_path = solver->param().snapshot_prefix() + "_comet.csv";
  stats_.set_path(stats_path);
  if (Caffe::root_solver()) {
    LOG(INFO) << "COMET: activation store on; error bounds "
              << (param_.eb_mode() == CometParameter_ErrorBoundMode_ADAPTIVE ? "ADAPTIVE"
                                                                             : "FIXED")
              << ", start " << param_.error_bound();
    std::istringstream plan(Plan());
    for (std::string line; std::getline(plan, line);) LOG(INFO) << line;
  }
}

template <typename Dtype>
CometStore<Dtype>::~CometStore() {
  // A describer left behind would point into this store (another store's goes too: harmless)
  CometSetReadContext("outside a COMET training step");
  if (param_.memory_pool()) {
    CometHostPoolEnable(false);
    CometGpuPoolEnable(false);
  }
}

template <typename Dtype>
void CometStore<Dtype>::MakePlan() {
  plan_ = MakeCometPlan(*net_, param_, data_aliases_, diff_aliases_);
  // What the old plan stored stays with the entry of the same memory; bounds keep their value.
  std::map<std::string, Entry> old;
  for (int e = 0; e < entries_.size(); ++e) old[entries_[e].blob] = entries_[e];
  entries_.clear();
  for (int e = 0; e < plan_.entries.size(); ++e) {
    Entry en(plan_.entries[e]);
    typename std::map<std::string, Entry>::iterator it = old.find(en.blob);
    if (it != old.end() && it->second.action == en.action && it->second.blob_ids == en.blob_ids) {
      const CometPlanEntry planned = plan_.entries[e];
      en = it->second;
      static_cast<CometPlanEntry&>(en) = planned;
    }
    entries_.push_back(en);
  }
  bounds_.Reset(plan_);
}

template <typename Dtype>
void CometStore<Dtype>::CheckSharing(int layer, bool diff) {
  std::map<const SyncedMemory*, int>& seen = diff ? seen_diff_ : seen_data_;
  const std::vector<int>& group = diff ? plan_.diff_group : plan_.data_group;
  for (int side = 0; side < 2; ++side) {
    const std::vector<int>& ids = side == 0 ? net_->bottom_ids(layer) : net_->top_ids(layer);
    for (int k = 0; k < ids.size(); ++k) {
      const int b = ids[k];
      const Blob<Dtype>* blob = net_->blobs()[b].get();
      const SyncedMemory* mem = (diff ? blob->diff() : blob->data()).get();
      if (!mem) continue;
      std::map<const SyncedMemory*, int>::iterator it = seen.find(mem);
      if (it == seen.end()) {
        seen[mem] = b;
      } else if (group[it->second] != group[b]) {
        // Shared memory the plan did not know of (a Python layer's ShareData, a reshape that
        // reused an address): one group from now on, planned again before anything is freed.
        LOG(INFO) << "COMET: blobs '" << net_->blob_names()[it->second] << "' and '"
                  << net_->blob_names()[b] << "' share their " << (diff ? "diff" : "data")
                  << " after layer " << net_->layer_names()[layer] << "; re-planning";
        (diff ? diff_aliases_ : data_aliases_).push_back(std::make_pair(it->second, b));
        MakePlan();
      }
    }
  }
}

template <typename Dtype>
class CometStore<Dtype>::Reader : public CometReadDescriber {
 public:
  explicit Reader(const CometStore<Dtype>* store) : store_(store) {}
  virtual std::string Describe() const {
    const CometStore<Dtype>& s = *store_;
    std::ostringstream os;
    if (s.context_layer_ >= 0) {
      os << "layer '" << s.net_->layer_names()[s.context_layer_] << "' ("
         << s.net_->layers()[s.context_layer_]->type() << ") " << s.context_pass_
         << ", iteration " << s.context_iter_;
    } else if (s.context_iter_ >= 0) {
      os << s.context_pass_ << ", after iteration " << s.context_iter_;
    } else {
      os << s.context_pass_;
    }
    return os.str();
  }

 private:
  const CometStore<Dtype>* store_;
};

template <typename Dtype>
std::string CometStore<Dtype>::Plan() const {
  return DescribeCometPlan(plan_, *net_, param_);
}

template <typename Dtype>
void CometStore<Dtype>::BeforeForward(int layer) {
  SetContext(layer, "forward");
  if (layer == 0) {
    seen_data_.clear();  // memory addresses are checked afresh every step
    seen_diff_.clear();
    if (param_.memory_pool()) CometPoolsMarkStep();
    // A whole forward pass rewrites every stored blob: the compressed copies kept from the last
    // step (for a second backward) go now rather than one by one, so they do not add to the
    // peak of this forward pass.
    for (int i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      if (!e.stored) continue;
      SyncedMemory* mem = EntryMemory(e);
      if (mem->comet_payload() == e.stored) mem->comet_payload().reset();
      e.stored.reset();
    }
  }
  // The forward pass overwrites these tops: a payload left from a forward without backward
  // (pycaffe, an early exit) is dropped rather than decoded for nothing.
  const std::vector<int>& ids = plan_.tops_written[layer];
  for (int k = 0; k < ids.size(); ++k) {
    SyncedMemory* mem = net_->blobs()[ids[k]]->data().get();
    if (mem->comet_payload()) mem->comet_payload().reset();
    if (plan_.entry_of_blob[ids[k]] >= 0) entries_[plan_.entry_of_blob[ids[k]]].stored.reset();
  }
  const std::vector<int>& own = plan_.private_of_layer[layer];
  for (int k = 0; k < own.size(); ++k) {
    Entry& e = entries_[own[k]];
    SyncedMemory* mem = PrivateBuffer(e);
    if (mem->comet_payload()) mem->comet_payload().reset();
    e.stored.reset();
  }
  // Diffs freed after the last step's backward hold nothing a forward may read; a forward that
  // writes one (HingeLoss writes its bottom's diff) starts from fresh memory.
  for (int side = 0; side < 2; ++side) {
    const std::vector<Blob<Dtype>*>& blobs =
        side == 0 ? net_->bottom_vecs()[layer] : net_->top_vecs()[layer];
    for (int k = 0; k < blobs.size(); ++k) {
      SyncedMemory* diff = blobs[k]->diff().get();
      if (diff && diff->comet_payload()) diff->comet_payload().reset();
    }
  }
}

template <typename Dtype>
SyncedMemory* CometStore<Dtype>::PrivateBuffer(const Entry& e) const {
  Layer<Dtype>* layer = net_->layers()[e.layer].get();
  switch (e.action) {
    case ARGMAX: return CometLayerAccess<Dtype>::argmax(layer)->data().get();
    case BINARY: return CometLayerAccess<Dtype>::dropout_mask(layer)->data().get();
    case RECOMPUTE: return CometLayerAccess<Dtype>::lrn_scale(layer)->data().get();
    case REBUILD: return CometLayerAccess<Dtype>::rebuildable(layer)->data().get();
    case KEEP:
    case LOSSY: return CometLayerAccess<Dtype>::bn_x_norm(layer)->data().get();
    default: LOG(FATAL) << "not a layer-private buffer: " << e.blob;
  }
  return NULL;
}

template <typename Dtype>
SyncedMemory* CometStore<Dtype>::EntryMemory(const Entry& e) const {
  return e.layer >= 0 ? PrivateBuffer(e) : net_->blobs()[e.blob_ids[0]]->data().get();
}

// The dense memory goes; the payload holds its content until a reader restores it.
template <typename Dtype>
void CometStore<Dtype>::Hold(Entry* e, SyncedMemory* mem, const shared_ptr<CometPayload>& p) {
  p->timing = e->timing;
  mem->comet_release();
  mem->comet_payload() = p;
  e->stored = p;
  e->dense_bytes += p->dense_bytes();
  e->stored_bytes += p->stored_bytes();
}

// After the owning layer's forward: argmax and Dropout mask as packed codes, LRN's scale freed.
template <typename Dtype>
void CometStore<Dtype>::StorePrivate(Entry* e) {
  SyncedMemory* mem = PrivateBuffer(*e);
  if (!mem->comet_can_release() || mem->comet_payload() ||
      mem->head() == SyncedMemory::UNINITIALIZED) {
    return;
  }
  CPUTimer timer;
  timer.Start();
  const size_t count = mem->size() / sizeof(int32_t);
  shared_ptr<CometPayload> p;
  if (e->action == KEEP) {  // counted, not touched
    e->dense_bytes += mem->size();
    e->stored_bytes += mem->size();
  } else if (e->action == LOSSY) {  // BatchNorm's x_norm_
    const bool dev = OnDevice(mem);
    const float* data = reinterpret_cast<const float*>(dev ? mem->gpu_data() : mem->cpu_data());
    const float eb = bounds_.ForEntry(*e);
    e->eb_sum += eb;
    Blob<Dtype>* x = CometLayerAccess<Dtype>::bn_x_norm(net_->layers()[e->layer].get());
    if (measuring_) bounds_.NoteStoredInput(*e, data, dev, x->shape(), eb);
    p = CometEncodeLossy(data, x->shape(), dev, eb, e->blob);
    Hold(e, mem, p);
  } else if (e->action == RECOMPUTE || e->action == REBUILD) {
    // LRN's scale is kept until LRN's backward and freed after it, unless recompute_lrn.
    if (e->action == RECOMPUTE && !param_.recompute_lrn()) return;
    e->dense_bytes += mem->size();
    mem->comet_release();
  } else {
    const bool dev = OnDevice(mem);
    const void* data = dev ? mem->gpu_data() : mem->cpu_data();
    if (e->action == ARGMAX) {
      p = CometEncodeArgmax(static_cast<const int*>(data), count,
                            CometLayerAccess<Dtype>::geometry(net_->layers()[e->layer].get()),
                            dev, e->blob);
    } else {
      Layer<Dtype>* l = net_->layers()[e->layer].get();
      p = CometEncodeBinary(static_cast<const unsigned int*>(data), count,
                            CometLayerAccess<Dtype>::dropout_rule(l, dev), dev, e->blob);
    }
    if (!p) {
      LOG_FIRST_N(WARNING, 10) << "COMET: " << e->blob << " holds a value its code cannot "
                               << "express (a max over NaN); kept dense this iteration";
      return;
    }
    Hold(e, mem, p);
  }
  e->encode_ms += timer.MilliSeconds();
  e->samples += 1;
}

template <typename Dtype>
void CometStore<Dtype>::AfterForward(int layer) {
  CheckSharing(layer, false);
  const std::vector<int>& todo = plan_.after_forward[layer];
  if (!todo.empty()) {
    Sample();  // with this layer's outputs dense: what the encodes' transients come on top of
    CometTakeTransientPeak();  // what came before was noted where it happened
  }
  for (int t = 0; t < todo.size(); ++t) {
    Entry& e = entries_[todo[t]];
    if (e.layer >= 0) {
      StorePrivate(&e);
      continue;
    }
    Blob<Dtype>* blob = net_->blobs()[e.blob_ids[0]].get();
    SyncedMemory* mem = blob->data().get();
    if (!mem->comet_can_release() || mem->comet_payload() ||
        mem->head() == SyncedMemory::UNINITIALIZED) {
      continue;  // not ours to free (a data layer's prefetch buffer), or nothing there
    }
    if (e.action == RELEASE) {
      CometMarkReleased(mem, "data of blob '" + e.blob + "'");
      continue;
    }
    CPUTimer timer;
    timer.Start();
    const bool dev = OnDevice(mem);
    const float* data = reinterpret_cast<const float*>(dev ? mem->gpu_data() : mem->cpu_data());
    shared_ptr<CometPayload> p;
    if (e.action == LOSSY) {
      const float eb = bounds_.ForEntry(e);
      e.eb_sum += eb;
      if (measuring_) bounds_.NoteStoredInput(e, data, dev, blob->shape(), eb);
      p = CometEncodeLossy(data, blob->shape(), dev, eb, e.blob);
      if (e.signs) {
        p->sign_mask = CometEncodeMask(data, blob->count(), dev, e.blob);
        if (!p->sign_mask) {
          LOG_FIRST_N(WARNING, 10) << "COMET: blob " << e.blob << " holds NaN or Inf; kept "
                                   << "dense this iteration (ReLU needs its exact sign)";
          continue;
        }
      }
    } else {
      p = CometEncodeMask(data, blob->count(), dev, e.blob);
      if (!p) {
        LOG_FIRST_N(WARNING, 10) << "COMET: blob " << e.blob << " holds NaN or Inf; kept dense "
                                 << "this iteration (a sign mask would lose them)";
        continue;
      }
    }
    Hold(&e, mem, p);
    e.encode_ms += timer.MilliSeconds();
    e.samples += 1;
  }
  stats_.NoteTransient(CometTakeTransientPeak());
  Sample();
}

template <typename Dtype>
void CometStore<Dtype>::BeforeBackward(int layer) {
  SetContext(layer, "backward");
  // This backward writes its bottoms' diffs: markers of freed diffs are dropped, not "read".
  const std::vector<Blob<Dtype>*>& bottoms = net_->bottom_vecs()[layer];
  for (int k = 0; k < bottoms.size(); ++k) {
    SyncedMemory* diff = bottoms[k]->diff().get();
    if (diff->comet_payload()) diff->comet_payload().reset();
  }
  const std::vector<int>& own = plan_.private_of_layer[layer];
  for (int k = 0; k < own.size(); ++k) {
    Entry& e = entries_[own[k]];
    if (e.action != RECOMPUTE || PrivateBuffer(e)->head() != SyncedMemory::UNINITIALIZED) continue;
    // LRN's backward reads the scale its forward computed: run the forward again (on the
    // restored input; the output it rewrites is what the backward reads too). Without
    // recompute_lrn this happens only for a second backward after one forward.
    CPUTimer timer;
    timer.Start();
    net_->layers()[layer]->Forward(net_->bottom_vecs()[layer], net_->top_vecs()[layer]);
    e.encode_ms += timer.MilliSeconds();
  }
  for (int k = 0; k < own.size(); ++k) {
    Entry& e = entries_[own[k]];
    if (e.action != REBUILD || PrivateBuffer(e)->head() != SyncedMemory::UNINITIALIZED) continue;
    CPUTimer timer;
    timer.Start();
    Layer<Dtype>* l = net_->layers()[layer].get();
    if (e.source >= 0) CometLayerAccess<Dtype>::RebuildScaleCopy(l, net_->layers()[e.source].get());
    else CometLayerAccess<Dtype>::RebuildBatchNormTemp(l);
    e.timing->decode_ms += timer.MilliSeconds();
  }
  if (param_.relu_masks() && plan_.facts[layer].relu_from_mask) ReluBackwardFromMask(layer);
  if (measuring_) bounds_.BeforeBackward(layer);
}

// ReLU's backward needs only the signs of its input, which the store holds as a mask: it computes
// the gradient from the mask itself and tells Net to skip ReLU's own backward for this step, so
// the input is never restored (for a conv1-sized ReLU that is 300 MB not allocated and filled).
template <typename Dtype>
void CometStore<Dtype>::ReluBackwardFromMask(int layer) {
  const int b = net_->bottom_ids(layer)[0];
  std::vector<bool>& propagate =
      const_cast<std::vector<bool>&>(net_->bottom_need_backward()[layer]);
  if (plan_.entry_of_blob[b] < 0 || !propagate[0]) return;
  const Entry& e = entries_[plan_.entry_of_blob[b]];
  const CometPayload* mask = !e.stored ? NULL
                             : e.action == MASK ? e.stored.get() : e.stored->sign_mask.get();
  if (!mask) return;  // kept dense this step (NaN or Inf in the input): ReLU runs as usual
  Blob<Dtype>* top = net_->top_vecs()[layer][0];
  Blob<Dtype>* bottom = net_->bottom_vecs()[layer][0];
  CHECK_EQ(static_cast<size_t>(bottom->count()), mask->count()) << "COMET: " << e.blob;
  const float slope = net_->layers()[layer]->layer_param().relu_param().negative_slope();
  const bool dev = mask->on_device();
  CPUTimer timer;
  timer.Start();
  const float* top_diff = reinterpret_cast<const float*>(dev ? top->gpu_diff() : top->cpu_diff());
  float* bottom_diff = reinterpret_cast<float*>(dev ? bottom->mutable_gpu_diff()
                                                    : bottom->mutable_cpu_diff());
  std::string error;
  if (!CometReluBackward(*mask, top_diff, bottom_diff, slope, &error)) {
    LOG(FATAL) << "COMET: the sign mask of blob '" << e.blob << "' is corrupt (" << error
               << "); refusing to use it";
  }
  e.timing->decode_ms += timer.MilliSeconds();
  // Net passes this vector to ReLU's Backward; with it false ReLU leaves the diff as it is.
  // AfterBackward sets it back.
  propagate[0] = false;
  relu_skipped_[layer] = true;
}

template <typename Dtype>
void CometStore<Dtype>::AfterBackward(int layer) {
  CheckSharing(layer, true);
  // A decode during this backward (a restore) held device scratch for a moment: noted on top of
  // what is held now, before anything is freed again.
  const size_t transient = CometTakeTransientPeak();
  if (transient) {
    Sample();
    stats_.NoteTransient(transient);
  }
  if (measuring_) bounds_.AfterBackward(layer);
  if (relu_skipped_[layer]) {
    const_cast<std::vector<bool>&>(net_->bottom_need_backward()[layer])[0] = true;
    relu_skipped_[layer] = false;
  }
  const std::vector<int>& todo = plan_.after_backward[layer];
  for (int t = 0; t < todo.size(); ++t) {
    Entry& e = entries_[todo[t]];
    if (e.action == RECOMPUTE || e.action == REBUILD) {
      PrivateBuffer(e)->comet_release();
      continue;
    }
    SyncedMemory* mem = EntryMemory(e);
    if (!mem->comet_can_release() || mem->comet_payload() || !e.stored) continue;
    mem->comet_release();  // decoded for backward; the compressed copy goes back on
    mem->comet_payload() = e.stored;
  }
  const std::vector<int>& diffs = plan_.diff_release[layer];
  for (int k = 0; k < diffs.size(); ++k) {
    SyncedMemory* mem = net_->blobs()[diffs[k]]->diff().get();
    if (mem->comet_can_release() && mem->head() != SyncedMemory::UNINITIALIZED)
      CometMarkReleased(mem, "diff of blob '" + net_->blob_names()[diffs[k]] + "'");
  }
  Sample();
}

template <typename Dtype>
void CometStore<Dtype>::Sample() {
  std::vector<const SyncedMemory*> buffers;
  for (int e = 0; e < entries_.size(); ++e)
    if (entries_[e].layer >= 0) buffers.push_back(PrivateBuffer(entries_[e]));
  stats_.Sample(entries_, buffers);
}

template <typename Dtype>
void CometStore<Dtype>::on_start() {
  const int iter = solver_->iter();
  // Measure the error estimate on the iterations where the bounds are revisited.
  measuring_ = param_.eb_mode() == CometParameter_ErrorBoundMode_ADAPTIVE &&
               param_.update_interval() > 0 && iter % param_.update_interval() == 0;
}

template <typename Dtype>
void CometStore<Dtype>::on_gradients_ready() {
  measuring_ = false;
  SetContext(-1, "outside the training step (pycaffe or a tool)");
  const int display = solver_->param().display();
  if (display && solver_->iter() % display == 0) stats_.Report(solver_->iter(), &entries_);
}

template <typename Dtype>
void CometStore<Dtype>::Save(const std::string& filename) const {
  bounds_.Save(filename, solver_->iter());
}

template <typename Dtype>
void CometStore<Dtype>::Load(const std::string& solverstate_filename) {
  bounds_.Load(solverstate_filename, solver_->iter());
}

INSTANTIATE_CLASS(CometStore);

}  // namespace caffe
