// COMET-Caffe: BatchNorm's lossy x_norm_ moved back to its exact moments, on the GPU. The
// per-channel arithmetic is comet_bn::worth_moving and moment_move (batchnorm_moments.hpp), shared
// with the CPU loop in batchnorm_moments.cpp.
#include <algorithm>

#include "caffe/comet/batchnorm_moments.hpp"
#include "caffe/common.hpp"
#include "caffe/comet/stream.hpp"
#include "caffe/util/device_alternate.hpp"

namespace caffe {

namespace {

const int kMomentThreads = 256;

// A block per channel: its threads sum the channel's values and squares (in double, in a fixed
// order, so the result is the same every run), thread 0 takes the mean and scale, and the block
// applies them; a channel not worth moving (comet_bn::worth_moving), where x_norm_ has no ties,
// is not read.
__global__ void MatchMomentsKernel(int num, int channels, int spatial, const float* std,
                                   float eps, double eb, bool ties, float* y) {
  __shared__ double s1[kMomentThreads], s2[kMomentThreads];
  __shared__ comet_bn::Move move;
  const int c = blockIdx.x;
  const size_t values = static_cast<size_t>(num) * spatial;
  if (!ties && !comet_bn::worth_moving(static_cast<double>(values), std[c], eps, eb)) return;
  double a1 = 0, a2 = 0;
  for (size_t j = threadIdx.x; j < values; j += blockDim.x) {
    const size_t k = j / spatial, i = j - k * spatial;
    const float v = y[(k * channels + c) * spatial + i];
    a1 += v;
    a2 += static_cast<double>(v) * v;
  }
  s1[threadIdx.x] = a1;
  s2[threadIdx.x] = a2;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      s1[threadIdx.x] += s1[threadIdx.x + half];
      s2[threadIdx.x] += s2[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    move = comet_bn::moment_move(s1[0], s2[0], static_cast<double>(values), std[c], eps);
  }
  __syncthreads();
  for (size_t j = threadIdx.x; j < values; j += blockDim.x) {
    const size_t k = j / spatial, i = j - k * spatial;
    float* p = y + (k * channels + c) * spatial + i;
    *p = (*p - move.m) * move.a;
  }
}

__global__ void TieOffsetsKernel(int channels, const float* mean, const float* std, double n,
                                 float* offsets) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < channels) offsets[c] = comet_bn::tie_offset(mean[c], std[c], n);
}

__global__ void AddChannelOffsetsKernel(size_t count, int channels, size_t inner,
                                        const float* offsets, float sign, float* y) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(blockDim.x) * gridDim.x) {
    const float o = sign * offsets[(i / inner) % channels];
    if (o != 0) y[i] += o;  // as the CPU loop: a channel without offset keeps its -0s
  }
}

}  // namespace

void CometTieOffsetsGpu(int channels, const float* mean, const float* std, double n,
                        float* offsets) {
  if (channels <= 0) return;
  TieOffsetsKernel<<<(channels + kMomentThreads - 1) / kMomentThreads, kMomentThreads, 0,
                     static_cast<cudaStream_t>(CometStream())>>>(channels, mean, std, n, offsets);
  COMET_CUDA_CHECK(cudaPeekAtLastError());
}

void CometAddChannelOffsetsGpu(size_t count, int channels, size_t inner, const float* offsets,
                               float sign, float* y) {
  if (!count || channels <= 0 || !inner) return;
  const size_t blocks = std::min<size_t>((count + kMomentThreads - 1) / kMomentThreads, 4096);
  AddChannelOffsetsKernel<<<static_cast<int>(blocks), kMomentThreads, 0,
                            static_cast<cudaStream_t>(CometStream())>>>(count, channels, inner,
                                                                        offsets, sign, y);
  COMET_CUDA_CHECK(cudaPeekAtLastError());
}

void CometMatchBatchNormMomentsGpu(int num, int channels, int spatial, const float* std,
                                   float eps, double eb, bool ties, float* y) {
  if (num <= 0 || channels <= 0 || spatial <= 0) return;
  MatchMomentsKernel<<<channels, kMomentThreads, 0, static_cast<cudaStream_t>(CometStream())>>>(
      num, channels, spatial, std, eps, eb, ties, y);
  COMET_CUDA_CHECK(cudaPeekAtLastError());
}

}  // namespace caffe
