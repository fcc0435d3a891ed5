#ifndef CAFFE_COMET_PAYLOAD_HPP_
#define CAFFE_COMET_PAYLOAD_HPP_

#include <stdint.h>

#include <chrono>  // NOLINT(build/c++11)
#include <string>
#include <vector>

#include "caffe/comet/codes.hpp"
#include "caffe/comet/pool.hpp"
#include "caffe/common.hpp"

namespace caffe {

class SyncedMemory;

// Time spent decoding, shared between a payload and the store that made it (the payload may
// outlive the store when pycaffe keeps a blob), and the part of the entry's work the training
// step waited for (a decode on demand, an encode in the step, a wait for the store's worker).
struct CometTiming {
  CometTiming() : decode_ms(0), wait_ms(0) {}
  // A decode (or rebuild) that ran in the step: the step waited for all of it.
  void DecodedInStep(double ms) {
    decode_ms += ms;
    wait_ms += ms;
  }
  double decode_ms, wait_ms;
};

// Milliseconds since `start` (steady clock).
double CometMsSince(const std::chrono::steady_clock::time_point& start);

// The compressed content of one SyncedMemory while its dense buffers are released.
// LOSSY: an sz stream (|x - x'| <= eb). MASK: one bit per value, x > 0, restored as 1 or 0,
// which is exact for every reader that only asks whether a value is positive (ReLU backward).
// ARGMAX and BINARY: integer buffers of max pooling and Dropout as packed codes (codes.hpp).
class CometPayload {
 public:
  // RELEASED holds nothing: it marks memory the store freed after its last use in the training
  // step; reading it is a fatal error (or a Python exception) naming the blob and the reader.
  // IN_FLIGHT marks dense memory that the store's worker is decoding into for a later backward
  // reader (comet { decode_ahead }): any other reader is just as fatal. FILL marks memory the
  // store freed that the next layer's Forward or Backward writes whole (its facts say
  // fills_whole): the first access drops it and allocates without upstream's zero fill.
  // DERIVED holds no stream of its own: its values are rebuilt from `source`, BatchNorm's x_norm_
  // (LOSSY), through the per-channel y = channel_scale[c] x + channel_bias[c] of an in-place
  // Scale after it and, with a sign mask, ReLU in place (docs/comet.md#rebuilt-from-batchnorm).
  // OFFSETS holds a float per channel that a LOSSY stream's values were shifted by before
  // encoding (BatchNorm's x_norm_ after a ReLU, batchnorm_moments.hpp); decoding adds them back.
  enum Kind { LOSSY = 0, MASK = 1, RELEASED = 2, ARGMAX = 3, BINARY = 4, IN_FLIGHT = 5, FILL = 6,
              DERIVED = 7, OFFSETS = 8 };
  CometPayload(Kind kind, bool on_device, size_t count, const std::string& name);
  ~CometPayload();

  // Allocates the payload bytes on the host or (CUDA builds) the device.
  void Allocate(size_t bytes);
  void* data() { return on_device_ ? device_ : host_; }
  const void* data() const { return on_device_ ? device_ : host_; }
  size_t bytes() const { return bytes_; }
  size_t count() const { return count_; }
  size_t dense_bytes() const { return count_ * sizeof(float); }
  Kind kind() const { return kind_; }
  bool on_device() const { return on_device_; }
  const std::string& name() const { return name_; }

  // Bytes held, the sign mask and channel offsets included.
  size_t stored_bytes() const {
    return bytes_ + (sign_mask ? sign_mask->bytes() : 0) +
           (channel_offsets ? channel_offsets->bytes() : 0);
  }

  uint32_t mask_popcount;        // MASK, ARGMAX, BINARY: number of set bits, checked when decoding
  int code_bits;                 // ARGMAX, BINARY: bits per code
  comet_codes::PoolGeometry pool;  // ARGMAX: the windows the codes are offsets in
  comet_codes::BinaryRule binary;  // BINARY: what a bit means and restores to
  // LOSSY read by ReLU too: after decoding, values are clamped to the sign this mask records
  // (positive stays > 0, the rest <= 0). That keeps |x - x'| <= eb and gives ReLU exact signs.
  shared_ptr<CometPayload> sign_mask;
  // LOSSY: the values were encoded less these (OFFSETS, on the same side; its `inner` values a
  // channel and image in a row); decoding adds them back.
  shared_ptr<CometPayload> channel_offsets;
  shared_ptr<CometTiming> timing;
  double eb;                     // LOSSY: the bound it was encoded at
  // DERIVED: what it is rebuilt from. The factors are copies: the solver updates Scale's blobs
  // after the backward, and a later read (pycaffe) must still see this step's values.
  shared_ptr<CometPayload> source;
  std::vector<float> channel_scale, channel_bias;
  size_t inner;                  // DERIVED, OFFSETS: values per channel and image
  float negative_slope;          // ReLU's, where the sign mask is 0
  // RELEASED: the comet { } setting that would have kept it, for the message of a read
  // (empty: release_unused and release_diffs). E.g. "keep_compressed: true".
  std::string kept_by;

 private:
  Kind kind_;
  bool on_device_;
  size_t count_;
  size_t bytes_;
  std::string name_;
  void* host_;      // from the host pool: masks and codes have the same size every iteration
  bool host_cuda_;  // host_ is pinned (GPU mode)
  bool host_mapped_;  // host_ was mapped for this payload alone (a large lossy stream)
  void* device_;

  DISABLE_COPY_AND_ASSIGN(CometPayload);
};

// Called by SyncedMemory::to_cpu/to_gpu when a payload is attached: decodes it into freshly
// allocated dense memory on the side where it was made and drops it. A corrupt payload, a read
// of memory the store freed (RELEASED) and a read of the values of a blob held only as signs
// (MASK) are fatal errors naming the blob and the reader (CometSetReadContext); never zeros.
void CometRestore(SyncedMemory* mem);
// For a payload detached from mem: mem's dense memory on the payload's side, allocated now,
// to decode into (the store's decode ahead; CometRestore).
void* CometDenseFor(SyncedMemory* mem, const CometPayload& p);
// The fatal error of a payload that failed to decode, naming the blob and the reader.
void CometFatalCorrupt(const std::string& blob, const std::string& error);

// What is running, for those messages: "layer 'fc8' (InnerProduct) backward, iteration 12". The
// store registers a describer that it updates with two fields per layer and that is asked only
// when a message needs it; a fixed text (tests, tools) replaces the describer.
class CometReadDescriber {
 public:
  virtual ~CometReadDescriber() {}
  virtual std::string Describe() const = 0;
  virtual bool InLayer() const { return false; }  // a layer's Forward or Backward reads
  // ... in a forward that began after the first layer (pycaffe's net.forward(start=...)): what
  // it finds freed is what the layers before its start left, not a gap in the plan.
  virtual bool InForwardFromLater() const { return false; }
};
void CometSetReadContext(const CometReadDescriber* describer);
void CometSetReadContext(const std::string& context);
std::string CometReadContext();
// pycaffe turns COMET's fatal errors into std::runtime_error (Python's RuntimeError, same
// words) instead of aborting the interpreter.
void CometSetFatalThrows(bool on);
// LOG(FATAL) << message, or the exception above.
void CometFatal(const std::string& message);
// A number as the messages print it (operator<< of a double).
std::string CometNum(double v);

// Frees mem's dense buffers and marks them released (see CometPayload::RELEASED); `what` says
// which memory it is, for the error ("data of blob 'fc8'").
void CometMarkReleased(SyncedMemory* mem, const std::string& what,
                       const std::string& kept_by = "");
// Marks memory the store freed (head UNINITIALIZED, no payload or a RELEASED marker) as filled
// whole by its next writer (CometPayload::FILL); anything else is left as it is.
void CometMarkFill(SyncedMemory* mem);

// Encoders. `data` lives on the device when on_device. Dims are N,C,H,W (innermost last).
// EncodeMask returns NULL when the data holds NaN or Inf (a mask would lose them). A failed
// lossy encode is fatal, or with `error` returns NULL and says why there (the store's worker).
// On the store's worker thread (CometWorker::OnWorker) the codecs run on that thread alone.
shared_ptr<CometPayload> CometEncodeLossy(const float* data, const std::vector<int>& shape,
                                          bool on_device, double eb, const std::string& name,
                                          std::string* error = NULL);
// With max_abs (host only), the same pass also gives the largest magnitude (a rebuilt blob's
// rounding check).
shared_ptr<CometPayload> CometEncodeMask(const float* data, size_t count, bool on_device,
                                         const std::string& name, float* max_abs = NULL);
// The largest magnitude of host data, and whether every value is finite (one pass, one thread).
float CometMaxAbs(const float* data, size_t count, bool* finite);
// Max pooling's argmax (indices into each bottom plane) and Dropout's 0/1 mask, losslessly as
// packed codes; NULL when a value cannot be coded (an argmax of -1 from a window of NaN).
shared_ptr<CometPayload> CometEncodeArgmax(const int* idx, size_t count,
                                           const comet_codes::PoolGeometry& g, bool on_device,
                                           const std::string& name);
shared_ptr<CometPayload> CometEncodeBinary(const unsigned int* v, size_t count,
                                           const comet_codes::BinaryRule& rule, bool on_device,
                                           const std::string& name);
// Max pooling's forward straight into codes (comet { pool_codes }): the maxima of bottom's
// windows into top (count values) and their argmax as an ARGMAX payload, never dense; the same
// values and codes as PoolingLayer's forward and CometEncodeArgmax. NULL for a geometry that
// codes cannot hold (a window of more than 65536 values, an empty one): nothing is kept then.
shared_ptr<CometPayload> CometPoolToCodes(const float* bottom, float* top, size_t count,
                                          const comet_codes::PoolGeometry& g, bool on_device,
                                          const std::string& name);
// Max pooling's backward from those codes: bottom_diff (every value written) from top_diff, bit
// for bit what PoolingLayer's backward computes from the argmax. False when the codes are corrupt.
bool CometPoolBackwardFromCodes(const CometPayload& codes, const float* top_diff,
                                float* bottom_diff, std::string* error);
// Decodes into out (device memory when the payload is on the device; floats, or 32-bit integers
// for ARGMAX and BINARY); false when corrupt, with the reason in *error.
bool CometDecode(const CometPayload& payload, void* out, std::string* error);
// A DERIVED payload (host only) without its source on board: the source's values, given dense
// in x (decoded already), through the payload's Scale and ReLU into out (may be x). False when
// the parts do not fit together or the sign mask is corrupt.
shared_ptr<CometPayload> CometMakeDerived(const shared_ptr<CometPayload>& source,
                                          const std::vector<float>& scale,
                                          const std::vector<float>& bias, size_t inner,
                                          const shared_ptr<CometPayload>& sign_mask,
                                          float negative_slope, const std::string& name);
bool CometRebuild(const CometPayload& derived, const float* x, float* out, std::string* error);

// What the encoders take beyond the payloads, for the tracked memory: the bytes they hold between
// calls (the host's worst-case stream buffer, kept for the next encode), and the largest transient
// of one encode or decode since the last call (device: sz's scratch, about 0.16 bytes per value,
// freed before it returns, so no sample at a layer boundary sees it; the payload itself is
// allocated at its exact size after sz_compress_device_plan).
size_t CometEncoderHeldBytes();
void CometReleaseEncoderBuffer();  // the held stream buffer goes (a store's end; tests)
size_t CometTakeTransientPeak();

// ReLU's backward straight from a sign mask (a MASK payload, or the sign mask of a LOSSY one),
// without restoring the input: bottom_diff = top_diff * (x > 0 ? 1 : negative_slope), bit for
// bit what ReLULayer computes. The diffs may be the same buffer (in-place ReLU). False when the
// mask is corrupt.
bool CometReluBackward(const CometPayload& mask, const float* top_diff, float* bottom_diff,
                       float negative_slope, std::string* error);

}  // namespace caffe

#endif  // CAFFE_COMET_PAYLOAD_HPP_
