#ifndef CAFFE_COMET_MASK_HPP_
#define CAFFE_COMET_MASK_HPP_

// Per-element logic of COMET's bit masks, shared by the CPU code and the CUDA kernels so that
// the CPU tests cover both. A mask holds one bit per value in 32-bit words, bit (i % 32) of word
// (i / 32), set when the value is positive.

#include <stdint.h>
#include <cstring>

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

#ifndef __CUDACC__
// The same functions on the host for a whole word of 32 values. A shift by the lane's number does
// not vectorize on baseline x86-64 (SSE2 has no per-lane shift): a blob's signs took 29 ms per
// 25.7 MB that way on one core. A test of each lane against a table of the 32 bits, and an
// integer select between the two results, vectorizes: 2.2 ms. Results are bit for bit those of
// the per-value functions (CometMaskTest.WordLoopsMatchTheValueFunctions).
namespace word32 {
inline const uint32_t* lane_bits() {
  alignas(64) static const uint32_t bits[32] = {
      1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
      1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
      1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
      1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};
  return bits;
}
// set ? a : b, as bits: all ones or all zeros in set.
inline float select(uint32_t set, float a, float b) {
  uint32_t ia, ib;
  std::memcpy(&ia, &a, sizeof(ia));
  std::memcpy(&ib, &b, sizeof(ib));
  const uint32_t r = (ia & set) | (ib & ~set);
  float out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}
inline uint32_t lane_set(uint32_t word, const uint32_t* bits, int b) {
  return 0u - static_cast<uint32_t>((word & bits[b]) != 0);
}
// The word of x[0..32): pack_word's bits, each lane's bit taken from the table where x > 0 (a
// shifted compare result would not vectorize either: 5.8 against 2.2 ms for 25.7 MB).
inline uint32_t pack(const float* x) {
  const uint32_t* bits = lane_bits();
  uint32_t word = 0;
  for (int b = 0; b < 32; ++b) word |= bits[b] & (0u - static_cast<uint32_t>(bit_of(x[b])));
  return word;
}
// o[b] = apply_sign(o[b], word, b)
inline void apply_signs(float* o, uint32_t word) {
  const uint32_t* bits = lane_bits();
  const float tiny = 1.17549435e-38f;
  for (int b = 0; b < 32; ++b) {
    const float v = o[b];
    o[b] = select(lane_set(word, bits, b), v > tiny ? v : tiny, v < 0.f ? v : 0.f);
  }
}
// o[b] = value_of(word, b)
inline void values(float* o, uint32_t word) {
  const uint32_t* bits = lane_bits();
  for (int b = 0; b < 32; ++b) o[b] = select(lane_set(word, bits, b), 1.f, 0.f);
}
// o[b] = relu_of(o[b], word, b, slope)
inline void relu(float* o, uint32_t word, float slope) {
  const uint32_t* bits = lane_bits();
  const float tiny = 1.17549435e-38f;
  for (int b = 0; b < 32; ++b) {
    const float v = o[b], z = slope * v;
    o[b] = select(lane_set(word, bits, b), v > tiny ? v : tiny, z < 0.f ? z : 0.f);
  }
}
// out[b] = t[b] * (bit b set ? 1 : slope): comet_codes::relu_diff
inline void relu_diff(const float* t, float* out, uint32_t word, float slope) {
  const uint32_t* bits = lane_bits();
  for (int b = 0; b < 32; ++b) out[b] = t[b] * select(lane_set(word, bits, b), 1.f, slope);
}
}  // namespace word32
#endif

}  // namespace comet_mask
}  // namespace caffe

#endif  // CAFFE_COMET_MASK_HPP_
