// COMET-Caffe: bit masks and packed codes on the GPU. The per-element logic is comet_mask::
// (mask.hpp) and comet_codes:: (codes.hpp), shared with the CPU path in payload.cpp.
#include "caffe/comet/codes.hpp"
#include "caffe/comet/mask.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/payload_gpu.hpp"
#include "caffe/comet/stream.hpp"
#include "caffe/util/device_alternate.hpp"

namespace caffe {

namespace {

// The kernels below add up popcounts (and flags) per thread over their grid-stride loops and
// then once per warp: one atomic per word on a single counter serialized up to about 5 million
// of them a CaffeNet step at batch 256 (issue 16; counted from the shapes: 5.3 million words
// in its ReLU outputs). Every thread of a warp reaches the sum (blocks are whole warps),
// whatever its loop did.
static_assert(CAFFE_CUDA_NUM_THREADS % 32 == 0, "blocks of whole warps");

__device__ void AddPerWarp(uint32_t count, int flag, uint32_t* total, int* any) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    count += __shfl_down_sync(0xffffffffu, count, offset);
    flag |= __shfl_down_sync(0xffffffffu, flag, offset);
  }
  if ((threadIdx.x & 31) == 0) {
    if (count) atomicAdd(total, count);
    if (flag && any) atomicOr(any, 1);
  }
}

__global__ void PackKernel(const float* x, size_t count, uint32_t* words, size_t nwords,
                           uint32_t* popcount, int* nonfinite) {
  uint32_t pc = 0;
  int any_bad = 0;
  for (size_t w = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; w < nwords;
       w += static_cast<size_t>(blockDim.x) * gridDim.x) {
    bool bad = false;
    const uint32_t word = comet_mask::pack_word(x, count, w, &bad);
    words[w] = word;
    pc += __popc(word);
    any_bad |= bad;
  }
  AddPerWarp(pc, any_bad, popcount, nonfinite);
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

// Popcount of a stream of total_bits bits, and whether a bit past the end is set (the host
// then takes the complement, as HostPopcount does: the count fails the caller's check).
__global__ void PopcountKernel(const uint32_t* words, size_t nwords, size_t total_bits,
                               uint32_t* popcount, int* tail_set) {
  uint32_t pc = 0;
  int tail = 0;
  for (size_t w = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; w < nwords;
       w += static_cast<size_t>(blockDim.x) * gridDim.x) {
    const uint32_t word = words[w];
    if (w == nwords - 1 && total_bits % 32 && (word >> (total_bits % 32))) tail = 1;
    pc += __popc(word);
  }
  AddPerWarp(pc, tail, popcount, tail_set);
}

__global__ void PackCodesKernel(const int32_t* v, size_t count, int bits, bool argmax,
                                comet_codes::PoolGeometry g, comet_codes::BinaryRule r,
                                uint32_t* words, size_t nwords,
                                uint32_t* popcount, int* bad) {
  uint32_t pc = 0;
  int any_bad = 0;
  for (size_t w = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; w < nwords;
       w += static_cast<size_t>(blockDim.x) * gridDim.x) {
    bool b = false;
    const uint32_t word = comet_codes::pack_codes(v, count, bits, w, argmax, g, r, &b);
    words[w] = word;
    pc += __popc(word);
    any_bad |= b;
  }
  AddPerWarp(pc, any_bad, popcount, bad);
}

// Raises *bad for an argmax code that names no element of its window, as the host's decode does.
__global__ void UnpackCodesKernel(const uint32_t* words, size_t count, int bits, bool argmax,
                                  comet_codes::PoolGeometry g, comet_codes::BinaryRule r,
                                  int32_t* v, int* bad) {
  int any_bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(blockDim.x) * gridDim.x) {
    v[i] = comet_codes::unpack_code(words, i, bits, argmax, g, r);
    if (argmax && !comet_codes::argmax_code_names_its_window(comet_codes::code_at(words, i, bits),
                                                              i, g))
      any_bad = 1;
  }
  AddPerWarp(0, any_bad, NULL, bad);
}

__global__ void ReluBackwardKernel(const uint32_t* words, size_t count, const float* top_diff,
                                   float* bottom_diff, float negative_slope) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(blockDim.x) * gridDim.x) {
    bottom_diff[i] = comet_codes::relu_diff(top_diff[i], words[i / 32],
                                            static_cast<int>(i % 32), negative_slope);
  }
}

// Max pooling into codes: a thread per pooled element, as upstream's MaxPoolForward (adjacent
// threads read adjacent windows), and the codes of a word gathered from its lanes with shuffles.
// A warp's 32 elements start at a multiple of 32 (blocks and the grid's stride are whole warps),
// so a word's 32 / bits elements are lanes of one warp; every lane takes part in the shuffles.
__global__ void PoolToCodesKernel(const float* bottom, float* top, size_t count, int bits,
                                  comet_codes::PoolGeometry g, uint32_t* words,
                                  uint32_t* popcount, int* bad) {
  const size_t pooled = static_cast<size_t>(g.pooled_height) * g.pooled_width;
  const size_t plane = static_cast<size_t>(g.height) * g.width;
  const int per = 32 / bits;
  const int lane = threadIdx.x & 31;
  uint32_t pc = 0;
  int any_bad = 0;
  for (size_t base = blockIdx.x * static_cast<size_t>(blockDim.x) + (threadIdx.x - lane);
       base < count; base += static_cast<size_t>(blockDim.x) * gridDim.x) {
    const size_t i = base + lane;
    uint32_t part = 0;
    if (i < count) {
      const size_t q = i / pooled, r = i - q * pooled;
      float m = 0.f;
      uint32_t code = 0;
      if (!comet_codes::max_of_window(bottom + q * plane, static_cast<int>(r / g.pooled_width),
                                      static_cast<int>(r % g.pooled_width), g, &m, &code)) {
        any_bad = 1;
        code = 0;
      }
      top[i] = m;
      part = code << ((lane % per) * bits);
    }
    for (int o = per / 2; o > 0; o >>= 1) part |= __shfl_down_sync(0xffffffffu, part, o);
    if (lane % per == 0 && i < count) {
      words[i / per] = part;
      pc += __popc(part);
    }
  }
  AddPerWarp(pc, any_bad, popcount, bad);
}

// Max pooling's backward from codes: a thread per bottom element, as upstream's MaxPoolBackward.
// A gather drops a code that names no element of its window without a trace, so the same grid
// also checks each of the `count` codes, and raises *bad for such a one (the host's scatter
// refuses it).
__global__ void PoolBackwardKernel(const uint32_t* words, size_t count, int bits,
                                   comet_codes::PoolGeometry g, const float* top_diff,
                                   float* bottom_diff, size_t bottom_count, int* bad) {
  const size_t plane = static_cast<size_t>(g.height) * g.width;
  const size_t pooled = static_cast<size_t>(g.pooled_height) * g.pooled_width;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = first; i < bottom_count; i += stride) {
    const size_t q = i / plane, r = i - q * plane;
    bottom_diff[i] = comet_codes::max_pool_diff_at(
        words, bits, q * pooled, top_diff + q * pooled, static_cast<int>(r / g.width),
        static_cast<int>(r % g.width), g);
  }
  int any_bad = 0;
  for (size_t i = first; i < count; i += stride)
    if (!comet_codes::argmax_code_names_its_window(comet_codes::code_at(words, i, bits), i, g))
      any_bad = 1;
  AddPerWarp(0, any_bad, NULL, bad);
}

const int kThreads = CAFFE_CUDA_NUM_THREADS;

// This thread's stream (stream.hpp): the default one in the step, the store's own on its worker.
cudaStream_t Stream() { return static_cast<cudaStream_t>(CometStream()); }

// A few bytes a kernel on this thread's stream wrote, read back once the stream got there.
void ReadBack(void* host, const void* device, size_t bytes) {
  COMET_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, Stream()));
  COMET_CUDA_CHECK(cudaStreamSynchronize(Stream()));
}

int Blocks(size_t n) {
  const size_t b = (n + CAFFE_CUDA_NUM_THREADS - 1) / CAFFE_CUDA_NUM_THREADS;
  return static_cast<int>(b < 4096 ? (b ? b : 1) : 4096);
}

// Runs `launch(popcount, flag, second)` on three device counters set to 0 and reads them back
// at once: the popcount its kernels summed and whether any thread raised either flag.
template <typename Launch>
void LaunchCounting(Launch launch, uint32_t* popcount, bool* flag, bool* second = NULL) {
  uint32_t* d_counts;  // [popcount, flag, second]
  CometGpuMalloc(reinterpret_cast<void**>(&d_counts), 3 * sizeof(uint32_t));
  COMET_CUDA_CHECK(cudaMemsetAsync(d_counts, 0, 3 * sizeof(uint32_t), Stream()));
  launch(d_counts, reinterpret_cast<int*>(d_counts + 1), reinterpret_cast<int*>(d_counts + 2));
  COMET_CUDA_CHECK(cudaPeekAtLastError());
  uint32_t h[3];
  ReadBack(h, d_counts, sizeof(h));
  CometGpuFree(d_counts, 3 * sizeof(uint32_t));
  *popcount = h[0];
  *flag = h[1] != 0;
  if (second) *second = h[2] != 0;
}

}  // namespace

void CometMaskPackGpu(const float* x, size_t count, uint32_t* words, uint32_t* popcount,
                      bool* nonfinite) {
  const size_t nwords = comet_mask::words(count);
  LaunchCounting([&](uint32_t* pc, int* flag, int*) {
    PackKernel<<<Blocks(nwords), kThreads, 0, Stream()>>>(x, count, words, nwords, pc, flag);
  }, popcount, nonfinite);
}

// Runs `launch(bad)` (the kernels that read the stream; they may raise *bad), then sets *popcount
// to the popcount of the device bit stream for the callers' checks, the same figure as
// HostPopcount's (payload.cpp), a corrupt stream's included; one read back for both.
template <typename Launch>
void ReadThenCount(Launch launch, const uint32_t* words, size_t total_bits, uint32_t* popcount,
                   bool* bad = NULL) {
  const size_t nwords = (total_bits + 31) / 32;
  bool tail_set = false;
  LaunchCounting([&](uint32_t* pc, int* tail, int* flag) {
    launch(flag);
    PopcountKernel<<<Blocks(nwords), kThreads, 0, Stream()>>>(words, nwords, total_bits, pc, tail);
  }, popcount, &tail_set, bad);
  if (tail_set) *popcount = ~*popcount;
}

// Unpacks words into x (1 or 0), or with apply_signs clamps x to the recorded signs; counts the
// set bits for the caller's check.
void CometMaskDecodeGpu(const uint32_t* words, size_t count, float* x, bool apply_signs,
                        uint32_t* popcount) {
  ReadThenCount([&](int*) {
    if (apply_signs) {
      ApplySignsKernel<<<Blocks(count), kThreads, 0, Stream()>>>(words, count, x);
    } else {
      UnpackKernel<<<Blocks(count), kThreads, 0, Stream()>>>(words, count, x);
    }
  }, words, count, popcount);
}

void CometCodesPackGpu(const int32_t* v, size_t count, int bits, bool argmax,
                       const comet_codes::PoolGeometry& g, const comet_codes::BinaryRule& r,
                       uint32_t* words, uint32_t* popcount, bool* bad) {
  const size_t nwords = comet_codes::words(count, bits);
  LaunchCounting([&](uint32_t* pc, int* flag, int*) {
    PackCodesKernel<<<Blocks(nwords), kThreads, 0, Stream()>>>(v, count, bits, argmax, g, r, words,
        nwords, pc, flag);
  }, popcount, bad);
}

void CometCodesUnpackGpu(const uint32_t* words, size_t count, int bits, bool argmax,
                         const comet_codes::PoolGeometry& g, const comet_codes::BinaryRule& r,
                         int32_t* v, uint32_t* popcount, bool* bad) {
  ReadThenCount([&](int* flag) {
    UnpackCodesKernel<<<Blocks(count), kThreads, 0, Stream()>>>(words, count, bits, argmax, g, r,
                                                                 v, flag);
  }, words, count * bits, popcount, bad);
}

void CometReluBackwardGpu(const uint32_t* words, size_t count, const float* top_diff,
                          float* bottom_diff, float negative_slope, uint32_t* popcount) {
  ReadThenCount([&](int*) {
    ReluBackwardKernel<<<Blocks(count), kThreads, 0, Stream()>>>(words, count, top_diff,
                                                                  bottom_diff, negative_slope);
  }, words, count, popcount);
}

void CometPoolToCodesGpu(const float* bottom, float* top, size_t count, int bits,
                         const comet_codes::PoolGeometry& g, uint32_t* words, uint32_t* popcount,
                         bool* bad) {
  LaunchCounting([&](uint32_t* pc, int* flag, int*) {
    PoolToCodesKernel<<<Blocks(count), kThreads, 0, Stream()>>>(bottom, top, count, bits, g, words,
        pc, flag);
  }, popcount, bad);
}

void CometPoolBackwardGpu(const uint32_t* words, size_t count, int bits,
                          const comet_codes::PoolGeometry& g, const float* top_diff,
                          float* bottom_diff, uint32_t* popcount, bool* bad) {
  const size_t pooled = static_cast<size_t>(g.pooled_height) * g.pooled_width;
  const size_t bottom_count = count / pooled * g.height * g.width;
  ReadThenCount([&](int* flag) {
    PoolBackwardKernel<<<Blocks(bottom_count), kThreads, 0, Stream()>>>(words, count, bits, g,
        top_diff, bottom_diff, bottom_count, flag);
  }, words, count * bits, popcount, bad);
}

}  // namespace caffe
