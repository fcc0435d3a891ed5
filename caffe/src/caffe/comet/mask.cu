// COMET-Caffe: bit masks on the GPU. The per-element logic is comet_mask:: (mask.hpp), shared
// with the CPU path in payload.cpp.
#include "caffe/comet/mask.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/util/device_alternate.hpp"

namespace caffe {

namespace {

__global__ void PackKernel(const float* x, size_t count, uint32_t* words, size_t nwords,
                           uint32_t* popcount, int* nonfinite) {
  for (size_t w = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; w < nwords;
       w += static_cast<size_t>(blockDim.x) * gridDim.x) {
    bool bad = false;
    const uint32_t word = comet_mask::pack_word(x, count, w, &bad);
    words[w] = word;
    atomicAdd(popcount, static_cast<uint32_t>(__popc(word)));
    if (bad) atomicOr(nonfinite, 1);
  }
}

__global__ void UnpackKernel(const uint32_t* words, size_t count, float* x) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(blockDim.x) * gridDim.x) {
    x[i] = comet_mask::value_of(words[i / 32], static_cast<int>(i % 32));
  }
}

__global__ void ApplySignsKernel(const uint32_t* words, size_t count, float* x) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(blockDim.x) * gridDim.x) {
    x[i] = comet_mask::apply_sign(x[i], words[i / 32], static_cast<int>(i % 32));
  }
}

__global__ void PopcountKernel(const uint32_t* words, size_t nwords, size_t count,
                               uint32_t* popcount) {
  for (size_t w = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; w < nwords;
       w += static_cast<size_t>(blockDim.x) * gridDim.x) {
    uint32_t word = words[w];
    // bits past the end must be clear: a set one makes the count wrong on purpose
    if (w == nwords - 1 && count % 32 && (word >> (count % 32))) word = 0xffffffffu;
    atomicAdd(popcount, static_cast<uint32_t>(__popc(word)));
  }
}

int Blocks(size_t n) {
  const size_t b = (n + CAFFE_CUDA_NUM_THREADS - 1) / CAFFE_CUDA_NUM_THREADS;
  return static_cast<int>(b < 4096 ? (b ? b : 1) : 4096);
}

}  // namespace

void CometMaskPackGpu(const float* x, size_t count, uint32_t* words, uint32_t* popcount,
                      bool* nonfinite) {
  const size_t nwords = comet_mask::words(count);
  uint32_t* d_counts;  // [popcount, nonfinite]
  CometGpuMalloc(reinterpret_cast<void**>(&d_counts), 2 * sizeof(uint32_t));
  CUDA_CHECK(cudaMemset(d_counts, 0, 2 * sizeof(uint32_t)));
  PackKernel<<<Blocks(nwords), CAFFE_CUDA_NUM_THREADS>>>(
      x, count, words, nwords, d_counts, reinterpret_cast<int*>(d_counts + 1));
  CUDA_POST_KERNEL_CHECK;
  uint32_t h[2];
  CUDA_CHECK(cudaMemcpy(h, d_counts, sizeof(h), cudaMemcpyDeviceToHost));
  CometGpuFree(d_counts, 2 * sizeof(uint32_t));
  *popcount = h[0];
  *nonfinite = h[1] != 0;
}

// Unpacks words into x (1 or 0), or with apply_signs clamps x to the recorded signs; counts the
// set bits for the caller's check.
void CometMaskDecodeGpu(const uint32_t* words, size_t count, float* x, bool apply_signs,
                        uint32_t* popcount) {
  const size_t nwords = comet_mask::words(count);
  uint32_t* d_count;
  CometGpuMalloc(reinterpret_cast<void**>(&d_count), sizeof(uint32_t));
  CUDA_CHECK(cudaMemset(d_count, 0, sizeof(uint32_t)));
  PopcountKernel<<<Blocks(nwords), CAFFE_CUDA_NUM_THREADS>>>(words, nwords, count, d_count);
  if (apply_signs) {
    ApplySignsKernel<<<Blocks(count), CAFFE_CUDA_NUM_THREADS>>>(words, count, x);
  } else {
    UnpackKernel<<<Blocks(count), CAFFE_CUDA_NUM_THREADS>>>(words, count, x);
  }
  CUDA_POST_KERNEL_CHECK;
  CUDA_CHECK(cudaMemcpy(popcount, d_count, sizeof(uint32_t), cudaMemcpyDeviceToHost));
  CometGpuFree(d_count, sizeof(uint32_t));
}

}  // namespace caffe
