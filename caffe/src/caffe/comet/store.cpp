// COMET-Caffe: the activation store (see include/caffe/comet/store.hpp and docs/comet.md).
#include <algorithm>
#include <chrono>  // NOLINT(build/c++11)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "caffe/comet/float_mode.hpp"
#include "caffe/comet/gemm.hpp"
#include "caffe/comet/layer_access.hpp"
#include "caffe/comet/lrn_within.hpp"
#include "caffe/comet/net_callbacks.hpp"
#include "caffe/comet/store.hpp"
#include "caffe/layer_factory.hpp"
#include "caffe/util/io.hpp"
#include "caffe/util/math_functions.hpp"

namespace caffe {


namespace {

// The private buffer of `layer` that an entry's `buffer` names (CometStore::PrivateBuffer).
template <typename Dtype>
SyncedMemory* PrivateBufferOf(Layer<Dtype>* layer, CometActions::Action buffer, int part) {
  switch (buffer) {
    case CometActions::ARGMAX: return CometLayerAccess<Dtype>::argmax(layer)->data().get();
    case CometActions::BINARY: return CometLayerAccess<Dtype>::dropout_mask(layer)->data().get();
    case CometActions::RECOMPUTE: {  // LRN's scale or internal outputs, or Swish's sigmoid's
      Blob<Dtype>* b = CometLayerAccess<Dtype>::lrn_recomputed(layer, part);
      if (!b) b = CometLayerAccess<Dtype>::swish_sigmoid(layer, part);
      CHECK(b) << "COMET: layer " << layer->layer_param().name() << " has no buffer " << part
               << " to recompute";
      return b->data().get();
    }
    case CometActions::REBUILD: return CometLayerAccess<Dtype>::rebuildable(layer)->data().get();
    case CometActions::KEEP:
    case CometActions::LOSSY: return CometLayerAccess<Dtype>::lossy_buffer(layer)->data().get();
    default: LOG(FATAL) << "COMET: " << CometActions::ActionName(buffer)
                        << " names no private buffer of a layer";
  }
  return NULL;
}

// What an entry's memory is, for the message of a read after the store freed it.
std::string EntryWhat(const CometEntry& e) {
  return (e.layer >= 0 ? "buffer '" : "data of blob '") + e.blob + "'";
}

// Drops what the store left on the diffs of `blobs` (a marker of freed memory): the layer about
// to run writes them, and starts from fresh memory.
template <typename Dtype>
void ForgetDiffs(const std::vector<Blob<Dtype>*>& blobs) {
  for (int k = 0; k < blobs.size(); ++k) {
    SyncedMemory* diff = blobs[k]->diff().get();
    if (diff && diff->comet_payload()) diff->comet_payload().reset();
  }
}

}  // namespace

// What a train net that outlives its store keeps of it (LeaveNet): the plan's account of the
// memory each layer's forward writes, so that the markers the store left there (freed, held as
// signs, compressed) go before the layer writes it, as the store itself drops them. A forward and
// backward then run as upstream's; a read of values the store did not keep, before a forward
// writes them again, still fails loudly; compressed values still decode when read.
template <typename Dtype>
struct CometStore<Dtype>::Orphan {
  Net<Dtype>* net;
  std::vector<std::vector<int> > tops_written;     // layer -> blob ids (plan_.tops_written)
  // layer -> its stored buffers (`buffer`, `part`)
  std::vector<std::vector<std::pair<Action, int> > > private_buffers;

  void BeforeForward(int layer) const {
    const std::vector<int>& ids = tops_written[layer];
    for (int k = 0; k < ids.size(); ++k) net->blobs()[ids[k]]->data()->comet_payload().reset();
    for (int k = 0; k < private_buffers[layer].size(); ++k)
      PrivateBufferOf(net->layers()[layer].get(), private_buffers[layer][k].first,
                      private_buffers[layer][k].second)->comet_payload().reset();
    ForgetDiffs(net->bottom_vecs()[layer]);
    ForgetDiffs(net->top_vecs()[layer]);
  }
  void BeforeBackward(int layer) const { ForgetDiffs(net->bottom_vecs()[layer]); }
};

// Forwards one of Net's four per-layer callbacks to the store, or once the store is gone to
// what the net keeps of it (Orphan).
template <typename Dtype>
class CometStore<Dtype>::Hook : public Net<Dtype>::Callback {
 public:
  enum When { BEFORE_FORWARD, AFTER_FORWARD, BEFORE_BACKWARD, AFTER_BACKWARD };
  Hook(CometStore<Dtype>* store, When when) : store_(store), when_(when) {}
  void Orphaned(const shared_ptr<const Orphan>& orphan) {
    store_ = NULL;
    orphan_ = orphan;
  }

 protected:
  virtual void run(int layer) {
    if (!store_) {
      if (when_ == BEFORE_FORWARD) orphan_->BeforeForward(layer);
      if (when_ == BEFORE_BACKWARD) orphan_->BeforeBackward(layer);
      return;
    }
    switch (when_) {
      case BEFORE_FORWARD: store_->BeforeForward(layer); break;
      case AFTER_FORWARD: store_->AfterForward(layer); break;
      case BEFORE_BACKWARD: store_->BeforeBackward(layer); break;
      case AFTER_BACKWARD: store_->AfterBackward(layer); break;
    }
  }

 private:
  CometStore<Dtype>* store_;
  shared_ptr<const Orphan> orphan_;
  When when_;
};

// The store's end, with the net still alive, which may outlive it (pycaffe). The hooks stay with
// the net (net_callbacks.hpp) and keep it working as plain Caffe (Orphan); the buffers the store
// freed for their layer to compute again (LRN's scale, BatchNorm's temp_), which a backward
// without a forward would read as zeros without the store, are marked freed, so such a read
// fails loudly instead.
template <typename Dtype>
void CometStore<Dtype>::LeaveNet() {
  shared_ptr<Orphan> orphan(new Orphan());
  orphan->net = net_;
  orphan->tops_written = plan_.tops_written;
  orphan->private_buffers.resize(net_->layers().size());
  for (int layer = 0; layer < plan_.private_of_layer.size(); ++layer) {
    for (int k = 0; k < plan_.private_of_layer[layer].size(); ++k) {
      const Entry& e = entries_[plan_.private_of_layer[layer][k]];
      orphan->private_buffers[layer].push_back(std::make_pair(e.buffer, e.part));
      SyncedMemory* mem = PrivateBuffer(e);
      if ((e.action == RECOMPUTE || e.action == REBUILD) && !mem->comet_payload() &&
          mem->head() == SyncedMemory::UNINITIALIZED)
        CometMarkReleased(mem, EntryWhat(e));
    }
  }
  std::vector<shared_ptr<typename Net<Dtype>::Callback> > callbacks;
  for (int h = 0; h < hooks_.size(); ++h) {
    hooks_[h]->Orphaned(orphan);
    callbacks.push_back(hooks_[h]);
  }
  CometNetCallbacks<Dtype>::Outlive(*net_, callbacks);
}

// See store.hpp. The work runs on the worker (or inline) and writes only the job's results; the
// step's thread does everything else (Finish), so the net's memory is touched by one thread.
template <typename Dtype>
struct CometStore<Dtype>::Job {
  enum What { ENCODE, DECODE };
  Job(What w, int e, SyncedMemory* m) : what(w), entry(e), mem(m), also(NULL), out(NULL),
                                        also_out(NULL), bytes(m->size()), ticket(0),
                                        side(NULL), ms(0) {}
  What what;
  int entry;
  SyncedMemory* mem;
  // DECODE of a blob rebuilt from x_norm_: x_norm_'s memory, decoded by the same job first
  // (BatchNorm's and Scale's backward read it next), or NULL.
  SyncedMemory* also;
  // DECODE: the host memory it writes for mem and also (a later job may read it once this one
  // is done), or NULL. A DECODE without a payload rebuilds a layer's buffer (RebuildAhead).
  const void* out;
  const void* also_out;
  shared_ptr<CometPayload> also_payload;
  size_t bytes;      // dense bytes it keeps in flight until finished
  uint64_t ticket;   // on the worker; 0: ran in the step
  CometSideStream* side;         // device work: the store's stream, or NULL
  std::function<void()> before;  // untimed: a device job's wait for the step's kernels
  std::function<void(Job*)> work;
  // ENCODE: the payload made, NULL when the blob stays dense this step (`note` says why);
  // DECODE: the payload decoded into the dense memory. `error`: a failure, fatal at Finish.
  // `failed`: the device work itself failed (CometJobFailure: a CUDA error, out of memory),
  // not the stream it decoded.
  shared_ptr<CometPayload> payload;
  std::string error, note;
  bool failed = false;
  double ms;         // the work's own time

  void Run() {       // the work, timed
    CometJobScope scope;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    try {
      if (before) before();
      start = std::chrono::steady_clock::now();
      work(this);
    } catch (const CometJobFailure& f) {
      error = f.what();
      failed = true;
    }
    ms = CometMsSince(start);
  }
};

namespace {

typedef std::chrono::steady_clock Clock;

bool OnDevice(const SyncedMemory* mem) {
  return Caffe::mode() == Caffe::GPU &&
         (mem->head() == SyncedMemory::HEAD_AT_GPU || mem->head() == SyncedMemory::SYNCED);
}

// Dense host memory for a decode ahead of p into mem; until the job finishes, mem holds the
// IN_FLIGHT marker, so that a read before then waits for it (or names what) instead of computing
// on memory the decode is still writing.
float* InFlightDenseFor(SyncedMemory* mem, const CometPayload& p, const std::string& what) {
  mem->comet_payload().reset();
  float* out = static_cast<float*>(CometDenseFor(mem, p));  // a host payload: host memory
  mem->comet_payload().reset(new CometPayload(CometPayload::IN_FLIGHT, false, 0, what));
  return out;
}

// The largest factor's magnitude (a Scale layer's per-channel factors); NaN when one is not
// finite, which no bound check passes.
template <typename Dtype>
float LargestFactor(const Dtype* a, int n) {
  const std::vector<float> f(a, a + n);
  bool finite = true;
  const float m = CometMaxAbs(f.data(), f.size(), &finite);
  return finite ? m : std::numeric_limits<float>::quiet_NaN();
}

// Set once by a test runner before any solver is made; read in Solver::Init.
shared_ptr<CometParameter>& BlockForSolversWithout() {
  static shared_ptr<CometParameter> block;
  return block;
}

}  // namespace

void CometSetBlockForSolversWithout(const CometParameter& block) {
  BlockForSolversWithout().reset(new CometParameter(block));
}

void CometGiveBlockIfWithout(SolverParameter* param) {
  const shared_ptr<CometParameter>& block = BlockForSolversWithout();
  if (block && !param->has_comet()) param->mutable_comet()->CopyFrom(*block);
}

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
      stats_(net_, param_), columns_max_(0), context_layer_(-1), context_iter_(-1),
      context_pass_("before the first training step"), forward_from_(0), last_forward_(-2),
      measuring_(false), auditing_(false), passes_in_step_(0), plan_mode_(Caffe::mode()),
      in_flight_(0), max_in_flight_(0), tiled_gemm_(false), flushing_(false), in_step_(false),
      float_mode_(0) {
  CheckSettings(param_, *net_);
  const bool cpu = Caffe::mode() == Caffe::CPU;
  if (param_.async())
    worker_.reset(new CometWorker(cpu ? CometWorker::Job() : CometTakeThisDevice()));
  if (!cpu && param_.async()) side_stream_.reset(new CometSideStream());
  std::string why;
  if (cpu && param_.tiled_gemm()) {
    tiled_gemm_ = CometGemm::Available(&why);
    if (!tiled_gemm_) LOG(INFO) << "COMET: tiled_gemm does nothing here: " << why;
  }
  if (cpu && !CometGemm::CanSetBlasThreadsMode())
    LOG(INFO) << "COMET: the BLAS's own threads keep their floating-point mode here (only "
                 "OpenBLAS's pthread build lets the store remake them), so products they run may "
                 "meet denormals and run slower with COMET on (docs/comet.md, \"OpenBLAS's "
                 "threads, flushed and bypassed\")";
  if (cpu && param_.async() && !getenv("OPENBLAS_THREAD_TIMEOUT"))
    LOG(INFO) << "COMET: OPENBLAS_THREAD_TIMEOUT is not set. With OpenBLAS its idle threads spin "
                 "for about 0.1 s after each call, on the cores this store's worker and Caffe's "
                 "one-thread layers need; OPENBLAS_THREAD_TIMEOUT=4 lets them sleep at once "
                 "(cometctl sets it; docs/comet.md)";
  backward_skipped_.assign(net_->layers().size(), false);
  MakePlan();
  TakePoolForwards(true);
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
  if (tiled_gemm_) CometGemm::Use(true);  // last: a constructor that fails leaves it as it was
}

template <typename Dtype>
CometStore<Dtype>::~CometStore() {
  // Whatever is queued runs to its end (the worker's destructor), and decoded memory keeps its
  // data; nothing is reported from a destructor.
  worker_.reset();
  side_stream_.reset();  // after the worker: its jobs ran on it
  if (tiled_gemm_) CometGemm::Use(false);
  StopFlushing();
  for (typename std::list<shared_ptr<Job> >::iterator j = jobs_.begin(); j != jobs_.end(); ++j) {
    Job& job = **j;
    if (job.what != Job::DECODE) continue;
    job.mem->comet_payload().reset();
    if (!job.error.empty()) {
      job.mem->comet_release();
      job.mem->comet_payload() = job.payload;  // still read as corrupt, never as garbage
    }
  }
  jobs_.clear();
  TakePoolForwards(false);
  CometReleaseEncoderBuffer();  // mapped for the largest blob this store encoded
  LeaveNet();
  // A describer left behind would point into this store (another store's goes too: harmless)
  CometSetReadContext("outside a COMET training step (its solver is gone)");
  if (param_.memory_pool()) {
    CometHostPoolEnable(false);
    CometGpuPoolEnable(false);
  }
}

template <typename Dtype>
void CometStore<Dtype>::MakePlan() {
  FinishAll();  // jobs name entries of the old plan
  plan_mode_ = Caffe::mode();
  plan_ = MakeCometPlan(*net_, param_, data_aliases_, diff_aliases_);
  // The shared column buffer as large as the largest any convolution has now (ShareColumns).
  for (int i = 0; i < plan_.facts.size(); ++i) {
    if (const Blob<Dtype>* cols = ColumnsOf(i)) GrowColumns(cols->count());
  }
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
  // Without a cap set, the jobs may hold as much dense memory as the largest blob stored: a
  // pending encode of it finishes before another starts beside it.
  max_in_flight_ = static_cast<size_t>(param_.max_in_flight_mb() * (1 << 20));
  for (int e = 0; e < entries_.size() && param_.max_in_flight_mb() <= 0; ++e)
    max_in_flight_ = std::max(max_in_flight_, EntryMemory(entries_[e])->size());
}

// An encode or decode of device memory goes to the worker when the store has a stream of its own
// for it (comet { async } on a GPU): the job waits for the kernels the step queued before it,
// works on that stream, and is finished once the stream is (CometSideStream).
template <typename Dtype>
void CometStore<Dtype>::StartCoding(const shared_ptr<Job>& job, bool device) {
  if (!worker_ || (device && !side_stream_)) {
    Start(job, false);
    return;
  }
  if (device) job->side = side_stream_.get();
  Start(job, true);
}

template <typename Dtype>
void CometStore<Dtype>::Start(const shared_ptr<Job>& job, bool on_worker) {
  if (!on_worker) {
    job->Run();
    entries_[job->entry].timing->wait_ms += job->ms;  // in the step: all of it is waited for
    Finish(job.get());
    return;
  }
  // An encode past the cap waits for the oldest job; a decode ahead was let through (DecodeAhead).
  while (job->what == Job::ENCODE && !jobs_.empty() && in_flight_ + job->bytes > max_in_flight_)
    Await(jobs_.front());
  in_flight_ += job->bytes;
  if (job->side) {  // after the waits above: the mark is an event, consumed when the job runs
    CometSideStream* side = job->side;
    void* mark = side->Mark();
    const std::function<void(Job*)> work = job->work;
    job->before = [side, mark] { side->WaitFor(mark); };
    job->work = [side, work](Job* j) { side->Run([&] { work(j); }); };
  }
  Job* raw = job.get();  // jobs_ keeps it until it is finished, after its work ran
  job->ticket = worker_->Submit([raw] { raw->Run(); });
  jobs_.push_back(job);
}

template <typename Dtype>
void CometStore<Dtype>::Await(shared_ptr<Job> job) {
  entries_[job->entry].timing->wait_ms += worker_->Wait(job->ticket);
  jobs_.remove(job);
  in_flight_ -= job->bytes;
  Finish(job.get());
}

template <typename Dtype>
void CometStore<Dtype>::Harvest() {
  for (typename std::list<shared_ptr<Job> >::iterator j = jobs_.begin(); j != jobs_.end();) {
    // A failed decode waits for its reader, whose name goes into the error.
    if (!worker_->Done((*j)->ticket) || ((*j)->what == Job::DECODE && !(*j)->error.empty())) {
      ++j;
      continue;
    }
    shared_ptr<Job> job = *j;
    j = jobs_.erase(j);
    in_flight_ -= job->bytes;
    Finish(job.get());
  }
}

template <typename Dtype>
void CometStore<Dtype>::FinishAll() {
  while (!jobs_.empty()) Await(jobs_.front());
}

template <typename Dtype>
void CometStore<Dtype>::Finish(Job* job) {
  Entry& e = entries_[job->entry];
  if (job->what == Job::DECODE) {
    job->mem->comet_payload().reset();  // the IN_FLIGHT marker
    if (job->also) job->also->comet_payload().reset();
    if (!job->error.empty()) {
      if (job->also) {
        job->also->comet_release();
        job->also->comet_payload() = job->also_payload;
      }
      job->mem->comet_release();
      // A rebuilt buffer is left to its reader, whose rebuild reads the failed x_norm_ and
      // fails the same way; a stream's every later read fails as this one.
      if (!job->payload) return;
      job->mem->comet_payload() = job->payload;
      if (job->failed) {
        CometFatal("COMET: decoding blob '" + e.blob + "' for the backward pass failed (" +
                   job->error + "), iteration " + CometNum(solver_->iter()));
        return;
      }
      CometFatalCorrupt(e.blob, job->error);
      return;
    }
    CometTiming* timing = job->payload ? job->payload->timing.get() : e.timing.get();
    if (timing) timing->decode_ms += job->ms;
    return;
  }
  if (!job->error.empty()) {
    CometFatal("COMET: compressing blob '" + e.blob + "' after layer '" +
               net_->layer_names()[e.last_forward] + "' forward failed (" + job->error +
               "), iteration " + CometNum(solver_->iter()));
    return;
  }
  if (!job->payload) {
    LOG_FIRST_N(WARNING, 10) << "COMET: " << job->note;
    return;
  }
  Hold(&e, job->mem, job->payload);
  e.encode_ms += job->ms;
  e.samples += 1;
}

template <typename Dtype>
bool CometStore<Dtype>::PoolHasRoomFor(size_t bytes) const {
  if (!param_.memory_pool()) return false;
  const CometPoolStats s = CometPoolQueryHere();  // the host's, or this store's device's
  return s.in_use + bytes <= s.peak_in_use;
}

// A decode ahead holds dense memory before its reader would. With the pool: only in memory
// the pool holds below its peak in use beside what the backward running now allocates (`now`,
// BackwardAllocates): memory the backward pass has freed again, resident anyway (also past the
// cap: both of LRN's 77 MB inputs in GoogLeNet at batch 32). With the cap alone CaffeNet's conv3
// output (66 MB at batch 256) was decoded while conv5's backward wrote conv4's diff, at the first
// step's peak: 1,512 against 1,452 MB RSS with every job in the step. Without the pool: the cap.
template <typename Dtype>
bool CometStore<Dtype>::MayDecodeAhead(size_t bytes, size_t now) const {
  if (param_.memory_pool()) return PoolHasRoomFor(bytes + now);
  return in_flight_ + bytes <= max_in_flight_;
}

// What a layer's backward is about to allocate: its bottoms' diffs not allocated yet and the
// stored inputs it restores on demand (started ahead ones are dense already).
template <typename Dtype>
size_t CometStore<Dtype>::BackwardAllocates(int layer) const {
  size_t bytes = 0;
  const std::vector<Blob<Dtype>*>& bottoms = net_->bottom_vecs()[layer];
  for (int k = 0; k < bottoms.size(); ++k) {
    const SyncedMemory* diff = bottoms[k]->diff().get();
    if (net_->bottom_need_backward()[layer][k] && diff->head() == SyncedMemory::UNINITIALIZED)
      bytes += diff->size();
  }
  const std::vector<int>& reads = plan_.backward_reads[layer];
  for (int k = 0; k < reads.size(); ++k) {
    const Entry& e = entries_[reads[k]];
    SyncedMemory* mem = EntryMemory(e);
    const CometPayload* p = mem->comet_payload().get();
    if (p && (p->kind() == CometPayload::LOSSY || p->kind() == CometPayload::DERIVED))
      bytes += mem->size();
  }
  return bytes;
}

template <typename Dtype>
void CometStore<Dtype>::DecodeAhead(int layer) {
  if (!worker_ || param_.decode_ahead() == 0) return;
  const std::vector<int>& now = plan_.backward_reads[layer];
  const size_t allocating = BackwardAllocates(layer);
  int layers = 0;
  for (int i = layer - 1; i >= 0 && layers < param_.decode_ahead(); --i) {
    const std::vector<int>& reads = plan_.backward_reads[i];
    if (reads.empty()) continue;
    ++layers;
    for (int k = 0; k < reads.size(); ++k) {
      const int x = reads[k];
      if (std::find(now.begin(), now.end(), x) != now.end()) continue;  // restored by this one
      Entry& e = entries_[x];
      SyncedMemory* mem = EntryMemory(e);
      const shared_ptr<CometPayload> p = mem->comet_payload();
      // Dense (kept, or restored already), or on its way: nothing to start. On the GPU only
      // with a stream of the store's own (decodes on the default stream would wait in the step).
      if (!p || p != e.stored || p->kind() == CometPayload::MASK) continue;
      if (p->on_device() && !side_stream_) continue;
      if (p->kind() == CometPayload::ARGMAX && param_.pool_codes()) continue;  // read as codes
      // Where it may not (MayDecodeAhead) it is decoded on demand, as without decode_ahead.
      if (p->kind() == CometPayload::DERIVED) {
        DecodeAheadRebuilt(x, p, allocating);
        continue;
      }
      if (!MayDecodeAhead(mem->size(), allocating)) continue;
      float* out = InFlightDenseFor(mem, *p, "the data of blob '" + e.blob + "'");
      shared_ptr<Job> job(new Job(Job::DECODE, x, mem));
      job->payload = p;
      job->out = out;
      job->work = [p, out](Job* j) { CometDecode(*p, out, &j->error); };
      StartCoding(job, p->on_device());
    }
    // The buffers this layer's backward reads besides its stored inputs, after the decodes
    // above (a Scale's copy may wait for its x_norm_'s).
    const std::vector<int>& own = plan_.private_of_layer[i];
    for (int k = 0; k < own.size() && Caffe::mode() == Caffe::CPU; ++k)
      if (entries_[own[k]].action == REBUILD) RebuildAhead(own[k]);
  }
}

// The buffer a layer's backward reads that the store rebuilds (REBUILD), made on the worker
// ahead of that backward instead of in the step: BatchNorm's temp_, its per-channel deviation
// repeated over each plane (the same values as the forward's products with vectors of ones); an
// in-place Scale's copy of x_norm_, once x_norm_ is dense (kept, restored, or decoded by a job
// queued before this one, which this job waits for). Otherwise the step rebuilds it before its
// backward, as without decode_ahead.
template <typename Dtype>
void CometStore<Dtype>::RebuildAhead(int x) {
  Entry& e = entries_[x];
  SyncedMemory* mem = PrivateBuffer(e);
  if (e.unread) return;  // written anew by its backward (MVN's temp_)
  if (mem->head() != SyncedMemory::UNINITIALIZED || mem->comet_payload() || !mem->size()) return;
  // Within the cap and, unlike a decode, also in memory the backward pass has freed again: a
  // buffer made early lives beside those the layers before it free first, and the cap alone let
  // bn_conv1's temp_ live beside scale_conv1's copy (103 MB more at the peak, ResNet-18 batch 32).
  if (in_flight_ + mem->size() > max_in_flight_ || !PoolHasRoomFor(mem->size())) return;
  Layer<Dtype>* l = net_->layers()[e.layer].get();
  const Blob<Dtype>* buffer = CometLayerAccess<Dtype>::rebuildable(l);
  const size_t count = buffer->count();
  const Dtype* from = NULL;  // Scale: x_norm_'s values; BatchNorm: the deviations
  shared_ptr<Job> source;    // the job still writing x_norm_, if any
  if (e.source >= 0) {
    SyncedMemory* xmem = CometLayerAccess<Dtype>::bn_x_norm(net_->layers()[e.source].get())
                             ->data().get();
    if (xmem->size() != mem->size()) return;
    const shared_ptr<CometPayload>& xp = xmem->comet_payload();
    if (!xp && xmem->head() != SyncedMemory::UNINITIALIZED) {
      from = static_cast<const Dtype*>(xmem->cpu_data());
    } else if (xp && xp->kind() == CometPayload::IN_FLIGHT) {
      for (typename std::list<shared_ptr<Job> >::iterator j = jobs_.begin(); j != jobs_.end(); ++j)
        if ((*j)->what == Job::DECODE && ((*j)->mem == xmem || (*j)->also == xmem)) source = *j;
      if (!source) return;
      from = static_cast<const Dtype*>(source->mem == xmem ? source->out : source->also_out);
    }
    if (!from) return;  // x_norm_ still compressed: its reader decodes it
  } else {
    from = CometLayerAccess<Dtype>::bn_std(l)->cpu_data();
  }
  const int num = buffer->shape(0);
  const int channels = e.source >= 0 ? 0 : CometLayerAccess<Dtype>::bn_std(l)->count();
  CHECK(e.source >= 0 || count % (static_cast<size_t>(num) * channels) == 0) << e.blob;
  const size_t plane = e.source >= 0 ? 0 : count / (static_cast<size_t>(num) * channels);
  CometFillWhole whole(mem);  // the job writes all of it
  Dtype* out = static_cast<Dtype*>(mem->mutable_cpu_data());
  mem->comet_payload().reset(new CometPayload(CometPayload::IN_FLIGHT, false, 0,
                                              "the " + e.blob + " buffer"));
  shared_ptr<Job> job(new Job(Job::DECODE, x, mem));
  job->out = out;
  CometWorker* worker = worker_.get();
  job->work = [worker, source, from, out, count, num, channels, plane](Job* j) {
    if (source) {  // started before this one (ticket order), maybe on another thread
      worker->Wait(source->ticket);
      if (!source->error.empty()) {
        j->error = "x_norm_ was not decoded";  // its own job reports why
        return;
      }
    }
    if (!plane) {
      std::memcpy(out, from, count * sizeof(Dtype));
      return;
    }
    for (int n = 0; n < num; ++n)
      for (int c = 0; c < channels; ++c) {
        Dtype* o = out + (static_cast<size_t>(n) * channels + c) * plane;
        std::fill(o, o + plane, from[c]);
      }
  };
  Start(job, true);
}

// A blob rebuilt from x_norm_ (a DERIVED payload): from x_norm_'s dense memory, or with x_norm_
// decoded into its own memory by the same job first, so that the stream is decoded once for the
// Convolution, Scale and BatchNorm that read it. Otherwise (x_norm_ on its way, or past the cap)
// its reader restores it on demand, decoding the stream on its own.
template <typename Dtype>
void CometStore<Dtype>::DecodeAheadRebuilt(int x, const shared_ptr<CometPayload>& p,
                                           size_t allocating) {
  Entry& e = entries_[x];
  SyncedMemory* mem = EntryMemory(e);
  const Entry& xn = entries_[e.rebuild_from];
  SyncedMemory* xmem = EntryMemory(xn);
  const shared_ptr<CometPayload> xp = xmem->comet_payload();
  const bool dense = !xp && xmem->head() != SyncedMemory::UNINITIALIZED && xn.stored == p->source;
  const bool stream = xp && xp == xn.stored && xp == p->source;
  if (!dense && !stream) return;
  const size_t bytes = mem->size() + (stream ? xmem->size() : 0);
  if (!MayDecodeAhead(bytes, allocating)) return;
  shared_ptr<Job> job(new Job(Job::DECODE, x, mem));
  job->payload = p;
  job->bytes = bytes;
  const float* x_norm = NULL;
  float* xout = NULL;
  if (stream) {
    xout = InFlightDenseFor(xmem, *xp, "the data of " + xn.blob);
    x_norm = xout;
    job->also = xmem;
    job->also_payload = xp;
  } else {
    x_norm = static_cast<const float*>(xmem->cpu_data());
  }
  float* out = InFlightDenseFor(mem, *p, "the data of blob '" + e.blob + "'");
  job->out = out;
  job->also_out = xout;
  job->work = [p, xp, xout, x_norm, out](Job* j) {
    if (xout && !CometDecode(*xp, xout, &j->error)) return;
    CometRebuild(*p, x_norm, out, &j->error);
  };
  Start(job, true);
}

// An across-channels LRN reads its output in backward on the GPU only (layer_facts.cpp), and
// device jobs go to the store's own stream, made for GPU mode.
template <typename Dtype>
void CometStore<Dtype>::FollowMode() {
  const bool gpu = Caffe::mode() == Caffe::GPU;
  LOG(INFO) << "COMET: Caffe runs in " << (gpu ? "GPU" : "CPU") << " mode now, the plan was made "
            << "in " << (gpu ? "CPU" : "GPU") << " mode; re-planning";
  if (gpu && param_.async() && !side_stream_) side_stream_.reset(new CometSideStream());
  // A worker started in CPU mode has no device: it takes this one before its first device job
  // (left on device 0, a job there would make a context on it, with `caffe.set_device(1)`).
  if (gpu && worker_) worker_->Wait(worker_->Submit(CometTakeThisDevice()));
  std::string why;
  if (!gpu && param_.tiled_gemm() && !tiled_gemm_ && CometGemm::Available(&why)) {
    tiled_gemm_ = true;
    CometGemm::Use(true);
  }
  MakePlan();
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

namespace {
// The reader of memory between two layers' passes: not a layer, so pycaffe (a net.forward() or
// net.backward() of its own) or a tool.
const char kBetweenLayers[] = "outside a layer's forward and backward (pycaffe or a tool)";
const char kForward[] = "forward";
}  // namespace

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
      if (InForwardFromLater()) {
        os << ", in a forward that began at layer '" << s.net_->layer_names()[s.forward_from_]
           << "' (pycaffe's net.forward(start=...))";
      }
    } else if (s.context_iter_ >= 0) {
      os << s.context_pass_ << ", after iteration " << s.context_iter_;
    } else {
      os << s.context_pass_;
    }
    return os.str();
  }
  virtual bool InLayer() const { return store_->context_layer_ >= 0; }
  virtual bool InForwardFromLater() const {
    return InLayer() && store_->context_pass_ == kForward && store_->forward_from_ > 0;
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
  if (layer == 0 && Caffe::mode() != plan_mode_) FollowMode();
  const bool starts = layer == 0 || layer != last_forward_ + 1;
  if (starts) forward_from_ = layer;
  last_forward_ = layer;
  SetContext(layer, kForward);
  ShareColumns(layer);
  // Work queued by an earlier pass (decodes started for a backward that stopped early, encodes
  // of a forward that ended early) may read or write memory this forward rewrites: pycaffe's
  // forward(end=...) then forward(start=...) would rewrite a blob that an encode was reading,
  // and that encode's payload, attached after, would replace the new values.
  if (starts) FinishAll();
  if (layer == 0) {
    if (in_step_ && ++passes_in_step_ > 1) measuring_ = false;  // iter_size > 1: a later pass
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
    if (e.buffer == REBUILD && e.unread) CometMarkFill(mem);  // MVN's forward writes temp_ whole first
  }
  // Diffs freed after the last step's backward hold nothing a forward may read; a forward that
  // writes one (HingeLoss writes its bottom's diff) starts from fresh memory.
  ForgetDiffs(net_->bottom_vecs()[layer]);
  ForgetDiffs(net_->top_vecs()[layer]);
  // A layer that writes all of its own tops: memory of theirs the store freed is not zeroed
  // before it does (upstream zero-fills fresh memory; COMET off allocates it only once).
  for (int k = 0; k < ids.size() && plan_.facts[layer].fills_whole; ++k)
    CometMarkFill(net_->blobs()[ids[k]]->data().get());
  MakeRoomForForward(layer);
}

// An encode on the worker holds its dense input until it has run. A forward whose new memory
// would take the host above the peak in use so far waits for them first (oldest first), so work
// beside the step only uses memory the step has needed anyway, as decode_ahead's rule has it.
// Without this, conv1's 297 MB (CaffeNet, batch 256) were still held, their mask being packed,
// while norm1 wrote its output and scale: 33 MB above the peak of the same step done in order.
template <typename Dtype>
void CometStore<Dtype>::MakeRoomForForward(int layer) {
  if (!worker_ || jobs_.empty() || !param_.memory_pool()) return;
  size_t need = 0;
  const std::vector<int>& ids = plan_.tops_written[layer];
  for (int k = 0; k < ids.size(); ++k) {
    const SyncedMemory* mem = net_->blobs()[ids[k]]->data().get();
    if (mem->head() == SyncedMemory::UNINITIALIZED) need += mem->size();
  }
  const std::vector<int>& own = plan_.private_of_layer[layer];
  for (int k = 0; k < own.size(); ++k) {
    const Entry& e = entries_[own[k]];
    if (e.action == ARGMAX && pool_layers_.count(net_->layers()[layer].get())) continue;  // codes
    const SyncedMemory* mem = PrivateBuffer(e);
    if (mem->head() == SyncedMemory::UNINITIALIZED) need += mem->size();
  }
  while (!jobs_.empty() && !PoolHasRoomFor(need)) Await(jobs_.front());
}

// Drops FILL markers that a layer's Forward (Backward) left untouched: no later access may skip
// the zero fill because of them.
template <typename Dtype>
void CometStore<Dtype>::DropFillMarkers(int layer, bool diff) {
  const std::vector<Blob<Dtype>*>& blobs =
      diff ? net_->bottom_vecs()[layer] : net_->top_vecs()[layer];
  for (int k = 0; k < blobs.size(); ++k) {
    SyncedMemory* mem = (diff ? blobs[k]->diff() : blobs[k]->data()).get();
    if (mem && mem->comet_payload() && mem->comet_payload()->kind() == CometPayload::FILL)
      mem->comet_payload().reset();
  }
}

template <typename Dtype>
SyncedMemory* CometStore<Dtype>::PrivateBuffer(const Entry& e) const {
  return PrivateBufferOf(net_->layers()[e.layer].get(), e.buffer, e.part);
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

template <typename Dtype>
std::function<void(typename CometStore<Dtype>::Job*)> CometStore<Dtype>::LossyWork(
    const float* data, const std::vector<int>& shape, size_t count, bool dev, float eb,
    const std::string& name, const std::string& what, bool signs) {
  return [=](Job* j) {
    j->payload = CometEncodeLossy(data, shape, dev, eb, name, &j->error);
    if (!j->payload || !signs) return;
    j->payload->sign_mask = CometEncodeMask(data, count, dev, name);
    if (j->payload->sign_mask) return;
    j->payload.reset();
    j->note = what + " holds NaN or Inf; kept dense this iteration (ReLU or PReLU needs its "
              "exact sign)";
  };
}

// After the owning layer's forward: argmax and Dropout mask as packed codes, LRN's scale freed;
// every buffer of a layer that runs no backward freed.
template <typename Dtype>
void CometStore<Dtype>::StorePrivate(Entry* e) {
  SyncedMemory* mem = PrivateBuffer(*e);
  if (!mem->comet_can_release() || mem->comet_payload() ||
      mem->head() == SyncedMemory::UNINITIALIZED) {
    return;
  }
  if (e->action == RELEASE) {  // its layer runs no backward; its next forward writes it again
    CometMarkReleased(mem, EntryWhat(*e));
    return;
  }
  if (e->action == KEEP) {  // counted, not touched
    e->dense_bytes += mem->size();
    e->stored_bytes += mem->size();
    e->samples += 1;
    return;
  }
  if (e->action == RECOMPUTE || e->action == REBUILD) {
    // LRN's scale is kept until LRN's backward and freed after it, unless recompute_lrn or the
    // store computes that backward without it.
    if (e->action == RECOMPUTE && !param_.recompute_lrn() && !e->unread) return;
    e->dense_bytes += mem->size();
    // Unread until the layer's next forward writes it (BeforeForward drops the marker): a read
    // in between is refused, naming the buffer, rather than given zeros.
    if (e->unread) CometMarkReleased(mem, EntryWhat(*e), "layer_buffers: false");
    else mem->comet_release();
    e->samples += 1;
    return;
  }
  const bool dev = OnDevice(mem);
  const std::string name = e->blob;
  shared_ptr<Job> job(new Job(Job::ENCODE, e - &entries_[0], mem));
  Layer<Dtype>* l = net_->layers()[e->layer].get();
  // The buffer's count, not its memory's: a batch reshaped smaller keeps the larger memory, and
  // the values past the count are stale (no codes of this shape's windows).
  const size_t count = e->action == ARGMAX ? CometLayerAccess<Dtype>::argmax(l)->count()
                       : e->action == BINARY ? CometLayerAccess<Dtype>::dropout_mask(l)->count()
                       : 0;
  if (e->action == LOSSY) {  // BatchNorm's x_norm_, in-place PReLU's copy (with its signs)
    const float* data = reinterpret_cast<const float*>(dev ? mem->gpu_data() : mem->cpu_data());
    float eb = bounds_.ForEntry(*e);
    if (e->rebuilds >= 0 && !dev) eb = std::min(eb, RebuildBound(*e));
    e->eb_sum += eb;
    const Blob<Dtype>* buffer = CometLayerAccess<Dtype>::lossy_buffer(l);
    const std::vector<int> shape = buffer->shape();
    const size_t values = buffer->count();
    if (measuring_) bounds_.NoteStoredInput(*e, data, dev, shape, eb);
    const float asked = eb;
    const shared_ptr<CometPayload> offsets =
        ShiftsTies(*e) ? CometLayerAccess<Dtype>::ShiftXNormTies(l, dev, &eb)
                       : shared_ptr<CometPayload>();
    job->work = LossyWork(data, shape, values, dev, eb, name, name, e->signs);
    if (offsets) {
      const std::function<void(Job*)> encode = job->work;
      job->work = [encode, offsets, asked](Job* j) {
        encode(j);
        if (!j->payload) return;
        j->payload->channel_offsets = offsets;
        j->payload->eb = asked;  // what x_norm_ comes back within, the offsets added back
      };
    }
  } else {
    const void* data = dev ? mem->gpu_data() : mem->cpu_data();
    const std::string note = name + " holds a value its code cannot express (a max over NaN); "
                             "kept dense this iteration";
    if (e->action == ARGMAX) {
      const comet_codes::PoolGeometry g = CometLayerAccess<Dtype>::geometry(l);
      job->work = [=](Job* j) {
        j->payload = CometEncodeArgmax(static_cast<const int*>(data), count, g, dev, name);
        if (!j->payload) j->note = note;
      };
    } else {
      const comet_codes::BinaryRule rule = CometLayerAccess<Dtype>::dropout_rule(l, dev);
      job->work = [=](Job* j) {
        j->payload = CometEncodeBinary(static_cast<const unsigned int*>(data), count, rule, dev,
                                       name);
        if (!j->payload) j->note = note;
      };
    }
  }
  StartCoding(job, dev);
}

template <typename Dtype>
void CometStore<Dtype>::AfterForward(int layer) {
  DropFillMarkers(layer, false);
  CheckSharing(layer, false);
  if (worker_) Harvest();
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
      CometMarkReleased(mem, EntryWhat(e));
      continue;
    }
    const bool dev = OnDevice(mem);
    const float* data = reinterpret_cast<const float*>(dev ? mem->gpu_data() : mem->cpu_data());
    const size_t count = blob->count();
    const std::string name = e.blob;
    shared_ptr<Job> job(new Job(Job::ENCODE, todo[t], mem));
    if (e.action == LOSSY) {
      const float eb = bounds_.ForEntry(e);
      e.eb_sum += eb;
      const std::vector<int> shape = blob->shape();
      if (measuring_) bounds_.NoteStoredInput(e, data, dev, shape, eb);
      const std::function<void(Job*)> lossy =
          LossyWork(data, shape, count, dev, eb, name, "blob " + name, e.signs);
      job->work = lossy;
      if (e.rebuild_from >= 0 && !dev) job->work = RebuildOrLossy(e, blob, eb, lossy);
    } else {
      job->work = [=](Job* j) {
        j->payload = CometEncodeMask(data, count, dev, name);
        if (!j->payload) {
          j->note = "blob " + name + " holds NaN or Inf; kept dense this iteration (a sign "
                    "mask would lose them)";
        }
      };
    }
    StartCoding(job, dev);
  }
  // The forward pass ends with every encode finished: a caller (pycaffe, the solver) sees the
  // net as the plan leaves it, and no job outlives the step's forward.
  if (layer + 1 == net_->layers().size()) FinishAll();
  stats_.NoteTransient(CometTakeTransientPeak());
  Sample();
  SetContext(-1, kBetweenLayers);
}

namespace {
// Of the bound a rebuilt blob keeps, what x_norm_'s error times Scale's largest factor may use;
// the rest is for the float rounding of a x + b (checked for every blob: RebuildOrLossy).
const float kRebuildShare = 0.99f;
const double kRebuildRounding = 1e-6;  // relative, about 8 float ulps
}  // namespace

// x_norm_'s bound such that the blob rebuilt from it through Scale keeps its readers' bound.
template <typename Dtype>
float CometStore<Dtype>::RebuildBound(const Entry& xn) const {
  const Entry& d = entries_[xn.rebuilds];
  const Blob<Dtype>* factors = net_->layers()[d.rebuild_scale]->blobs()[0].get();
  const float max_a = LargestFactor(factors->cpu_data(), factors->count());
  if (!(max_a > 0) || !std::isfinite(max_a)) return bounds_.ForEntry(xn);  // nothing to keep
  return kRebuildShare * bounds_.ForEntry(d) / max_a;
}

// The encode of a blob that Scale (and ReLU) made from BatchNorm's output: its sign mask only,
// with x_norm_'s stream of this step and a copy of Scale's factors, when those keep the blob
// within eb; else the lossy encode as usual (x_norm_ kept dense this step, a factor or a value too
// large for the rounding margin). x_norm_'s encode, queued after BatchNorm's forward, may still
// be pending: the job waits for it on its own thread, so the step does not.
template <typename Dtype>
std::function<void(typename CometStore<Dtype>::Job*)> CometStore<Dtype>::RebuildOrLossy(
    const Entry& e, const Blob<Dtype>* blob, float eb, const std::function<void(Job*)>& lossy) {
  const int xn = e.rebuild_from;
  shared_ptr<Job> pending;  // x_norm_'s encode of this step, when not finished yet
  for (typename std::list<shared_ptr<Job> >::iterator j = jobs_.begin(); j != jobs_.end(); ++j)
    if ((*j)->entry == xn && (*j)->what == Job::ENCODE) pending = *j;
  const shared_ptr<CometPayload> finished = entries_[xn].stored;
  Layer<Dtype>* sl = net_->layers()[e.rebuild_scale].get();
  const size_t count = blob->count();
  const int channels = sl->blobs()[0]->count();
  if ((!pending && !finished) || blob->num_axes() < 2 || blob->shape(1) != channels) return lossy;
  std::vector<float> a(sl->blobs()[0]->cpu_data(), sl->blobs()[0]->cpu_data() + channels), b;
  if (sl->blobs().size() > 1) {
    const Blob<Dtype>* bias = sl->blobs()[1].get();
    if (bias->count() != channels) return lossy;
    b.assign(bias->cpu_data(), bias->cpu_data() + channels);
  }
  const float max_a = LargestFactor(a.data(), channels);
  if (!std::isfinite(max_a)) return lossy;  // the check below could not hold
  const size_t inner = count / (static_cast<size_t>(blob->shape(0)) * channels);
  const float slope = e.rebuild_relu < 0 ? 0.f :
      net_->layers()[e.rebuild_relu]->layer_param().relu_param().negative_slope();
  const bool relu = e.rebuild_relu >= 0;
  const float* data = reinterpret_cast<const float*>(blob->data()->cpu_data());
  const std::string name = e.blob;
  CometWorker* worker = worker_.get();
  return [=](Job* j) {
    shared_ptr<CometPayload> source = finished;
    if (pending) {  // jobs start in ticket order: x_norm_'s has started, maybe on another thread
      worker->Wait(pending->ticket);
      source = pending->error.empty() ? pending->payload : shared_ptr<CometPayload>();
    }
    if (!source || source->kind() != CometPayload::LOSSY || source->on_device() ||
        source->count() != count) {
      lossy(j);  // x_norm_ kept dense (or failed: its own job reports that)
      return;
    }
    const double error = max_a * source->eb;  // x_norm_'s error through the largest factor
    float y = 0;  // the largest magnitude, from the mask's pass where there is a mask
    shared_ptr<CometPayload> mask;
    bool finite = true;
    if (relu) {
      mask = CometEncodeMask(data, count, false, name, &y);
      finite = static_cast<bool>(mask);  // NULL for NaN or Inf
    } else {
      y = CometMaxAbs(data, count, &finite);
    }
    // NaN or Inf, or a value too large for the rounding margin: the lossy encode keeps it (or
    // says so).
    if (!finite || !(error + kRebuildRounding * (y + error) <= eb)) {
      lossy(j);
      return;
    }
    j->payload = CometMakeDerived(source, a, b, inner, mask, slope, name);
  };
}

// BatchNorm's x_norm_ holding a ReLU's zeros (the plan's x_norm_ties), with the BatchNorm
// corrections on: stored less each channel's value of those zeros (batchnorm_moments.hpp).
template <typename Dtype>
bool CometStore<Dtype>::ShiftsTies(const Entry& e) const {
  return e.layer >= 0 && plan_.lossy_x_norm[e.layer] == &e - &entries_[0] &&
         plan_.x_norm_ties[e.layer] && param_.centre_batchnorm_gradients();
}

// A BatchNorm layer (batch statistics) whose backward computes an input gradient from the x_norm_
// the store holds lossy this step, with centre_batchnorm_gradients: its moments and its gradient
// are corrected (layer_access.hpp, batchnorm_moments.hpp).
template <typename Dtype>
bool CometStore<Dtype>::LossyXNormFeedsBackward(int layer) const {
  const int x_norm = plan_.lossy_x_norm[layer];
  return x_norm >= 0 && param_.centre_batchnorm_gradients() &&
         net_->bottom_need_backward()[layer][0] && entries_[x_norm].stored &&
         entries_[x_norm].stored->kind() == CometPayload::LOSSY;
}

template <typename Dtype>
void CometStore<Dtype>::BeforeBackward(int layer) {
  last_forward_ = -2;
  SetContext(layer, "backward");
  ShareColumns(layer);
  if (worker_) {
    // Encodes left by a forward that stopped early; the decodes started for this layer.
    std::vector<shared_ptr<Job> > wait;
    const std::vector<int>& reads = plan_.backward_reads[layer];
    const std::vector<int>& own = plan_.private_of_layer[layer];  // rebuilt ahead
    for (typename std::list<shared_ptr<Job> >::iterator j = jobs_.begin(); j != jobs_.end(); ++j)
      if ((*j)->what == Job::ENCODE ||
          std::find(reads.begin(), reads.end(), (*j)->entry) != reads.end() ||
          std::find(own.begin(), own.end(), (*j)->entry) != own.end())
        wait.push_back(*j);
    for (int k = 0; k < wait.size(); ++k) Await(wait[k]);
    Harvest();
  }
  // This backward writes its bottoms' diffs: markers of freed diffs are dropped, not "read";
  // those it writes whole (not shared with a top's, as in place) are not zeroed first.
  const std::vector<Blob<Dtype>*>& bottoms = net_->bottom_vecs()[layer];
  const std::vector<Blob<Dtype>*>& tops = net_->top_vecs()[layer];
  for (int k = 0; k < bottoms.size(); ++k) {
    SyncedMemory* diff = bottoms[k]->diff().get();
    if (diff->comet_payload()) diff->comet_payload().reset();
    bool whole = plan_.facts[layer].fills_whole && net_->bottom_need_backward()[layer][k];
    for (int t = 0; t < tops.size() && whole; ++t) whole = tops[t]->diff().get() != diff;
    if (whole) CometMarkFill(diff);
  }
  const std::vector<int>& own = plan_.private_of_layer[layer];
  for (int k = 0; k < own.size(); ++k) {
    Entry& e = entries_[own[k]];
    if (e.action != RECOMPUTE || e.unread ||
        PrivateBuffer(e)->head() != SyncedMemory::UNINITIALIZED) {
      continue;
    }
    // LRN's backward reads the scale its forward computed: run the forward again (on the
    // restored input). Without recompute_lrn this happens only for a second backward after one
    // forward. An output the backward reads too (on the GPU) it writes where it was; one the
    // backward does not read (LRN's CPU backward computes it again, patch 0027) goes to a
    // scratch blob, so that the blob keeps what it holds now: nothing (freed), a ReLU mask or
    // compressed copy held for the layers above, or what an in-place layer above wrote there
    // (a Sigmoid's output, which a second backward and pycaffe read; found by scripts/fuzz_nets).
    const Clock::time_point start = Clock::now();
    std::vector<Blob<Dtype>*> outs = net_->top_vecs()[layer];
    std::vector<shared_ptr<Blob<Dtype> > > scratch;
    for (int t = 0; t < outs.size(); ++t) {
      if (plan_.facts[layer].read_top(t) != COMET_READS_NOTHING) continue;
      scratch.push_back(shared_ptr<Blob<Dtype> >(new Blob<Dtype>(outs[t]->shape())));
      outs[t] = scratch.back().get();
    }
    net_->layers()[layer]->Forward(net_->bottom_vecs()[layer], outs);
    const double ms = CometMsSince(start);
    e.encode_ms += ms;
    e.timing->wait_ms += ms;
  }
  for (int k = 0; k < own.size(); ++k) {
    Entry& e = entries_[own[k]];
    if (e.action != REBUILD || PrivateBuffer(e)->head() != SyncedMemory::UNINITIALIZED) continue;
    if (e.unread) {
      // MVN's temp_: the backward writes it whole first, into fresh memory, made now so that the
      // decodes ahead below see it in use.
      SyncedMemory* mem = PrivateBuffer(e);
      CometMarkFill(mem);
      if (Caffe::mode() == Caffe::CPU) mem->mutable_cpu_data();
      else mem->mutable_gpu_data();
      continue;
    }
    const Clock::time_point start = Clock::now();
    Layer<Dtype>* l = net_->layers()[layer].get();
    if (e.source >= 0) CometLayerAccess<Dtype>::RebuildScaleCopy(l, net_->layers()[e.source].get());
    else CometLayerAccess<Dtype>::RebuildBatchNormTemp(l);
    e.timing->DecodedInStep(CometMsSince(start));
  }
  if (param_.relu_masks() && plan_.facts[layer].relu_from_mask) ReluBackwardFromMask(layer);
  if (plan_.facts[layer].lrn_from_input && !own.empty() && entries_[own[0]].unread)
    LrnBackwardFromInput(layer);
  if (param_.pool_codes()) PoolBackwardFromCodes(layer);
  // BatchNorm reads its x_norm_ lossy: each channel back at the exact one's moments first.
  if (LossyXNormFeedsBackward(layer)) {
    CometLayerAccess<Dtype>::MatchBatchNormMoments(net_->layers()[layer].get(),
                                                   entries_[plan_.lossy_x_norm[layer]].stored->eb,
                                                   plan_.x_norm_ties[layer]);
  }
  if (measuring_) bounds_.BeforeBackward(layer);
  DecodeAhead(layer);  // while this layer's backward runs
}

// ReLU's backward needs only the signs of its input, which the store holds as a mask: it computes
// the gradient from the mask itself and tells Net to skip ReLU's own backward for this step, so
// the input is never restored (for a conv1-sized ReLU that is 300 MB not allocated and filled).
template <typename Dtype>
void CometStore<Dtype>::ReluBackwardFromMask(int layer) {
  const int b = net_->bottom_ids(layer)[0];
  if (plan_.entry_of_blob[b] < 0 || !net_->bottom_need_backward()[layer][0]) return;
  const Entry& e = entries_[plan_.entry_of_blob[b]];
  const CometPayload* mask = !e.stored ? NULL
                             : e.action == MASK ? e.stored.get() : e.stored->sign_mask.get();
  if (!mask) return;  // kept dense this step (NaN or Inf in the input): ReLU runs as usual
  CHECK_EQ(static_cast<size_t>(net_->bottom_vecs()[layer][0]->count()), mask->count())
      << "COMET: " << e.blob;
  const float slope = net_->layers()[layer]->layer_param().relu_param().negative_slope();
  // Codec time, not a wait: it takes the place of ReLU's own backward, which reads more.
  BackwardInPlaceOf(layer, e, mask->on_device(),
                    "the sign mask of blob '" + e.blob + "' is corrupt", "it",
                    "a corrupt sign mask", [&](const float* top_diff, float* bottom_diff,
                                               std::string* error) {
    return CometReluBackward(*mask, top_diff, bottom_diff, slope, error);
  });
}

// The store computes a layer's backward in its place (ReLU from its sign mask, max pooling from
// its codes): `compute(top_diff, bottom_diff, &error)` writes every value of the first bottom's
// diff from the first top's (device memory when `dev`), and Net skips the layer's own backward
// for this step: Net passes bottom_need_backward to it, and with the flag false the layer leaves
// the diff as it is (AfterBackward sets it back). On failure what it wrote is no gradient: freed,
// so that a reader who catches the error (pycaffe) and reads the diff fails too. `corrupt` and
// `it` word the error, `unfinished_by` the freed diff's marker.
template <typename Dtype>
void CometStore<Dtype>::BackwardInPlaceOf(
    int layer, const Entry& e, bool dev, const std::string& corrupt, const char* it,
    const std::string& unfinished_by,
    const std::function<bool(const float*, float*, std::string*)>& compute) {
  Blob<Dtype>* top = net_->top_vecs()[layer][0];
  Blob<Dtype>* bottom = net_->bottom_vecs()[layer][0];
  const Clock::time_point start = Clock::now();
  const float* top_diff = reinterpret_cast<const float*>(dev ? top->gpu_diff() : top->cpu_diff());
  CometFillWhole whole(bottom->diff().get());  // compute writes every value
  float* bottom_diff = reinterpret_cast<float*>(dev ? bottom->mutable_gpu_diff()
                                                    : bottom->mutable_cpu_diff());
  std::string error;
  if (!compute(top_diff, bottom_diff, &error)) {
    CometMarkReleased(bottom->diff().get(), "diff of blob '" +
                      net_->blob_names()[net_->bottom_ids(layer)[0]] + "', left unfinished by " +
                      unfinished_by + ",");
    CometFatal("COMET: " + corrupt + " (" + error + "), read by " + CometReadContext() +
               "; refusing to use " + it);
    return;
  }
  e.timing->decode_ms += CometMsSince(start);
  const_cast<std::vector<bool>&>(net_->bottom_need_backward()[layer])[0] = false;
  backward_skipped_[layer] = true;
}

// LRN within a channel: its input gradient from its input and output gradient (lrn_within.hpp),
// on the CPU or the GPU, in place of upstream's chain of internal layers, whose outputs were freed
// after the forward and whose gradients are then never allocated. Net skips LRN's own backward
// for this step, as for ReLU from its mask.
template <typename Dtype>
void CometStore<Dtype>::LrnBackwardFromInput(int layer) {
  if (!net_->bottom_need_backward()[layer][0]) return;
  Blob<Dtype>* top = net_->top_vecs()[layer][0];
  Blob<Dtype>* bottom = net_->bottom_vecs()[layer][0];
  CHECK_EQ(bottom->num_axes(), 4) << "COMET: LRN " << net_->layer_names()[layer];
  const LRNParameter& p = net_->layers()[layer]->layer_param().lrn_param();
  const int planes = bottom->shape(0) * bottom->shape(1);
  CometFillWhole whole(bottom->diff().get());  // every value is written
  if (Caffe::mode() == Caffe::GPU) {
#ifndef CPU_ONLY
    CometLrnWithinBackwardGpu(p, planes, bottom->shape(2), bottom->shape(3),
                              reinterpret_cast<const float*>(bottom->gpu_data()),
                              reinterpret_cast<const float*>(top->gpu_diff()),
                              reinterpret_cast<float*>(bottom->mutable_gpu_diff()));
#else
    NO_GPU;
#endif
  } else {
    CometLrnWithinBackward(p, planes, bottom->shape(2), bottom->shape(3),
                           reinterpret_cast<const float*>(bottom->cpu_data()),
                           reinterpret_cast<const float*>(top->cpu_diff()),
                           reinterpret_cast<float*>(bottom->mutable_cpu_diff()));
  }
  const_cast<std::vector<bool>&>(net_->bottom_need_backward()[layer])[0] = false;
  backward_skipped_[layer] = true;
}

// pool_codes: every max pooling layer whose argmax the layer keeps (one top); whether its
// argmax is stored as codes is asked at each forward (the plan may change).
template <typename Dtype>
void CometStore<Dtype>::TakePoolForwards(bool take) {
  for (typename std::map<const Layer<Dtype>*, int>::iterator it = pool_layers_.begin();
       it != pool_layers_.end(); ++it) {
    CometPoolCodes<Dtype>::Register(it->first, NULL);
  }
  pool_layers_.clear();
  // The codes hold float maxima only: a double net keeps the layer's own forward.
  if (!take || !param_.pool_codes() || !param_.layer_buffers() || sizeof(Dtype) != sizeof(float))
    return;
  for (int l = 0; l < net_->layers().size(); ++l) {
    Layer<Dtype>* layer = net_->layers()[l].get();
    if (!CometLayerAccess<Dtype>::argmax(layer)) continue;
    pool_layers_[layer] = l;
    CometPoolCodes<Dtype>::Register(layer, this);
  }
}

template <typename Dtype>
int CometStore<Dtype>::ArgmaxEntry(int layer) const {
  const std::vector<int>& own = plan_.private_of_layer[layer];
  for (int k = 0; k < own.size(); ++k)
    if (entries_[own[k]].action == ARGMAX) return own[k];
  return -1;
}

// Max pooling's forward in the net's forward pass, its argmax written as codes and held at once
// (the payload StorePrivate would have made from the dense argmax after the layer's forward).
template <typename Dtype>
bool CometStore<Dtype>::TakeForward(const Layer<Dtype>* layer, const Blob<Dtype>* bottom,
                                    Blob<Dtype>* top, bool on_device) {
  typename std::map<const Layer<Dtype>*, int>::const_iterator it = pool_layers_.find(layer);
  if (it == pool_layers_.end()) return false;
  const int l = it->second;
  const int x = ArgmaxEntry(l);
  // Only inside this net's forward of the layer (BeforeForward ran for it): a Forward called
  // from elsewhere computes as upstream.
  if (x < 0 || last_forward_ != l || context_pass_ != kForward) return false;
  Entry& e = entries_[x];
  Layer<Dtype>* pool = net_->layers()[l].get();
  SyncedMemory* mem = PrivateBuffer(e);
  if (!mem->comet_can_release()) return false;
  const size_t count = CometLayerAccess<Dtype>::argmax(pool)->count();
  if (static_cast<size_t>(top->count()) != count) return false;
  const Clock::time_point start = Clock::now();
  const float* in =
      reinterpret_cast<const float*>(on_device ? bottom->gpu_data() : bottom->cpu_data());
  float* out =
      reinterpret_cast<float*>(on_device ? top->mutable_gpu_data() : top->mutable_cpu_data());
  shared_ptr<CometPayload> p = CometPoolToCodes(in, out, count,
                                                CometLayerAccess<Dtype>::geometry(pool),
                                                on_device, e.blob);
  if (!p) return false;  // a geometry codes cannot hold: the layer's forward runs
  Hold(&e, mem, p);
  // Codec time, as ReLU's backward from its mask: it takes the place of the layer's forward.
  e.encode_ms += CometMsSince(start);
  e.samples += 1;
  return true;
}

// Max pooling's backward from the codes its forward left: the argmax is never unpacked (72 MB
// of int32 at CaffeNet's pool1 at batch 256), and Net skips the layer's own backward.
template <typename Dtype>
void CometStore<Dtype>::PoolBackwardFromCodes(int layer) {
  const int x = ArgmaxEntry(layer);
  if (x < 0 || !net_->layer_need_backward()[layer]) return;
  const Entry& e = entries_[x];
  // Dense (restored for a reader, or kept this step): the layer's own backward reads it.
  if (!net_->bottom_need_backward()[layer][0] || !e.stored ||
      e.stored->kind() != CometPayload::ARGMAX || PrivateBuffer(e)->comet_payload() != e.stored) {
    return;
  }
  const CometPayload& codes = *e.stored;
  const comet_codes::PoolGeometry& g = codes.pool;
  CHECK_EQ(static_cast<size_t>(net_->top_vecs()[layer][0]->count()), codes.count())
      << "COMET: " << e.blob;
  CHECK_EQ(static_cast<size_t>(net_->bottom_vecs()[layer][0]->count()),
           codes.count() / (static_cast<size_t>(g.pooled_height) * g.pooled_width) * g.height *
               g.width) << "COMET: " << e.blob;
  BackwardInPlaceOf(layer, e, codes.on_device(),
                    "the argmax codes of '" + e.blob + "' are corrupt", "them",
                    "corrupt argmax codes", [&](const float* top_diff, float* bottom_diff,
                                                std::string* error) {
    return CometPoolBackwardFromCodes(codes, top_diff, bottom_diff, error);
  });
}

template <typename Dtype>
void CometStore<Dtype>::AfterBackward(int layer) {
  DropFillMarkers(layer, true);
  CheckSharing(layer, true);
  if (worker_) Harvest();
  // A decode during this backward (a restore) held device scratch for a moment: noted on top of
  // what is held now, before anything is freed again.
  const size_t transient = CometTakeTransientPeak();
  if (transient) {
    Sample();
    stats_.NoteTransient(transient);
  }
  // BatchNorm read its x_norm_ lossy: each channel of its input gradient sums to 0 again (a
  // channel moved back to its moments already does, but for rounding).
  if (LossyXNormFeedsBackward(layer)) {
    CometLayerAccess<Dtype>::CentreBatchNormInputGradient(net_->layers()[layer].get(),
                                                          net_->bottom_vecs()[layer][0]);
  }
  if (measuring_) bounds_.AfterBackward(layer);
  if (backward_skipped_[layer]) {
    const_cast<std::vector<bool>&>(net_->bottom_need_backward()[layer])[0] = true;
    backward_skipped_[layer] = false;
    // Net's debug info (solver `debug_info: true`) skipped the bottom it was told not to
    // propagate to: the line it would have logged (Net::BackwardDebugInfo's format, patch 0041).
    if (net_->debug_info()) {
      const Blob<Dtype>& b = *net_->bottom_vecs()[layer][0];
      LOG_IF(INFO, Caffe::root_solver())
          << "    [Backward] Layer " << net_->layer_names()[layer] << ", bottom blob "
          << net_->blob_names()[net_->bottom_ids(layer)[0]] << " diff: "
          << b.asum_diff() / b.count();
    }
  }
  const std::vector<int>& todo = plan_.after_backward[layer];
  for (int t = 0; t < todo.size(); ++t) {
    Entry& e = entries_[todo[t]];
    if (e.action == RECOMPUTE || e.action == REBUILD) {
      PrivateBuffer(e)->comet_release();
      continue;
    }
    SyncedMemory* mem = EntryMemory(e);
    if (!mem->comet_can_release() || !e.stored) continue;
    // In a step, what the store holds goes with the last reader (keep_compressed: until the
    // next forward, for a second Backward() or a read after the step).
    const bool drop = in_step_ && !param_.keep_compressed();
    const bool decoded = !mem->comet_payload();  // else: a mask read as it is, codes, ...
    if (drop && (decoded || mem->comet_payload() == e.stored)) {
      CometMarkReleased(mem, EntryWhat(e), "keep_compressed: true");
      e.stored.reset();
      continue;
    }
    if (!decoded) continue;
    mem->comet_release();  // decoded for backward; the compressed copy goes back on
    mem->comet_payload() = e.stored;
  }
  // LRN within a channel: its internal layers' gradients (five, each as large as its input) are
  // written and read inside its backward only.
  const std::vector<Blob<Dtype>*> internal =
      param_.release_diffs() && plan_.facts[layer].private_buffer == CometLayerFacts::LRN_WITHIN
          ? CometLayerAccess<Dtype>::lrn_internal_diffs(net_->layers()[layer].get())
          : std::vector<Blob<Dtype>*>();
  for (int k = 0; k < internal.size(); ++k) internal[k]->diff()->comet_release();
  const std::vector<int>& diffs = plan_.diff_release[layer];
  for (int k = 0; k < diffs.size(); ++k) {
    SyncedMemory* mem = net_->blobs()[diffs[k]]->diff().get();
    if (mem->comet_can_release() && mem->head() != SyncedMemory::UNINITIALIZED)
      CometMarkReleased(mem, "diff of blob '" + net_->blob_names()[diffs[k]] + "'");
  }
  Sample();
  SetContext(-1, kBetweenLayers);
}

template <typename Dtype>
void CometStore<Dtype>::Sample() {
  sample_buffers_.clear();
  sample_scratch_.clear();
  for (int e = 0; e < entries_.size(); ++e) {
    const Entry& en = entries_[e];
    if (en.layer < 0) continue;
    // MVN's temp_: scratch of one pass, not an activation
    (en.buffer == REBUILD && en.unread ? sample_scratch_ : sample_buffers_).push_back(PrivateBuffer(en));
  }
  if (columns_max_) sample_scratch_.push_back(columns_.data().get());
  // the weight rule's samples of its inputs, host memory (not the device's on the GPU)
  stats_.Sample(entries_, sample_buffers_, sample_scratch_,
                Caffe::mode() == Caffe::CPU ? bounds_.SampleBytes() : 0);
}

// Convolutions keep a column buffer each (one image's im2col, for a 3x3 kernel nine times the
// input image) for good, but each pass writes all of it before reading it, and layers run one at
// a time: before each pass the layer's buffer becomes the one they all share, as large as the
// largest of theirs. The count a layer's Reshape may grow to without reallocating (its own
// capacity) is one seen before, here or at the start, so the shared memory is never too small;
// a layer that grows past it allocates its own again, until its next pass.
template <typename Dtype>
void CometStore<Dtype>::ShareColumns(int layer) {
  Blob<Dtype>* cols = ColumnsOf(layer);
  if (!cols || cols->count() == 0) return;
  GrowColumns(cols->count());
  columns_.Reshape(cols->shape());  // within its capacity: the same memory
  if (cols->data() != columns_.data()) cols->ShareData(columns_);
}

// The column buffer of layer i when the store shares it (a convolution of Caffe's engine, with
// layer_buffers), else NULL.
template <typename Dtype>
Blob<Dtype>* CometStore<Dtype>::ColumnsOf(int i) const {
  if (!param_.layer_buffers() || plan_.facts[i].private_buffer != CometLayerFacts::CONV_COLUMNS)
    return NULL;
  return CometLayerAccess<Dtype>::columns(net_->layers()[i].get());
}

// The shared column buffer at least `count` values large (its largest count so far).
template <typename Dtype>
void CometStore<Dtype>::GrowColumns(int count) {
  if (count <= columns_max_) return;
  columns_max_ = count;
  columns_.Reshape(std::vector<int>(1, columns_max_));
}

template <typename Dtype>
void CometStore<Dtype>::on_start() {
  in_step_ = true;
  passes_in_step_ = 0;
  const int iter = solver_->iter();
  // Measure the error estimate on the iterations where the bounds are revisited.
  // Fixed bounds are measured once, on the first such step, for the log (bounds.hpp).
  auditing_ = bounds_.Audits();
  measuring_ = (param_.eb_mode() == CometParameter_ErrorBoundMode_ADAPTIVE &&
                param_.update_interval() > 0 && iter % param_.update_interval() == 0) ||
               auditing_;
  if (Caffe::mode() == Caffe::CPU && !flushing_) {
    float_mode_ = CometFlushDenormals();
    CometGemm::SetBlasThreadsMode(CometFloatMode());  // products below the tiles' size run there
    flushing_ = true;
  }
}

template <typename Dtype>
void CometStore<Dtype>::StopFlushing() {
  if (!flushing_) return;
  CometSetFloatMode(float_mode_);
  CometGemm::SetBlasThreadsMode(float_mode_);
  flushing_ = false;
}

template <typename Dtype>
void CometStore<Dtype>::on_gradients_ready() {
  in_step_ = false;
  FinishAll();  // decodes started for readers that did not come (a backward stopped early)
  measuring_ = false;
  if (auditing_) bounds_.EndAudit();
  auditing_ = false;
  StopFlushing();
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
