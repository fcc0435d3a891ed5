#ifndef CAFFE_COMET_STORE_HPP_
#define CAFFE_COMET_STORE_HPP_

#include <fstream>
#include <functional>
#include <list>
#include <map>
#include <string>
#include <vector>

#include "caffe/comet/bounds.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/plan.hpp"
#include "caffe/comet/pool_codes.hpp"
#include "caffe/comet/statistics.hpp"
#include "caffe/comet/stream.hpp"
#include "caffe/comet/worker.hpp"
#include "caffe/net.hpp"
#include "caffe/proto/caffe.pb.h"
#include "caffe/solver.hpp"

namespace caffe {

// The activation store of a train net (docs/comet.md). After the last forward reader of a blob
// whose data some backward step needs, it compresses the data (lossy for the inputs of the layer
// types in compress_type, a bit mask when only ReLU reads it) and frees the dense memory; the
// first backward access restores it (SyncedMemory hook), and the store frees it again after the
// last backward reader. Blobs no backward step reads are freed after their last forward reader;
// activation diffs are freed after their last backward use. Error bounds adapt per layer.
template <typename Dtype>
class CometStore : public Solver<Dtype>::Callback, public CometActions,
                   public CometPoolCodes<Dtype>::Taker {
 public:
  // The store for solver's train net, or NULL when the solver has no enabled comet block.
  static shared_ptr<CometStore<Dtype> > Attach(Solver<Dtype>* solver);
  CometStore(Solver<Dtype>* solver, const CometParameter& param);
  virtual ~CometStore();

  typedef CometEntry Entry;
  typedef CometPlanBound Bound;

  const std::vector<Entry>& entries() const { return entries_; }
  const std::vector<Bound>& bounds() const { return bounds_.all(); }
  const CometMemory& memory() const { return stats_.memory(); }
  size_t error_sample_bytes() const { return bounds_.SampleBytes(); }  // measuring iterations
  const CometParameter& param() const { return param_; }
  size_t jobs_queued() const { return jobs_.size(); }  // encodes and decodes not finished yet
  int last_report_iter() const { return stats_.last_report_iter(); }
  std::string Plan() const;  // human-readable plan, one line per entry

  float bound(const std::string& layer) const { return bounds_.Of(layer); }
  void set_bound(const std::string& layer, float eb) { bounds_.Set(layer, eb); }

  void Save(const std::string& filename) const;
  void Load(const std::string& solverstate_filename);
  // Solver::Step's end, however it ends (CometStepScope): the thread's floating-point mode of
  // before the step is back, also after an exception inside the step (a Python layer's).
  void EndStep() { StopFlushing(); }

 protected:
  virtual void on_start();
  virtual void on_gradients_ready();
  // Max pooling's forward with the argmax straight into codes (comet { pool_codes }).
  virtual bool TakeForward(const Layer<Dtype>* layer, const Blob<Dtype>* bottom, Blob<Dtype>* top,
                           bool on_device);

 private:
  class Hook;
  // What a net that outlives the store keeps of it (LeaveNet, at the store's end).
  struct Orphan;
  void LeaveNet();
  // (Re)plans from the net as it is now and the aliases found so far; entries that keep their
  // blob keep what they stored.
  void MakePlan();
  // Caffe's mode changed since the plan was made (pycaffe: caffe.set_mode_gpu() after
  // get_solver): plans for it, at the start of a whole forward pass.
  void FollowMode();
  // The memory a layer's blobs hold now against the plan's groups; a new share re-plans.
  void CheckSharing(int layer, bool diff);
  // The layer and pass running now, for the message of a read of freed memory (formatted only
  // when one is written: Reader).
  class Reader;
  void SetContext(int layer, const char* pass) {
    context_layer_ = layer;
    context_pass_ = pass;
    context_iter_ = solver_->iter();
  }
  void BeforeForward(int layer);
  void AfterForward(int layer);
  void BeforeBackward(int layer);
  void AfterBackward(int layer);
  void DropFillMarkers(int layer, bool diff);
  SyncedMemory* PrivateBuffer(const Entry& e) const;
  SyncedMemory* EntryMemory(const Entry& e) const;  // the memory an entry stores
  void StorePrivate(Entry* e);
  bool LossyXNormFeedsBackward(int layer) const;
  void Hold(Entry* e, SyncedMemory* mem, const shared_ptr<CometPayload>& p);
  void ReluBackwardFromMask(int layer);
  void LrnBackwardFromInput(int layer);
  void BackwardInPlaceOf(int layer, const Entry& e, bool dev, const std::string& corrupt,
                         const char* it, const std::string& unfinished_by,
                         const std::function<bool(const float*, float*, std::string*)>& compute);
  // pool_codes: the layers whose forward this store takes (true) or none any more (false), and
  // a max pooling layer's backward from its codes.
  void TakePoolForwards(bool take);
  void PoolBackwardFromCodes(int layer);
  int ArgmaxEntry(int layer) const;  // the layer's ARGMAX entry, or -1
  void Sample();
  // The step's end (or the store's): the float mode before the step back on this thread and on
  // OpenBLAS's (float_mode.hpp, CometGemm::SetBlasThreadsMode).
  void StopFlushing();

  // An encode after a blob's last forward reader, or a decode started a backward layer ahead of
  // its reader (comet { async }, CPU mode; docs/comet.md#asynchronous-work).
  struct Job;
  // Runs the job's work now, in the step with every core, or queues it on the worker.
  void Start(const shared_ptr<Job>& job, bool on_worker);
  // An encode or decode: on the worker when there is one (device memory: with side_stream_).
  void StartCoding(const shared_ptr<Job>& job, bool device);
  void Finish(Job* job);                  // on the step's thread, once the work has run
  void Await(shared_ptr<Job> job);        // waits for it (the step's wait), then Finish
  void Harvest();                         // finishes what has run, without waiting
  void FinishAll();
  void DecodeAhead(int layer);            // the stored inputs of the next backward layers
  void DecodeAheadRebuilt(int entry, const shared_ptr<CometPayload>& p, size_t allocating);
  void RebuildAhead(int entry);           // a REBUILD buffer of the next backward layers
  bool PoolHasRoomFor(size_t bytes) const;  // below the (host or device) pool's peak in use
  bool MayDecodeAhead(size_t bytes, size_t now) const;
  size_t BackwardAllocates(int layer) const;
  void MakeRoomForForward(int layer);       // waits for encodes whose memory would raise it
  // The lossy encode of `count` values at `data` (a blob, or x_norm_ or PReLU's copy), with a
  // sign mask beside the stream when `signs`; `what` names it in the note of a value the mask
  // cannot hold.
  static std::function<void(Job*)> LossyWork(const float* data, const std::vector<int>& shape,
                                             size_t count, bool dev, float eb,
                                             const std::string& name, const std::string& what,
                                             bool signs);
  bool ShiftsTies(const Entry& e) const;  // x_norm_ encoded less its ReLU zeros' values
  // A blob rebuilt from BatchNorm's x_norm_ (plan entry rebuild_from, CPU mode).
  float RebuildBound(const Entry& x_norm) const;
  std::function<void(Job*)> RebuildOrLossy(const Entry& e, const Blob<Dtype>* blob, float eb,
                                           const std::function<void(Job*)>& lossy);

  Solver<Dtype>* solver_;
  Net<Dtype>* net_;
  CometParameter param_;
  CometBounds<Dtype> bounds_;                       // plan_.bounds as they adapt
  CometPlan plan_;
  CometAliases data_aliases_, diff_aliases_;        // sharing found at run time
  std::map<const SyncedMemory*, int> seen_data_, seen_diff_;  // this step: memory -> group
  std::vector<Entry> entries_;                      // plan_.entries with what was done
  std::vector<bool> backward_skipped_;  // layer -> backward done by the store (mask, codes)
  std::map<const Layer<Dtype>*, int> pool_layers_;  // layers whose forward it takes -> index
  std::vector<shared_ptr<Hook> > hooks_;
  CometStatistics<Dtype> stats_;
  // The column buffer every convolution of the net shares (ShareColumns), and the largest count
  // any of theirs had.
  Blob<Dtype> columns_;
  int columns_max_;
  void ShareColumns(int layer);
  Blob<Dtype>* ColumnsOf(int layer) const;
  void GrowColumns(int count);
  // Sample's private buffers, and those of them that are scratch, kept to spare an allocation
  std::vector<const SyncedMemory*> sample_buffers_, sample_scratch_;
  shared_ptr<Reader> reader_;
  int context_layer_, context_iter_;  // layer -1: outside a step (context_pass_ says where)
  const char* context_pass_;
  // The layer this forward pass began at (0 in a training step; pycaffe's forward(start=...)
  // begins later), and the last layer whose forward ran (-2 once a backward ran).
  int forward_from_, last_forward_;
  // The bounds are measured on a step's first forward and backward pass alone: with iter_size
  // above 1 the later passes add their gradients to the first's, which the rules would take for
  // one batch's (a target up to iter_size times too large, a bound doubled once a pass).
  bool measuring_;
  bool auditing_;  // this step measures fixed bounds not yet audited
  int passes_in_step_;  // whole forward passes since on_start
  Caffe::Brew plan_mode_;  // the mode the plan is for: some layers' facts depend on it
  shared_ptr<CometWorker> worker_;        // NULL without comet { async }
  shared_ptr<CometSideStream> side_stream_;  // GPU mode with async: the device jobs' stream
  std::list<shared_ptr<Job> > jobs_;      // queued on the worker, not finished yet
  size_t in_flight_, max_in_flight_;      // dense bytes the jobs hold, and the cap
  bool tiled_gemm_;                       // CometGemm::Use'd while this store lives
  // CPU: the step (on_start to on_gradients_ready) runs with denormals flushed to zero
  // (float_mode.hpp); the thread's mode before it, given back after.
  bool flushing_;
  bool in_step_;  // between on_start and on_gradients_ready: a solver step (keep_compressed)
  unsigned float_mode_;
};

// A comet { } block that solvers whose parameter has none take on, in Solver::Init (patch 0009)
// before the train net is built. None unless a test runner sets one: scripts/test runs upstream's
// own solver tests once more with the store on this way (COMET_EVERY_SOLVER,
// test_comet_every_solver.cpp).
void CometSetBlockForSolversWithout(const CometParameter& block);
void CometGiveBlockIfWithout(SolverParameter* param);

// Made at the top of Solver::Step (patch 0009) with the solver's store, or NULL.
template <typename Dtype>
class CometStepScope {
 public:
  explicit CometStepScope(CometStore<Dtype>* store) : store_(store) {}
  ~CometStepScope() {
    if (store_) store_->EndStep();
  }

 private:
  CometStore<Dtype>* store_;
  DISABLE_COPY_AND_ASSIGN(CometStepScope);
};

}  // namespace caffe

#endif  // CAFFE_COMET_STORE_HPP_
