#ifndef CAFFE_COMET_MASK_HPP_
#define CAFFE_COMET_MASK_HPP_

// Per-element logic of COMET's bit masks, shared by the CPU code and the CUDA kernels so that
// the CPU tests cover both. A mask holds one bit per value in 32-bit words, bit (i % 32) of word
// (i / 32), set when the value is positive.

#include <stdint.h>

#ifdef __CUDACC__
#define COMET_HD __host__ __device__ __forceinline__
#else
#define COMET_HD inline
#endif

namespace caffe {
namespace comet_mask {

COMET_HD size_t words(size_t count) { return (count + 31) / 32; }
COMET_HD bool bit_of(float x) { return x > 0.f; }
COMET_HD bool finite(float x) { return x - x == 0.f; }  // false for NaN and +-Inf
COMET_HD float value_of(uint32_t word, int bit) { return ((word >> bit) & 1u) ? 1.f : 0.f; }
// Clamps a decoded value to the sign its mask bit records, moving it by no more than the
// distance to the true value (which lies on that side of zero).
COMET_HD float apply_sign(float v, uint32_t word, int bit) {
  const float tiny = 1.17549435e-38f;  // FLT_MIN: the smallest normal positive float
  if ((word >> bit) & 1u) return v > tiny ? v : tiny;
  return v < 0.f ? v : 0.f;
}
// In-place ReLU's output rebuilt from its input y (itself rebuilt, off by at most e) and the mask
// of the true output: where the mask is 1, y clamped positive (off by e at most); elsewhere
// slope * y clamped to <= 0 (slope >= 0; off by slope * e at most, exactly 0 for plain ReLU).
COMET_HD float relu_of(float y, uint32_t word, int bit, float slope) {
  if ((word >> bit) & 1u) return apply_sign(y, word, bit);
  const float z = slope * y;
  return z < 0.f ? z : 0.f;
}
// Packs values [32*w, 32*w + 32) of x (clipped to count) into one word.
COMET_HD uint32_t pack_word(const float* x, size_t count, size_t w, bool* nonfinite) {
  uint32_t word = 0;
  const size_t begin = 32 * w;
  const size_t end = begin + 32 < count ? begin + 32 : count;
  for (size_t i = begin; i < end; ++i) {
    word |= static_cast<uint32_t>(bit_of(x[i])) << (i - begin);
    if (!finite(x[i])) *nonfinite = true;
  }
  return word;
}

}  // namespace comet_mask
}  // namespace caffe

#endif  // CAFFE_COMET_MASK_HPP_
