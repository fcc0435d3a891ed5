#ifndef CAFFE_COMET_PAYLOAD_HPP_
#define CAFFE_COMET_PAYLOAD_HPP_

#include <stdint.h>

#include <string>
#include <vector>

#include "caffe/common.hpp"

namespace caffe {

class SyncedMemory;

// Time spent decoding, shared between a payload and the store that made it (the payload may
// outlive the store when pycaffe keeps a blob).
struct CometTiming {
  CometTiming() : encode_ms(0), decode_ms(0) {}
  double encode_ms, decode_ms;
};

// The compressed content of one SyncedMemory while its dense buffers are released.
// LOSSY: an sz stream (|x - x'| <= eb). MASK: one bit per value, x > 0, restored as 1 or 0,
// which is exact for every reader that only asks whether a value is positive (ReLU backward).
class CometPayload {
 public:
  // RELEASED holds nothing: it marks memory the store freed after its last use in the training
  // step; reading it from outside gives zeros and a warning instead of a silent zero.
  enum Kind { LOSSY = 0, MASK = 1, RELEASED = 2 };
  CometPayload(Kind kind, bool on_device, size_t count, const std::string& name);
  ~CometPayload();

  // Allocates the payload bytes on the host or (CUDA builds) the device.
  void Allocate(size_t bytes);
  void* data() { return on_device_ ? device_ : static_cast<void*>(host_.data()); }
  const void* data() const {
    return on_device_ ? device_ : static_cast<const void*>(host_.data());
  }
  size_t bytes() const { return bytes_; }
  size_t count() const { return count_; }
  size_t dense_bytes() const { return count_ * sizeof(float); }
  Kind kind() const { return kind_; }
  bool on_device() const { return on_device_; }
  const std::string& name() const { return name_; }

  // Bytes held, the sign mask included.
  size_t stored_bytes() const { return bytes_ + (sign_mask ? sign_mask->bytes() : 0); }

  uint32_t mask_popcount;        // MASK: number of set bits, checked when decoding
  // LOSSY read by ReLU too: after decoding, values are clamped to the sign this mask records
  // (positive stays > 0, the rest <= 0). That keeps |x - x'| <= eb and gives ReLU exact signs.
  shared_ptr<CometPayload> sign_mask;
  shared_ptr<CometTiming> timing;

 private:
  Kind kind_;
  bool on_device_;
  size_t count_;
  size_t bytes_;
  std::string name_;
  std::vector<uint8_t> host_;
  void* device_;

  DISABLE_COPY_AND_ASSIGN(CometPayload);
};

// Called by SyncedMemory::to_cpu/to_gpu when a payload is attached: decodes it into freshly
// allocated dense memory on the side where it was made and drops it. A corrupt payload is a
// fatal error with the blob's name; it is never used.
void CometRestore(SyncedMemory* mem);

// Frees mem's dense buffers and marks them released (see CometPayload::RELEASED); `what` says
// which memory it is, for the warning ("data of blob 'fc8'").
void CometMarkReleased(SyncedMemory* mem, const std::string& what);

// Encoders. `data` lives on the device when on_device. Dims are N,C,H,W (innermost last).
// EncodeMask returns NULL when the data holds NaN or Inf (a mask would lose them).
shared_ptr<CometPayload> CometEncodeLossy(const float* data, const std::vector<int>& shape,
                                          bool on_device, double eb, const std::string& name);
shared_ptr<CometPayload> CometEncodeMask(const float* data, size_t count, bool on_device,
                                         const std::string& name);
// Decodes into out (device memory when the payload is on the device); false when corrupt,
// with the reason in *error.
bool CometDecode(const CometPayload& payload, float* out, std::string* error);

// GPU allocations of SyncedMemory go through a pool while a COMET store is active, so buffers
// released after compression are reused by the next iteration instead of cudaFree/cudaMalloc.
void CometGpuMalloc(void** ptr, size_t size);
void CometGpuFree(void* ptr, size_t size);
void CometGpuPoolEnable(bool on);
struct CometGpuPoolStats {
  size_t in_use, cached, peak_in_use;
};
CometGpuPoolStats CometGpuPoolQuery();

}  // namespace caffe

#endif  // CAFFE_COMET_PAYLOAD_HPP_
