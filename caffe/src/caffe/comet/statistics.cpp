// COMET-Caffe: memory samples and reports (include/caffe/comet/statistics.hpp).
#include <algorithm>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "caffe/comet/statistics.hpp"

namespace caffe {

const char* CometMemory::name(int kind) {
  static const char* names[] = {"weights", "activations", "gradients", "compressed", "scratch"};
  return names[kind];
}

namespace {

std::string FormatBytes(double b) {
  char buf[32];
  if (b >= 1 << 30) snprintf(buf, sizeof(buf), "%.2f GB", b / (1 << 30));
  else if (b >= 1 << 20) snprintf(buf, sizeof(buf), "%.1f MB", b / (1 << 20));
  else snprintf(buf, sizeof(buf), "%.1f KB", b / 1024.);
  return buf;
}

}  // namespace

// Two samples a layer: on nets of hundreds of blobs a set of the memories seen, made afresh each
// time, cost more than the sum (GoogLeNet at batch 1 on the CPU: 2-3% of a COMET step). Shared
// memories (in-place layers, Split) are found once and again only when a memory changes.
template <typename Dtype>
void CometStatistics<Dtype>::Sample(const std::vector<CometEntry>& entries,
                                    const std::vector<const SyncedMemory*>& private_buffers,
                                    const std::vector<const SyncedMemory*>& scratch,
                                    size_t scratch_bytes) {
  size_t cur[CometMemory::NUM_KINDS] = {0, 0, 0, 0, 0};
  visit_.clear();
  visit_kind_.clear();
  const std::vector<shared_ptr<Blob<Dtype> > >& blobs = net_->blobs();
  for (int b = 0; b < blobs.size(); ++b) {
    visit_.push_back(blobs[b]->data().get());
    visit_kind_.push_back(CometMemory::ACTIVATIONS);
    visit_.push_back(blobs[b]->diff().get());
    visit_kind_.push_back(CometMemory::GRADIENTS);
  }
  const std::vector<Blob<Dtype>*>& params = net_->learnable_params();
  for (int p = 0; p < params.size(); ++p) {
    visit_.push_back(params[p]->data().get());
    visit_kind_.push_back(CometMemory::WEIGHTS);
    visit_.push_back(params[p]->diff().get());
    visit_kind_.push_back(CometMemory::GRADIENTS);
  }
  for (int b = 0; b < private_buffers.size(); ++b) {
    visit_.push_back(private_buffers[b]);
    visit_kind_.push_back(CometMemory::ACTIVATIONS);
  }
  for (int b = 0; b < scratch.size(); ++b) {
    visit_.push_back(scratch[b]);
    visit_kind_.push_back(CometMemory::SCRATCH);
  }
  if (visit_ != last_visit_) {
    last_visit_ = visit_;
    counts_.assign(visit_.size(), false);
    std::set<const SyncedMemory*> seen;
    for (int i = 0; i < visit_.size(); ++i) counts_[i] = visit_[i] && seen.insert(visit_[i]).second;
  }
  for (int i = 0; i < visit_.size(); ++i)  // dense memory, each counted once
    if (counts_[i] && visit_[i]->head() != SyncedMemory::UNINITIALIZED)
      cur[visit_kind_[i]] += visit_[i]->size();
  for (int e = 0; e < entries.size(); ++e)  // every payload is held by its entry
    if (entries[e].stored) cur[CometMemory::COMPRESSED] += entries[e].stored->stored_bytes();
  // this solver's device pool alone (-gpu all: one store per device)
  const size_t pool_cached = Caffe::mode() == Caffe::GPU ? CometPoolQueryHere().cached : 0;
  cur[CometMemory::SCRATCH] += pool_cached + CometEncoderHeldBytes() + scratch_bytes;
  size_t total = 0;
  for (int k = 0; k < CometMemory::NUM_KINDS; ++k) {
    memory_.current[k] = cur[k];
    memory_.peak[k] = std::max(memory_.peak[k], cur[k]);
    total += cur[k];
  }
  if (total > memory_.peak_total) {
    memory_.peak_total = total;
    for (int k = 0; k < CometMemory::NUM_KINDS; ++k) memory_.at_peak[k] = cur[k];
  }
}

namespace {
// <prefix>_comet.csv: one row per entry (layer = the entry's name, kind = its action), then a
// "total" row: dense and stored bytes of the net's blobs, the tracked peak and its split by kind
// (at the peak), and the layers' private buffers dense and stored; times per iteration, encode
// and decode wherever they ran, and the part the training step waited for (comet { async }
// runs the rest beside it). `cometctl report` and the benchmarks read these columns by name.
const char kCsvHeader[] =
    "iter,layer,blob,kind,ratio,eb,ms,dense_bytes,stored_bytes,peak_bytes,weights_bytes,"
    "activations_bytes,gradients_bytes,compressed_bytes,scratch_bytes,buffers_dense_bytes,"
    "buffers_stored_bytes,encode_ms,decode_ms,wait_ms";
}  // namespace

template <typename Dtype>
void CometStatistics<Dtype>::Report(int iter, std::vector<CometEntry>* entries) {
  last_report_iter_ = iter;
  double dense = 0, stored = 0;                // net blobs
  double private_dense = 0, private_stored = 0;  // layer-private buffers
  double encode_ms = 0, decode_ms = 0, wait_ms = 0;  // per iteration, all entries
  const bool root = Caffe::root_solver();
  if (root && !path_.empty() && !csv_.is_open()) {
    std::ifstream exists(path_.c_str());
    bool fresh = !exists.good();
    std::string header;
    if (!fresh && std::getline(exists, header) && header != kCsvHeader) {
      // Another build's columns (a run resumed with a newer fork): their rows stay in a file of
      // their own rather than under a header that names other columns.
      std::string kept = path_ + ".old";
      for (int n = 2; std::ifstream(kept.c_str()).good(); ++n) kept = path_ + "." + CometNum(n) + ".old";
      if (std::rename(path_.c_str(), kept.c_str()) == 0) {
        LOG(WARNING) << "COMET: " << path_ << " has other columns; kept as " << kept
                     << ", statistics start over in " << path_;
        fresh = true;
      }
    }
    exists.close();
    csv_.open(path_.c_str(), std::ios::app);
    if (!csv_.good()) {
      LOG(WARNING) << "COMET: cannot write statistics to " << path_;
      path_.clear();
    } else if (fresh) {
      csv_ << kCsvHeader << "\n";
    }
  }
  for (int i = 0; i < entries->size(); ++i) {
    CometEntry& e = (*entries)[i];
    if (e.action == CometActions::RELEASE || (e.action == CometActions::KEEP && e.layer < 0)) continue;
    if (e.samples == 0) continue;
    e.last_dense = static_cast<size_t>(e.dense_bytes / e.samples);
    e.last_stored = static_cast<size_t>(e.stored_bytes / e.samples);
    e.last_ratio = e.stored_bytes > 0 ? e.dense_bytes / e.stored_bytes : 0;
    e.last_encode_ms = e.encode_ms / e.samples;
    e.last_decode_ms = e.timing->decode_ms / e.samples;
    e.last_wait_ms = e.timing->wait_ms / e.samples;
    e.last_ms = e.last_encode_ms + e.last_decode_ms;
    encode_ms += e.last_encode_ms;
    decode_ms += e.last_decode_ms;
    wait_ms += e.last_wait_ms;
    e.last_eb = e.action == CometActions::LOSSY ? e.eb_sum / e.samples : 0;  // the bound actually used
    (e.layer >= 0 ? private_dense : dense) += e.last_dense;
    (e.layer >= 0 ? private_stored : stored) += e.last_stored;
    if (root) {
      char line[256];
      if (e.action == CometActions::LOSSY) {
        snprintf(line, sizeof(line), "COMET %s: ratio %.1fx, eb %.1e, %.1f ms", e.name.c_str(),
                 e.last_ratio, e.last_eb, e.last_ms);
      } else if (e.action == CometActions::KEEP) {
        snprintf(line, sizeof(line), "COMET %s: %s kept dense, %s", e.name.c_str(),
                 e.blob.substr(e.name.size() + 1).c_str(), FormatBytes(e.last_dense).c_str());
      } else if (e.action == CometActions::REBUILD && e.unread) {
        snprintf(line, sizeof(line), "COMET %s: %s freed after the forward, %s (written anew "
                 "by the backward)", e.name.c_str(), e.blob.substr(e.name.size() + 1).c_str(),
                 FormatBytes(e.last_dense).c_str());
      } else if (e.action == CometActions::REBUILD) {
        snprintf(line, sizeof(line), "COMET %s: %s rebuilt, freed %s, %.1f ms", e.name.c_str(),
                 e.source >= 0 ? "input copy" : "temp", FormatBytes(e.last_dense).c_str(),
                 e.last_ms);
      } else if (e.action == CometActions::RECOMPUTE && e.unread) {
        snprintf(line, sizeof(line), "COMET %s: %s freed after the forward, %s (backward from the "
                 "input)", e.name.c_str(), e.blob.substr(e.name.size() + 1).c_str(),
                 FormatBytes(e.last_dense).c_str());
      } else if (e.action == CometActions::RECOMPUTE) {
        snprintf(line, sizeof(line), "COMET %s: %s recomputed, freed %s, %.1f ms",
                 e.name.c_str(), e.blob.substr(e.name.size() + 1).c_str(),
                 FormatBytes(e.last_dense).c_str(), e.last_ms);
      } else {
        snprintf(line, sizeof(line), "COMET %s: ratio %.1fx, %s, %.1f ms", e.name.c_str(),
                 e.last_ratio, e.action == CometActions::MASK ? "mask" : e.action == CometActions::ARGMAX ? "argmax"
                                                                             : "dropout mask",
                 e.last_ms);
      }
      LOG(INFO) << line;
      if (csv_.is_open()) {
        csv_ << iter << "," << e.name << "," << e.blob << "," << CometActions::ActionName(e.action) << ","
               << e.last_ratio << "," << e.last_eb << "," << e.last_ms << "," << e.last_dense
               << "," << e.last_stored << ",,,,,,,,," << e.last_encode_ms << ","
               << e.last_decode_ms << "," << e.last_wait_ms << "\n";
      }
    }
    e.dense_bytes = e.stored_bytes = e.encode_ms = e.eb_sum = 0;
    e.timing->decode_ms = e.timing->wait_ms = 0;
    e.samples = 0;
  }
  if (!root) return;
  const CometMemory& m = memory_;
  char line[640];
  char buffers[128] = "";
  if (private_dense > 0) {
    snprintf(buffers, sizeof(buffers), ", layer buffers %s -> %s",
             FormatBytes(private_dense).c_str(), FormatBytes(private_stored).c_str());
  }
  snprintf(line, sizeof(line),
           "COMET total: activations %s -> %s (%.1fx)%s, peak memory %s (weights %s, activations "
           "%s, gradients %s, compressed %s, scratch %s)",
           FormatBytes(dense).c_str(), FormatBytes(stored).c_str(),
           stored > 0 ? dense / stored : 0., buffers, FormatBytes(m.peak_total).c_str(),
           FormatBytes(m.at_peak[CometMemory::WEIGHTS]).c_str(),
           FormatBytes(m.at_peak[CometMemory::ACTIVATIONS]).c_str(),
           FormatBytes(m.at_peak[CometMemory::GRADIENTS]).c_str(),
           FormatBytes(m.at_peak[CometMemory::COMPRESSED]).c_str(),
           FormatBytes(m.at_peak[CometMemory::SCRATCH]).c_str());
  LOG(INFO) << line;
  const double work = encode_ms + decode_ms;
  snprintf(line, sizeof(line), "COMET time per iteration: encode %.1f ms, decode %.1f ms; the step "
           "waited %.1f ms (%.0f%% ran beside it)", encode_ms, decode_ms, wait_ms,
           work > 0 ? 100. * std::max(0., work - wait_ms) / work : 0.);
  LOG(INFO) << line;
  if (param_.memory_pool()) {
    const CometPoolStats pool = CometPoolQueryHere();  // this solver's device's (-gpu all)
    LOG(INFO) << "COMET memory pool: reused " << pool.hits << ", allocated " << pool.misses
              << ", returned " << pool.evicted << ", cached " << FormatBytes(pool.cached)
              << ", held at most " << FormatBytes(pool.peak_held) << " (in use at most "
              << FormatBytes(pool.peak_in_use) << ")";
  }
  if (csv_.is_open()) {
    csv_ << iter << ",total,," << "total" << "," << (stored > 0 ? dense / stored : 0) << ",,,"
           << static_cast<size_t>(dense) << "," << static_cast<size_t>(stored) << ","
           << m.peak_total;
    for (int k = 0; k < CometMemory::NUM_KINDS; ++k) csv_ << "," << m.at_peak[k];
    csv_ << "," << static_cast<size_t>(private_dense) << "," << static_cast<size_t>(private_stored)
         << "," << encode_ms << "," << decode_ms << "," << wait_ms << "\n";
    csv_.flush();
  }
}

template <typename Dtype>
void CometStatistics<Dtype>::NoteTransient(size_t bytes) {
  if (!bytes) return;
  const size_t total = memory_.total() + bytes;
  if (total <= memory_.peak_total) return;
  memory_.peak_total = total;
  for (int k = 0; k < CometMemory::NUM_KINDS; ++k) memory_.at_peak[k] = memory_.current[k];
  memory_.at_peak[CometMemory::SCRATCH] += bytes;
  memory_.peak[CometMemory::SCRATCH] =
      std::max(memory_.peak[CometMemory::SCRATCH], memory_.current[CometMemory::SCRATCH] + bytes);
}

INSTANTIATE_CLASS(CometStatistics);

}  // namespace caffe
