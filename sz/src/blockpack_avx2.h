// blockpack_avx2.h - the host encoder's full blocks in AVX2 registers (x86-64 only).
//
// A 32-value block is four 8-lane vectors: quantization, both predictors' statistics and the
// gather of the nonzero codes run on them, and only the bit packing of the k-bit fields stays
// scalar (pack_fields). Same IEEE operations as quantize_block (a multiply, a round to
// nearest even, a multiply and a subtraction, no contraction), so the codes, the descriptor
// and the bytes equal encode_block's; a block with any value quantize_block would flag goes
// back to encode_block. The gather uses a table of lane orders per 8-bit mask in place of
// one scalar step per nonzero (the largest single cost of the scalar encoder after
// quantization). test_stages compares both encoders block by block.
#pragma once
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define SZ_HAVE_AVX2_ENCODER 1
#include <immintrin.h>
#include "blockpack.h"

#define SZ_AVX2_TARGET __attribute__((target("avx2,popcnt,bmi")))

namespace szi {
namespace avx2 {

// For each 8-bit mask, the lanes of its set bits in order (then lane 0): 8 bytes a mask.
struct GatherTable {
  uint64_t lanes[256] = {};
  constexpr GatherTable() {
    for (int m = 0; m < 256; ++m) {
      int j = 0;
      for (int i = 0; i < 8; ++i)
        if ((m >> i) & 1) lanes[m] |= (uint64_t)i << (8 * j++);
    }
  }
};
inline constexpr GatherTable kGather{};

// For each 8-bit mask, lane i of a set bit i takes compact element popcount(mask below i)
// (lanes of clear bits take 0 and are zeroed after): 8 bytes a mask.
struct ScatterTable {
  uint64_t lanes[256] = {};
  constexpr ScatterTable() {
    for (int m = 0; m < 256; ++m) {
      int j = 0;
      for (int i = 0; i < 8; ++i)
        if ((m >> i) & 1) lanes[m] |= (uint64_t)j++ << (8 * i);
    }
  }
};
inline constexpr ScatterTable kScatter{};

// The statistics code_stats gives, of four vectors.
struct VecStats {
  uint32_t bitmap, maxm;
  int nnz;
  bool neg;
};

SZ_AVX2_TARGET inline VecStats vec_stats(const __m256i* v) {
  const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi32(-1);
  __m256i orm = zero;
  uint32_t bitmap = 0, negbits = 0;
  for (int k = 0; k < 4; ++k) {
    const __m256i eqz = _mm256_cmpeq_epi32(v[k], zero);
    // |c| - 1 for nonzeros, 0 for zeros
    orm = _mm256_or_si256(orm, _mm256_add_epi32(_mm256_abs_epi32(v[k]), _mm256_xor_si256(eqz, ones)));
    bitmap |= (uint32_t)(~_mm256_movemask_ps(_mm256_castsi256_ps(eqz)) & 0xFF) << (8 * k);
    negbits |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(v[k])) << (8 * k);
  }
  __m128i o = _mm_or_si128(_mm256_castsi256_si128(orm), _mm256_extracti128_si256(orm, 1));
  o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0x4E));
  o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0xB1));
  return VecStats{bitmap, (uint32_t)_mm_cvtsi128_si32(o), __builtin_popcount(bitmap), negbits != 0};
}

// Encodes a full block (32 values) as encode_block<true> does. Returns false, writing
// nothing, when quantize_block would flag a value (the caller then runs encode_block).
SZ_AVX2_TARGET inline bool encode_block32(const float* x, uint64_t row_pos, uint64_t W,
                                          const QuantParams& p, uint16_t* desc, uint8_t* out,
                                          uint32_t* size) {
  const __m256 inv = _mm256_set1_ps(p.inv_two_eb), two = _mm256_set1_ps(p.two_eb);
  const __m256 ebv = _mm256_set1_ps(p.eb), qmax = _mm256_set1_ps(kQMax);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256i q[4];
  int ok = 0xFF;
  for (int k = 0; k < 4; ++k) {
    const __m256 xv = _mm256_loadu_ps(x + 8 * k);
    const __m256 t = _mm256_mul_ps(xv, inv);
    const __m256 valid = _mm256_cmp_ps(_mm256_and_ps(t, absmask), qmax, _CMP_LT_OQ);
    // round half to even, as quantize_block's (|t| + 2^23) - 2^23 with t's sign
    const __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[k] = _mm256_and_si256(_mm256_cvttps_epi32(r), _mm256_castps_si256(valid));
    const __m256 d = _mm256_sub_ps(xv, _mm256_mul_ps(_mm256_cvtepi32_ps(q[k]), two));
    const __m256 good = _mm256_and_ps(_mm256_cmp_ps(_mm256_and_ps(d, absmask), ebv, _CMP_LT_OQ), valid);
    ok &= _mm256_movemask_ps(good);
  }
  if (ok != 0xFF) return false;
  const VecStats s0 = vec_stats(q);
  if (s0.nnz == 0) {
    *desc = kDescZero;
    *size = 0;
    return true;
  }
  // 1-D Lorenzo on the codes: lane i minus lane i-1 across the four vectors, except at row starts
  __m256i c[4];
  const uint32_t starts = row_start_mask(row_pos, W);
  const __m256i rot = _mm256_setr_epi32(7, 0, 1, 2, 3, 4, 5, 6);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i prev_rot = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    const __m256i r = _mm256_permutevar8x32_epi32(q[k], rot);
    const __m256i prev = _mm256_blend_epi32(r, prev_rot, 0x01);  // lane 0: lane 7 of the vector before
    prev_rot = r;
    const __m256i sel = _mm256_and_si256(_mm256_set1_epi32((int)(starts >> (8 * k))), lane_bit);
    const __m256i is_start = _mm256_cmpeq_epi32(sel, lane_bit);
    c[k] = _mm256_blendv_epi8(_mm256_sub_epi32(q[k], prev), q[k], is_start);
  }
  const VecStats s1 = vec_stats(c);
  const CodeStats cs0{s0.bitmap, s0.nnz, s0.maxm, s0.neg}, cs1{s1.bitmap, s1.nnz, s1.maxm, s1.neg};
  const uint16_t d0 = make_desc(cs0, kPredNone), d1 = make_desc(cs1, kPredLorenzo);
  const uint32_t z0 = block_data_size(d0, kBlock), z1 = block_data_size(d1, kBlock);
  const bool use1 = z1 < z0;
  const __m256i* v = use1 ? c : q;
  const VecStats& s = use1 ? s1 : s0;
  *desc = use1 ? d1 : d0;
  *size = use1 ? z1 : z0;
  if (!out) return true;

  // gather the nonzero codes, then their signs and |c| - 1 (0 past the count)
  // zeroed with five vector stores: `= {}` on 160 bytes became a `rep stos`, 14% of the
  // encoder's time on dense blocks (perf, ResNet-18 training)
  alignas(32) int32_t packed[kBlock + 8];
  for (int k = 0; k < kBlock + 8; k += 8)
    _mm256_store_si256((__m256i*)(packed + k), _mm256_setzero_si256());
  int j = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t m = (s.bitmap >> (8 * k)) & 0xFFu;
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)&kGather.lanes[m]));
    _mm256_storeu_si256((__m256i*)(packed + j), _mm256_permutevar8x32_epi32(v[k], lanes));
    j += __builtin_popcount(m);
  }
  const int nnz = s.nnz, kbits = *desc & 31;
  alignas(32) uint32_t mags[kBlock];
  uint32_t sign = 0;
  const __m256i one = _mm256_set1_epi32(1), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int k = 0; k < 4; ++k) {
    const __m256i pv = _mm256_load_si256((const __m256i*)(packed + 8 * k));
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(nnz - 8 * k), lane);
    sign |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(pv, live))) << (8 * k);
    _mm256_store_si256((__m256i*)(mags + 8 * k),
                       _mm256_and_si256(_mm256_sub_epi32(_mm256_abs_epi32(pv), one), live));
  }
  uint8_t* o = out;
  if (nnz < kBlock) { store_u32le(o, s.bitmap); o += 4; }
  if (s.neg)
    for (int b = 0; b < (nnz + 7) / 8; ++b) *o++ = (uint8_t)(sign >> (8 * b));
  if (kbits) {
    uint8_t buf[kFieldBuf];
    pack_fields(kbits, nnz, mags, buf);
    memcpy(o, buf, (size_t)(nnz * kbits + 7) / 8);
  }
  return true;
}

// Decodes a full block (32 values) whose descriptor is neither zero nor raw, as
// decode_block<true> does; false when the data contradicts the descriptor.
SZ_AVX2_TARGET inline bool decode_block32(const uint8_t* d, uint16_t desc, uint64_t row_pos,
                                          uint64_t W, float two_eb, float* y) {
  const int k = desc & 31, pred = (desc >> 5) & 1, signs = (desc >> 6) & 1, nnz = (desc >> 7) & 63;
  const uint8_t* const end = d + block_data_size(desc, kBlock);
  uint32_t bitmap = 0xFFFFFFFFu;
  if (nnz < kBlock) { bitmap = load_u32le(d); d += 4; }
  uint32_t sign = 0;
  if (signs) {
    for (int b = 0; b < (nnz + 7) / 8; ++b) sign |= (uint32_t)d[b] << (8 * b);
    d += (nnz + 7) / 8;
  }
  if (__builtin_popcount(bitmap) != nnz) return false;
  alignas(32) uint32_t mags[kBlock];
  if (k) {
    alignas(32) uint8_t buf[kFieldBuf];  // zeroed as `packed` in encode_block32 (no rep stos)
    for (int i = 0; i < kFieldBuf; i += 32) _mm256_store_si256((__m256i*)(buf + i), _mm256_setzero_si256());
    memcpy(buf, d, (size_t)(end - d));  // (nnz * k + 7) / 8 <= 124 bytes
    unpack_fields(k, nnz, buf, mags);
  } else {
    memset(mags, 0, sizeof(mags));
  }
  // signed compact codes: |c| = field + 1, negated where the sign bit is set
  alignas(32) int32_t vals[kBlock + 8];
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int g = 0; g < 4; ++g) {
    const __m256i mag = _mm256_add_epi32(_mm256_load_si256((const __m256i*)(mags + 8 * g)), one);
    const __m256i sb = _mm256_and_si256(_mm256_set1_epi32((int)(sign >> (8 * g))), lane_bit);
    const __m256i neg = _mm256_cmpeq_epi32(sb, lane_bit);  // -1 where negative
    _mm256_store_si256((__m256i*)(vals + 8 * g),
                       _mm256_sub_epi32(_mm256_xor_si256(mag, neg), neg));
  }
  _mm256_store_si256((__m256i*)(vals + kBlock), _mm256_setzero_si256());
  // scatter them to the set bits of the bitmap
  __m256i c[4];
  int off = 0;
  for (int g = 0; g < 4; ++g) {
    const uint32_t m = (bitmap >> (8 * g)) & 0xFFu;
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)&kScatter.lanes[m]));
    const __m256i v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(vals + off)), lanes);
    const __m256i live = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), lane_bit), lane_bit);
    c[g] = _mm256_and_si256(v, live);
    off += __builtin_popcount(m);
  }
  if (pred == kPredLorenzo) {
    // q_i = c_{s..i} summed (mod 2^32) from the row start s at or before i: an inclusive
    // prefix sum P over the block, less P_{s-1} for every start s after lane 0
    __m256i carry = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      __m256i x = c[g];
      x = _mm256_add_epi32(x, _mm256_slli_si256(x, 4));
      x = _mm256_add_epi32(x, _mm256_slli_si256(x, 8));
      const __m256i low_total = _mm256_permutevar8x32_epi32(x, _mm256_set1_epi32(3));
      x = _mm256_add_epi32(x, _mm256_blend_epi32(_mm256_setzero_si256(), low_total, 0xF0));
      x = _mm256_add_epi32(x, carry);
      carry = _mm256_permutevar8x32_epi32(x, _mm256_set1_epi32(7));
      c[g] = x;
    }
    uint32_t later = row_start_mask(row_pos, W) & ~1u;
    if (later) {
      alignas(32) int32_t P[kBlock];
      for (int g = 0; g < 4; ++g) _mm256_store_si256((__m256i*)(P + 8 * g), c[g]);
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      uint32_t before = 0;  // P_{s-1} of the start before (0 for lane 0)
      for (; later; later &= later - 1u) {
        const int s = __builtin_ctz(later);
        const uint32_t here = (uint32_t)P[s - 1];
        const __m256i delta = _mm256_set1_epi32((int)(here - before));
        before = here;
        for (int g = 0; g < 4; ++g) {
          const __m256i at_or_after = _mm256_cmpgt_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(8 * g + 1)),
                                                         _mm256_set1_epi32(s));
          c[g] = _mm256_sub_epi32(c[g], _mm256_and_si256(delta, at_or_after));
        }
      }
    }
  }
  const __m256 step = _mm256_set1_ps(two_eb);
  for (int g = 0; g < 4; ++g) _mm256_storeu_ps(y + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(c[g]), step));
  return true;
}

inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt") &&
                          __builtin_cpu_supports("bmi");
  return has;
}

}  // namespace avx2
}  // namespace szi
#endif
