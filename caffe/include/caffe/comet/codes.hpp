#ifndef CAFFE_COMET_CODES_HPP_
#define CAFFE_COMET_CODES_HPP_

// Per-element logic of COMET's packed codes, shared by the CPU code and the CUDA kernels so that
// the CPU tests cover both. A code is a small unsigned integer of `bits` bits (1, 2, 4, 8 or 16,
// so that codes never straddle a word); element i sits at bit (i * bits) % 32 of word
// (i * bits) / 32. Two kinds of integer buffers are stored this way, losslessly:
//  - max pooling's argmax: the index of the maximum within its bottom plane, coded as its offset
//    inside the pooling window (4 bits for a 3x3 window instead of 32);
//  - Dropout's mask: 0 or 1, one bit.

#include <stdint.h>

#include "caffe/comet/mask.hpp"  // COMET_HD

namespace caffe {
namespace comet_codes {

// Geometry of one max pooling layer, as PoolingLayer computes its windows.
struct PoolGeometry {
  int height, width;            // bottom plane
  int pooled_height, pooled_width;
  int kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w;
};

// Dropout's mask as a one-bit code: the bit is v > threshold, restored as `one` or 0. The CPU
// layer keeps 0 or 1 (threshold 0, one 1; any other value is refused); the GPU layer keeps raw
// random words and asks mask > uint_thres_ (threshold uint_thres_, one UINT_MAX: restored words
// compare exactly as the originals did).
struct BinaryRule {
  uint32_t threshold, one;
};

// Smallest of 1, 2, 4, 8, 16 bits that holds codes 0 .. ncodes-1; 0 when none does.
COMET_HD int bits_for(uint32_t ncodes) {
  for (int b = 1; b <= 16; b *= 2)
    if (ncodes <= (1u << b)) return b;
  return 0;
}
COMET_HD size_t words(size_t count, int bits) { return (count * bits + 31) / 32; }
COMET_HD uint32_t code_at(const uint32_t* w, size_t i, int bits) {
  const size_t bit = i * bits;
  return (w[bit / 32] >> (bit % 32)) & ((bits == 32 ? 0u : (1u << bits)) - 1u);
}

// The argmax `idx` of pooled element i (flattened over planes and pooled positions) as its
// offset in the unclamped window; false when it lies outside (upstream's -1 for a window of NaN).
// (ph, pw): the pooled position of element i.
// The code of bottom position (row, col) in the window of pooled position (ph, pw).
COMET_HD bool window_code(int row, int col, int ph, int pw, const PoolGeometry& g,
                          uint32_t* code) {
  const int dh = row - (ph * g.stride_h - g.pad_h);
  const int dw = col - (pw * g.stride_w - g.pad_w);
  if (dh < 0 || dh >= g.kernel_h || dw < 0 || dw >= g.kernel_w) return false;
  *code = static_cast<uint32_t>(dh * g.kernel_w + dw);
  return true;
}
COMET_HD bool argmax_code_at(int idx, int ph, int pw, const PoolGeometry& g, uint32_t* code) {
  return idx >= 0 && window_code(idx / g.width, idx % g.width, ph, pw, g, code);
}

// n / d for 0 <= n < 2^31 and 1 <= d < 2^31 as a multiply and a shift, for the host's argmax
// encoder (a division per element was most of its time). Exact: with 2^l >= d, k = 31 + l and
// m = ceil(2^k / d), n * m / 2^k exceeds n / d by less than 2^31 * d / (d * 2^k) = 2^-l <= 1/d.
struct Divider {
  uint64_t m;
  int k;
};
COMET_HD Divider make_divider(uint32_t d) {
  if (d == 0) d = 1;  // no plane is 0 wide; never divide by it
  int l = 0;
  while ((1ull << l) < d) ++l;
  const int k = 31 + l;
  return Divider{((1ull << k) + d - 1) / d, k};
}
COMET_HD uint32_t divide(uint32_t n, const Divider& v) {
  return static_cast<uint32_t>((n * v.m) >> v.k);
}
// argmax_code_at with the plane's width as a Divider (by = make_divider(g.width)).
COMET_HD bool argmax_code_fast(int idx, int ph, int pw, const PoolGeometry& g, const Divider& by,
                               uint32_t* code) {
  if (idx < 0) return false;
  const int row = static_cast<int>(divide(static_cast<uint32_t>(idx), by));
  return window_code(row, idx - row * g.width, ph, pw, g, code);
}
COMET_HD bool argmax_code(int idx, size_t i, const PoolGeometry& g, uint32_t* code) {
  return argmax_code_at(idx, static_cast<int>((i / g.pooled_width) % g.pooled_height),
                        static_cast<int>(i % g.pooled_width), g, code);
}
COMET_HD int argmax_index_at(uint32_t code, int ph, int pw, const PoolGeometry& g) {
  const int h = ph * g.stride_h - g.pad_h + static_cast<int>(code) / g.kernel_w;
  const int w = pw * g.stride_w - g.pad_w + static_cast<int>(code) % g.kernel_w;
  return h * g.width + w;
}
COMET_HD int argmax_index(uint32_t code, size_t i, const PoolGeometry& g) {
  return argmax_index_at(code, static_cast<int>((i / g.pooled_width) % g.pooled_height),
                         static_cast<int>(i % g.pooled_width), g);
}

// Packs the codes of elements in word wi; *bad is set when an element cannot be coded. `argmax`
// selects argmax codes (values are indices) or binary codes (values are 0 or 1).
COMET_HD uint32_t pack_codes(const int32_t* v, size_t count, int bits, size_t wi, bool argmax,
                             const PoolGeometry& g, const BinaryRule& r, bool* bad) {
  const size_t per = 32 / bits;
  const size_t begin = wi * per;
  const size_t end = begin + per < count ? begin + per : count;
  uint32_t word = 0;
  for (size_t i = begin; i < end; ++i) {
    uint32_t code = 0;
    if (argmax) {
      if (!argmax_code(v[i], i, g, &code)) *bad = true;
    } else {
      const uint32_t u = static_cast<uint32_t>(v[i]);
      if (r.one == 1u && u > 1u) *bad = true;
      code = u > r.threshold ? 1u : 0u;
    }
    word |= code << ((i - begin) * bits);
  }
  return word;
}
COMET_HD int32_t unpack_code(const uint32_t* w, size_t i, int bits, bool argmax,
                             const PoolGeometry& g, const BinaryRule& r) {
  const uint32_t code = code_at(w, i, bits);
  return argmax ? argmax_index(code, i, g) : static_cast<int32_t>(code ? r.one : 0u);
}

// Max pooling straight into codes (comet { pool_codes }): the layer's forward and backward on
// the packed argmax, so that the int32 argmax is never dense. Both follow PoolingLayer exactly
// (with patch 0015): the results are the same bit for bit.

// The max of the window of pooled position (ph, pw) over one bottom plane, the window's first
// element starting it and a NaN replacing any number; its position's code in *code. False for
// an empty window, which Caffe's Reshape never makes (pad < kernel, last window starts inside).
COMET_HD bool max_of_window(const float* plane, int ph, int pw, const PoolGeometry& g, float* max,
                            uint32_t* code) {
  const int h0 = ph * g.stride_h - g.pad_h, w0 = pw * g.stride_w - g.pad_w;  // unclamped corner
  const int hend = h0 + g.kernel_h < g.height ? h0 + g.kernel_h : g.height;
  const int wend = w0 + g.kernel_w < g.width ? w0 + g.kernel_w : g.width;
  const int hstart = h0 > 0 ? h0 : 0, wstart = w0 > 0 ? w0 : 0;
  if (hstart >= hend || wstart >= wend) return false;
  float m = plane[hstart * g.width + wstart];
  int mh = hstart, mw = wstart;
  for (int h = hstart; h < hend; ++h) {
    for (int w = wstart; w < wend; ++w) {
      const float v = plane[h * g.width + w];
      if (v > m || (v != v && m == m)) {
        m = v;
        mh = h;
        mw = w;
      }
    }
  }
  *max = m;
  *code = static_cast<uint32_t>((mh - h0) * g.kernel_w + (mw - w0));
  return true;
}

// The forward of the pooled elements of code word wi (flattened over planes and pooled positions,
// as the top blob is): their maxima into top, their codes packed in the word returned. *bad is
// set for an empty window. The host's loop; the device kernel runs max_of_window per element and
// gathers a word's codes from the lanes of a warp.
COMET_HD uint32_t max_pool_word(const float* bottom, float* top, size_t count, int bits,
                                size_t wi, const PoolGeometry& g, bool* bad) {
  const size_t per = 32 / bits;
  const size_t begin = wi * per;
  const size_t end = begin + per < count ? begin + per : count;
  const size_t pooled = static_cast<size_t>(g.pooled_height) * g.pooled_width;
  const size_t plane = static_cast<size_t>(g.height) * g.width;
  uint32_t word = 0;
  for (size_t i = begin; i < end; ++i) {
    const size_t q = i / pooled, r = i - q * pooled;
    const int ph = static_cast<int>(r / g.pooled_width), pw = static_cast<int>(r % g.pooled_width);
    uint32_t code = 0;
    float m = 0.f;
    if (!max_of_window(bottom + q * plane, ph, pw, g, &m, &code)) *bad = true;
    top[i] = m;
    word |= code << ((i - begin) * bits);
  }
  return word;
}

// The gradient at bottom position (h, w) of one plane, gathered as upstream's MaxPoolBackward
// kernel does: the sum, in pooled order from 0, of the top diffs of the windows whose code names
// (h, w). `first`: the index of the plane's first code; top_diff: the plane's top diffs. Every
// window holding (h, w) gives it a code below kernel_h * kernel_w: a corrupt code matches none.
COMET_HD float max_pool_diff_at(const uint32_t* words, int bits, size_t first,
                                const float* top_diff, int h, int w, const PoolGeometry& g) {
  const int hp = h + g.pad_h, wp = w + g.pad_w;
  const int phstart = hp < g.kernel_h ? 0 : (hp - g.kernel_h) / g.stride_h + 1;
  const int pwstart = wp < g.kernel_w ? 0 : (wp - g.kernel_w) / g.stride_w + 1;
  const int phend = hp / g.stride_h + 1 < g.pooled_height ? hp / g.stride_h + 1 : g.pooled_height;
  const int pwend = wp / g.stride_w + 1 < g.pooled_width ? wp / g.stride_w + 1 : g.pooled_width;
  float gradient = 0.f;
  for (int ph = phstart; ph < phend; ++ph) {
    for (int pw = pwstart; pw < pwend; ++pw) {
      const size_t r = static_cast<size_t>(ph) * g.pooled_width + pw;
      const uint32_t mine =
          static_cast<uint32_t>((hp - ph * g.stride_h) * g.kernel_w + (wp - pw * g.stride_w));
      if (code_at(words, first + r, bits) == mine) gradient += top_diff[r];
    }
  }
  return gradient;
}

// The bottom position a code names in the window of (ph, pw), checked to lie in the plane (a
// corrupt code may name padding or another window's row); -1 if it does not.
COMET_HD int max_pool_target(uint32_t code, int ph, int pw, const PoolGeometry& g) {
  if (code >= static_cast<uint32_t>(g.kernel_h * g.kernel_w)) return -1;
  const int h = ph * g.stride_h - g.pad_h + static_cast<int>(code) / g.kernel_w;
  const int w = pw * g.stride_w - g.pad_w + static_cast<int>(code) % g.kernel_w;
  return h >= 0 && h < g.height && w >= 0 && w < g.width ? h * g.width + w : -1;
}
// Whether the argmax code of pooled element i (flattened over planes and pooled positions) names
// an element of its window inside the plane: every code the forward writes does; a corrupt one
// whose popcount still matches may not, and would send a gradient outside its window.
COMET_HD bool argmax_code_names_its_window(uint32_t code, size_t i, const PoolGeometry& g) {
  return max_pool_target(code, static_cast<int>((i / g.pooled_width) % g.pooled_height),
                         static_cast<int>(i % g.pooled_width), g) >= 0;
}

// ReLU's backward from the sign mask alone: upstream computes
// top_diff * ((x > 0) + negative_slope * (x <= 0)), and the mask bit is x > 0.
COMET_HD float relu_diff(float top_diff, uint32_t word, int bit, float negative_slope) {
  return top_diff * (((word >> bit) & 1u) ? 1.f : negative_slope);
}

}  // namespace comet_codes
}  // namespace caffe

#endif  // CAFFE_COMET_CODES_HPP_
