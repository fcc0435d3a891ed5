#ifndef CAFFE_COMET_STORE_HPP_
#define CAFFE_COMET_STORE_HPP_

#include <fstream>
#include <string>
#include <vector>

#include "caffe/comet/payload.hpp"
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
class CometStore : public Solver<Dtype>::Callback {
 public:
  // The store for solver's train net, or NULL when the solver has no enabled comet block.
  static shared_ptr<CometStore<Dtype> > Attach(Solver<Dtype>* solver);
  CometStore(Solver<Dtype>* solver, const CometParameter& param);
  virtual ~CometStore();

  // LOSSY, MASK, RELEASE, KEEP: net blobs. ARGMAX, BINARY, RECOMPUTE: a layer's private buffer
  // (max pooling's argmax and Dropout's mask as packed codes; LRN's scale freed and recomputed).
  enum Action { KEEP = 0, RELEASE, LOSSY, MASK, ARGMAX, BINARY, RECOMPUTE };
  static const char* ActionName(Action a);

  // One group of net blobs sharing the same data memory (in-place layers, Split, Flatten, ...),
  // or one layer-private buffer.
  struct Entry {
    Entry()
        : layer(-1), action(KEEP), signs(false), last_forward(-1), last_backward(-1),
          timing(new CometTiming()), dense_bytes(0), stored_bytes(0), encode_ms(0), eb_sum(0),
          samples(0), last_ratio(0), last_ms(0), last_eb(0), last_dense(0), last_stored(0) {}
    std::string name;            // what the log calls it: the reading layer(s)
    std::string blob;            // first blob name, or "<layer> argmax|mask|scale"
    std::vector<int> blob_ids;   // empty for a layer-private buffer
    int layer;                   // the layer owning a private buffer, else -1
    Action action;
    bool signs;                  // LOSSY read by ReLU too: a sign mask is stored alongside
    int last_forward;            // compress/release after this layer's forward
    int last_backward;           // free again after this layer's backward (-1: none)
    std::vector<int> eb_layers;  // LOSSY: indices into bounds_ of the layers reading it
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
  // The error bound of one Convolution/InnerProduct/LRN layer whose input is stored lossy.
  struct Bound {
    std::string layer;
    int layer_id;
    float eb;
    bool fixed;        // set by the layer's comet_param.error_bound
    bool adapt;        // the adaptive rule applies (Convolution, InnerProduct)
    int follow;        // LRN in ADAPTIVE mode: index of the bound it takes (-1: its own)
  };

  const std::vector<Entry>& entries() const { return entries_; }
  const std::vector<Bound>& bounds() const { return bounds_; }
  const CometMemory& memory() const { return memory_; }
  const CometParameter& param() const { return param_; }
  int last_report_iter() const { return last_report_iter_; }
  std::string Plan() const;  // human-readable plan, one line per entry

  float bound(const std::string& layer) const;
  void set_bound(const std::string& layer, float eb);

  void Save(const std::string& filename) const;
  void Load(const std::string& solverstate_filename);

 protected:
  virtual void on_start();
  virtual void on_gradients_ready();

 private:
  class Hook;
  void MakePlan();
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
  float EntryBound(const Entry& e) const;
  float bound(int b) const;  // effective bound of bounds_[b]
  bool Measures(int layer) const;

  Solver<Dtype>* solver_;
  Net<Dtype>* net_;
  CometParameter param_;
  std::vector<Entry> entries_;
  std::vector<Bound> bounds_;
  std::vector<std::vector<int> > after_forward_;    // layer -> entries
  std::vector<std::vector<int> > after_backward_;   // layer -> entries
  std::vector<std::vector<int> > diff_release_;     // layer -> blob ids whose diff is freed
  std::vector<std::vector<int> > tops_written_;     // layer -> blob ids overwritten by forward
  std::vector<int> entry_of_blob_;                  // blob -> index into entries_ or -1
  std::vector<int> bound_of_layer_;                 // layer -> index into bounds_ or -1
  std::vector<std::vector<int> > private_of_layer_;  // layer -> its private-buffer entries
  std::vector<bool> relu_skipped_;                  // layer -> backward done from the mask
  std::vector<double> top_diff_sumsq_;              // layer -> ||dy||^2 (measuring iteration)
  std::vector<shared_ptr<Hook> > hooks_;
  CometMemory memory_;
  bool measuring_;
  int last_report_iter_;
  std::string stats_path_;
  std::ofstream stats_;
};

}  // namespace caffe

#endif  // CAFFE_COMET_STORE_HPP_
