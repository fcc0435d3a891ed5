// COMET-Caffe: sz streams of device payloads (include/caffe/comet/payload_gpu.hpp).
#include <algorithm>

#include "caffe/comet/payload.hpp"
#include "caffe/comet/payload_gpu.hpp"
#include "caffe/comet/stream.hpp"
#include "caffe/util/device_alternate.hpp"
#include "sz/sz.h"

namespace caffe {

int CometLossyEncodeGpu(const float* data, const size_t* dims, int ndims, double eb,
                        CometPayload* p) {
  const size_t scratch_bytes = sz_device_scratch_size(p->count());
  void* scratch = NULL;
  CometGpuMalloc(&scratch, std::max<size_t>(scratch_bytes, 1));
  CometNoteTransient(scratch_bytes);
  size_t used = 0;
  int rc = sz_compress_device_plan(data, dims, ndims, eb, SZ_EB_ABS, scratch, scratch_bytes, &used,
                                   CometStream());
  if (rc == SZ_OK) {
    p->Allocate(used);
    rc = sz_compress_device_write(data, dims, ndims, eb, SZ_EB_ABS, p->data(), used, &used,
                                  scratch, scratch_bytes, CometStream());
  }
  CometGpuFree(scratch, std::max<size_t>(scratch_bytes, 1));
  return rc;
}

int CometLossyDecodeGpu(const CometPayload& p, float* out) {
  const size_t scratch_bytes = sz_device_scratch_size(p.count());
  void* scratch = NULL;
  CometGpuMalloc(&scratch, std::max<size_t>(scratch_bytes, 1));
  CometNoteTransient(scratch_bytes);
  const int rc = sz_decompress_device(p.data(), p.bytes(), out, p.count(), scratch, scratch_bytes,
                                      CometStream());
  CometGpuFree(scratch, std::max<size_t>(scratch_bytes, 1));
  return rc;
}

void CometCopyToHost(void* host, const void* device, size_t bytes) {
  cudaStream_t s = static_cast<cudaStream_t>(CometStream());
  COMET_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, s));
  COMET_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace caffe
