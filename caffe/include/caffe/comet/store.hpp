#ifndef CAFFE_COMET_STORE_HPP_
#define CAFFE_COMET_STORE_HPP_

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "caffe/comet/bounds.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/plan.hpp"
#include "caffe/net.hpp"
#include "caffe/proto/caffe.pb.h"
#include "caffe/solver.hpp"

namespace caffe {

// Current and peak bytes held by the train net, by kind, sampled at every layer boundary.
struct CometMemory {
  enum Kind { WEIGHTS = 0, ACTIVATIONS, GRADIENTS, COMPRESSED, SCRATCH, NUM_KINDS };
  static const char* name(int kind);
  CometMemory() : peak_total(0) {
    for (int k = 0; k < NUM_KINDS; ++k) current[k] = peak[k] = at_peak[k] = 0;
  }
  size_t total() const {
    size_t t = 0;
    for (int k = 0; k < NUM_KINDS; ++k) t += current[k];
    return t;
  }
  size_t current[NUM_KINDS];
  size_t peak[NUM_KINDS];     // each kind's own maximum
  size_t at_peak[NUM_KINDS];  // the split of the total at its peak
  size_t peak_total;
};

// The activation store of a train net (docs/comet.md). After the last forward reader of a blob
// whose data some backward step needs, it compresses the data (lossy for the inputs of the layer
// types in compress_type, a bit mask when only ReLU reads it) and frees the dense memory; the
// first backward access restores it (SyncedMemory hook), and the store frees it again after the
// last backward reader. Blobs no backward step reads are freed after their last forward reader;
// activation diffs are freed after their last backward use. Error bounds adapt per layer.
template <typename Dtype>
class CometStore : public Solver<Dtype>::Callback, public CometActions {
 public:
  // The store for solver's train net, or NULL when the solver has no enabled comet block.
  static shared_ptr<CometStore<Dtype> > Attach(Solver<Dtype>* solver);
  CometStore(Solver<Dtype>* solver, const CometParameter& param);
  virtual ~CometStore();

  // A planned entry (plan.hpp) with what the store did with it.
  struct Entry : public CometPlanEntry {
    explicit Entry(const CometPlanEntry& planned = CometPlanEntry())
        : CometPlanEntry(planned), timing(new CometTiming()), dense_bytes(0), stored_bytes(0),
          encode_ms(0), eb_sum(0), samples(0), last_ratio(0), last_ms(0), last_eb(0),
          last_dense(0), last_stored(0) {}
    shared_ptr<CometTiming> timing;
    // The payload of the last forward: it goes back onto the memory after the last backward
    // reader, so a second backward or a later read decodes it again instead of reading zeros.
    shared_ptr<CometPayload> stored;
    // current display window
    double dense_bytes, stored_bytes, encode_ms, eb_sum;
    int samples;
    // last reported window
    double last_ratio, last_ms, last_eb;
    size_t last_dense, last_stored;
  };
  typedef CometPlanBound Bound;

  const std::vector<Entry>& entries() const { return entries_; }
  const std::vector<Bound>& bounds() const { return bounds_.all(); }
  const CometMemory& memory() const { return memory_; }
  const CometParameter& param() const { return param_; }
  int last_report_iter() const { return last_report_iter_; }
  std::string Plan() const;  // human-readable plan, one line per entry

  float bound(const std::string& layer) const { return bounds_.Of(layer); }
  void set_bound(const std::string& layer, float eb) { bounds_.Set(layer, eb); }

  void Save(const std::string& filename) const;
  void Load(const std::string& solverstate_filename);

 protected:
  virtual void on_start();
  virtual void on_gradients_ready();

 private:
  class Hook;
  // (Re)plans from the net as it is now and the aliases found so far; entries that keep their
  // blob keep what they stored.
  void MakePlan();
  // The memory a layer's blobs hold now against the plan's groups; a new share re-plans.
  void CheckSharing(int layer, bool diff);
  // Names the layer and pass running now, for the message of a read of freed memory.
  void SetContext(int layer, const char* pass);
  void BeforeForward(int layer);
  void AfterForward(int layer);
  void BeforeBackward(int layer);
  void AfterBackward(int layer);
  SyncedMemory* PrivateBuffer(const Entry& e) const;
  SyncedMemory* EntryMemory(const Entry& e) const;  // the memory an entry stores
  void StorePrivate(Entry* e);
  void ReluBackwardFromMask(int layer);
  void Sample();
  void Report();

  Solver<Dtype>* solver_;
  Net<Dtype>* net_;
  CometParameter param_;
  CometBounds<Dtype> bounds_;                       // plan_.bounds as they adapt
  CometPlan plan_;
  CometAliases data_aliases_, diff_aliases_;        // sharing found at run time
  std::map<const SyncedMemory*, int> seen_data_, seen_diff_;  // this step: memory -> group
  std::vector<Entry> entries_;                      // plan_.entries with what was done
  std::vector<bool> relu_skipped_;                  // layer -> backward done from the mask
  std::vector<shared_ptr<Hook> > hooks_;
  CometMemory memory_;
  bool measuring_;
  int last_report_iter_;
  std::string stats_path_;
  std::ofstream stats_;
};

}  // namespace caffe

#endif  // CAFFE_COMET_STORE_HPP_
