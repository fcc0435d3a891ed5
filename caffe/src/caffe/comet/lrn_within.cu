// COMET-Caffe: LRN within a channel's backward from its input on the GPU. The per-element logic
// is comet_lrn:: (lrn_within.hpp), shared with the CPU path in lrn_within.cpp.
#include "caffe/comet/lrn_within.hpp"
#include "caffe/common.hpp"
#include "caffe/comet/stream.hpp"
#include "caffe/util/device_alternate.hpp"

namespace caffe {

namespace {

// A thread per element of the input: its plane, row and column, then comet_lrn::backward_at
// (no buffer: each window's t is computed again by each element it covers, local_size^2 times).
__global__ void LrnWithinBackwardKernel(const float* x, const float* dy, float* dx, size_t count,
                                        comet_lrn::Geometry g) {
  const size_t plane = static_cast<size_t>(g.height) * g.width;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(blockDim.x) * gridDim.x) {
    const size_t q = i / plane, r = i - q * plane;
    dx[i] = comet_lrn::backward_at(x + q * plane, dy + q * plane, static_cast<int>(r / g.width),
                                   static_cast<int>(r % g.width), g);
  }
}

}  // namespace

void CometLrnWithinBackwardGpu(const LRNParameter& p, int planes, int height, int width,
                               const float* x, const float* dy, float* dx) {
  const size_t count = static_cast<size_t>(planes) * height * width;
  if (count == 0) return;
  const size_t per = CAFFE_CUDA_NUM_THREADS;
  const size_t blocks = (count + per - 1) / per;
  LrnWithinBackwardKernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535),
                            CAFFE_CUDA_NUM_THREADS, 0,
                            static_cast<cudaStream_t>(CometStream())>>>(
      x, dy, dx, count, CometLrnGeometry(p, height, width));
  COMET_CUDA_CHECK(cudaPeekAtLastError());
}

}  // namespace caffe
