#ifndef CAFFE_COMET_STATISTICS_HPP_
#define CAFFE_COMET_STATISTICS_HPP_

// COMET-Caffe: what the store measures and reports. Memory held by the train net, sampled at
// every layer boundary, and per entry the bytes before and after, the bound and the time of the
// current display window; at each display the log lines (COMET <layer>: ..., COMET total: ...)
// and the rows of <prefix>_comet.csv.

#include <fstream>
#include <string>
#include <vector>

#include "caffe/comet/payload.hpp"
#include "caffe/comet/plan.hpp"
#include "caffe/net.hpp"
#include "caffe/proto/caffe.pb.h"
#include "caffe/syncedmem.hpp"

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

// A planned entry (plan.hpp) with what the store did with it.
struct CometEntry : public CometPlanEntry {
  explicit CometEntry(const CometPlanEntry& planned = CometPlanEntry())
      : CometPlanEntry(planned), timing(new CometTiming()), dense_bytes(0), stored_bytes(0),
        encode_ms(0), eb_sum(0), samples(0), last_ratio(0), last_ms(0), last_eb(0),
        last_encode_ms(0), last_decode_ms(0), last_wait_ms(0), last_dense(0), last_stored(0) {}
  shared_ptr<CometTiming> timing;
  // The payload of the last forward: it goes back onto the memory after the last backward
  // reader, so a second backward or a later read decodes it again instead of reading zeros.
  shared_ptr<CometPayload> stored;
  // current display window
  double dense_bytes, stored_bytes, encode_ms, eb_sum;
  int samples;
  // last reported window; times per iteration: encode and decode wherever they ran (last_ms
  // is their sum), and the part of them the step waited for
  double last_ratio, last_ms, last_eb, last_encode_ms, last_decode_ms, last_wait_ms;
  size_t last_dense, last_stored;
};

template <typename Dtype>
class CometStatistics {
 public:
  CometStatistics(const Net<Dtype>* net, const CometParameter& param)
      : net_(net), param_(param), last_report_iter_(-1) {}
  // Where the rows go (empty: the log only); the file is appended to, its header written once.
  void set_path(const std::string& path) { path_ = path; }
  // The memory held now: the net's blobs and weights, the entries' payloads and the layers'
  // private buffers (each memory counted once; `scratch`, the buffers each pass writes whole
  // before reading them, counted as SCRATCH, as are `scratch_bytes` held outside any blob).
  void Sample(const std::vector<CometEntry>& entries,
              const std::vector<const SyncedMemory*>& private_buffers,
              const std::vector<const SyncedMemory*>& scratch, size_t scratch_bytes = 0);
  // Buffers an encode or decode held for a moment since the last sample, on top of that sample
  // (taken just before the encodes: an upper bound, since each encode frees its dense input).
  void NoteTransient(size_t bytes);
  // The display window's figures into the entries' last_* fields, the log and the CSV; starts
  // a new window.
  void Report(int iter, std::vector<CometEntry>* entries);
  const CometMemory& memory() const { return memory_; }
  int last_report_iter() const { return last_report_iter_; }

 private:
  const Net<Dtype>* net_;
  CometParameter param_;
  CometMemory memory_;
  int last_report_iter_;
  std::string path_;
  std::ofstream csv_;
  // Sample's memories in the order it visits them, with the kind each counts as, and which
  // visits count (a memory's first): found again only when a memory changed (a reshape).
  std::vector<const SyncedMemory*> visit_, last_visit_;
  std::vector<unsigned char> visit_kind_;
  std::vector<bool> counts_;
};

}  // namespace caffe

#endif  // CAFFE_COMET_STATISTICS_HPP_
