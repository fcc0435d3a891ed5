// blockpack.h - stage 3: per-block encoder (fixed-length bit packing, zero-block flag).
//
// Each block of up to 32 values gets a 16-bit descriptor and a variable number of data bytes.
// The stream keeps one flag bit per block (zero block or not) and the descriptors of flagged
// blocks in separate arrays, so every block's offset follows from them alone (prefix sums):
//   desc == 0x0000  all codes zero             -> 0 bytes
//   desc == 0xFFFF  raw block (outlier inside) -> 4*L bytes, the floats verbatim (LE)
//   otherwise       bits 0-4 k, bit 5 predictor, bit 6 signs present, bits 7-12 nnz (1..L),
//                   bits 13-15 zero. Data: [u32 nonzero bitmap if nnz < L]
//                   [nnz sign bits if signs] [nnz fields of k bits: |c|-1], each part
//                   LSB-first and padded to a byte.
// The encoder tries both predictors and keeps the smaller block (ties: no prediction).
// (A 5-bit position list instead of the bitmap for very sparse blocks was measured: it
// shrinks the raw payload but the zstd stage then loses more than was gained.)
#pragma once
#include "common.h"
#include "quantizer.h"
#include "predictor.h"

namespace szi {

constexpr uint32_t kBadSize = 0xFFFFFFFFu;

// Two loop shapes produce the same bytes: kCompact (CPU default) first gathers the nonzero
// codes into a dense array, which avoids branch mispredictions on sparse data; the other
// (GPU default) walks the block with a predicate and indexes arrays with loop counters only,
// so that an unrolled block stays in registers. test_stages checks that both agree.
#ifdef __CUDA_ARCH__
constexpr bool kCompactDefault = false;
#else
constexpr bool kCompactDefault = true;
#endif

// Data bytes of a block with descriptor desc and L elements; kBadSize when invalid.
SZ_HD uint32_t block_data_size(uint16_t desc, int L) {
  if (desc == kDescZero) return 0;
  if (desc == kDescRaw) return 4u * (uint32_t)L;
  uint32_t k = desc & 31u, signs = (desc >> 6) & 1u, nnz = (desc >> 7) & 63u;
  if ((desc >> 13) != 0 || nnz == 0 || nnz > (uint32_t)L) return kBadSize;
  return (nnz < (uint32_t)L ? 4u : 0u) + (signs ? (nnz + 7) / 8 : 0u) + (nnz * k + 7) / 8;
}

SZ_HD uint32_t magnitude(int32_t v) { return v < 0 ? (uint32_t)0 - (uint32_t)v : (uint32_t)v; }

// Mask of the nonzero codes.
SZ_HD uint32_t nonzero_bitmap(const int32_t* code, int L) {
  uint32_t m = 0;
  for (int i = 0; i < L; ++i) m |= (uint32_t)(code[i] != 0) << i;
  return m;
}

struct CodeStats {
  uint32_t bitmap;  // nonzero codes
  int nnz;
  uint32_t maxm;    // OR of |c| - 1 over nonzeros (same bit width as the max)
  bool neg;
};

SZ_HD CodeStats code_stats(const int32_t* c, int L) {
  // Branch-free and vectorizable: the OR of the (|c|-1) values has the same bit width as
  // their maximum, which is all the encoder needs.
  uint32_t orm = 0, neg = 0;
  int nnz = 0;
  for (int i = 0; i < L; ++i) {
    int32_t v = c[i];
    uint32_t nz = v != 0;
    orm |= magnitude(v) - nz;  // |c| - 1 for nonzeros, 0 for zeros
    nnz += (int)nz;
    neg |= (uint32_t)v >> 31;
  }
  uint32_t bitmap = 0;
  if (nnz != 0 && nnz != L)
    bitmap = nonzero_bitmap(c, L);
  else if (nnz == L)
    bitmap = L == 32 ? 0xFFFFFFFFu : ((1u << L) - 1u);
  return CodeStats{bitmap, nnz, orm, neg != 0};
}

SZ_HD uint16_t make_desc(const CodeStats& s, int pred) {
  if (s.nnz == 0) return kDescZero;
  return (uint16_t)(bit_width32(s.maxm) | (pred << 5) | ((s.neg ? 1 : 0) << 6) | (s.nnz << 7));
}

// Appends k-bit fields LSB first: 32-bit words while they fill, the rest at flush().
struct FieldWriter {
  uint8_t* o;
  uint64_t acc = 0;
  int nb = 0;
  SZ_HD void put(uint32_t v, int k) {
    acc |= (uint64_t)v << nb;  // nb < 32 and k <= 31: no overflow
    nb += k;
    if (nb >= 32) { store_u32le(o, (uint32_t)acc); o += 4; acc >>= 32; nb -= 32; }
  }
  SZ_HD void flush() { for (; nb > 0; nb -= 8) { *o++ = (uint8_t)acc; acc >>= 8; } }
};

// Host fast path for the k-bit fields (kCompact): a block's fields, at most 32 x 31 bits = 124
// bytes, are packed into and unpacked from a zero-padded 128-byte copy with the width k as a
// compile-time constant, so each field is one 8-byte load or two shifts and no loop carries a
// bit position. Eight fields of K bits are K whole bytes, so the fields go in groups of eight
// (group g is bytes [gK, gK + K)), and the groups from the block's count on are skipped (a
// ReLU block holds half as many nonzeros). Same bytes as FieldWriter/FieldReader (bit t*k, LSB
// first); test_stages checks every width and count against them.
constexpr int kFieldBuf = 128;

// m[0..count) -> buf: field t at bit t*K; bytes from (count*K+7)/8 on are not to be used.
// Fields from count to the end of its group of eight must be 0.
template <int K>
SZ_HD void pack_fields_k(const uint32_t* m, int count, uint8_t* buf) {
  constexpr int kWords = (8 * K + 63) / 64;
  for (int g = 0; g < kBlock / 8 && 8 * g < count; ++g) {
    uint64_t w[kWords] = {};
    const uint32_t* mg = m + 8 * g;
SZ_HOST_UNROLL8
    for (int i = 0; i < 8; ++i) {
      const int bit = i * K, word = bit >> 6, off = bit & 63;
      w[word] |= (uint64_t)mg[i] << off;
      if (off + K > 64) w[word + 1] |= (uint64_t)mg[i] >> (64 - off);
    }
    // the words' bytes past the group are zeros, which the next group overwrites
    for (int i = 0; i < kWords; ++i) store_u64le(buf + g * K + 8 * i, w[i]);
  }
}

// buf[0..kFieldBuf) -> m[0..32); fields from count to the end of its group come out as whatever
// buf holds there, the later groups as 0.
template <int K>
SZ_HD void unpack_fields_k(const uint8_t* buf, int count, uint32_t* m) {
  constexpr uint32_t mask = (1u << K) - 1u;
  for (int g = 0; g < kBlock / 8; ++g) {
    uint32_t* mg = m + 8 * g;
    if (8 * g >= count) {
      for (int i = 0; i < 8; ++i) mg[i] = 0;
      continue;
    }
    const uint8_t* bg = buf + g * K;
SZ_HOST_UNROLL8
    for (int i = 0; i < 8; ++i) {
      const int bit = i * K;
      mg[i] = (uint32_t)(load_u64le(bg + (bit >> 3)) >> (bit & 7)) & mask;
    }
  }
}

// Runtime k in 1..31 to the compile-time width (k changes little from block to block, so the
// comparisons predict well).
template <int K = 1>
SZ_HD void pack_fields(int k, int count, const uint32_t* m, uint8_t* buf) {
  if (k == K) pack_fields_k<K>(m, count, buf);
  else if constexpr (K < 31) pack_fields<K + 1>(k, count, m, buf);
}

template <int K = 1>
SZ_HD void unpack_fields(int k, int count, const uint8_t* buf, uint32_t* m) {
  if (k == K) unpack_fields_k<K>(buf, count, m);
  else if constexpr (K < 31) unpack_fields<K + 1>(k, count, buf, m);
}

// Writes the data bytes of a coded block (descriptor neither zero nor raw) from its codes and
// their nonzero mask: [bitmap][signs][fields].
template <bool kCompact = kCompactDefault>
SZ_HD void pack_codes(const int32_t* code, int L, uint16_t desc, uint32_t bitmap, uint8_t* out) {
  const int k = desc & 31, nnz = (desc >> 7) & 63;
  const bool neg = (desc >> 6) & 1;
  uint8_t* o = out;
  if (nnz < L) { store_u32le(o, bitmap); o += 4; }
  uint32_t sign = 0;
  if constexpr (kCompact) {
    // gather the nonzero codes: one step per set bit of the bitmap, then zeros to the end
    uint32_t mags[kBlock];
    int j = 0;
    for (uint32_t rest = bitmap; rest != 0; rest &= rest - 1u, ++j) {
      const int32_t v = code[ctz32(rest)];
      mags[j] = magnitude(v) - 1u;
      sign |= (uint32_t)(v < 0) << j;
    }
    for (; j < kBlock; ++j) mags[j] = 0;
    if (neg)
      for (int b = 0; b < (nnz + 7) / 8; ++b) *o++ = (uint8_t)(sign >> (8 * b));
    if (k) {
      uint8_t buf[kFieldBuf];
      pack_fields(k, nnz, mags, buf);
      memcpy(o, buf, (size_t)(nnz * k + 7) / 8);
    }
  } else {
    int j = 0;
    for (int i = 0; i < L; ++i) {
      sign |= (uint32_t)(code[i] < 0) << j;
      j += code[i] != 0;
    }
    if (neg)
      for (int b = 0; b < (nnz + 7) / 8; ++b) *o++ = (uint8_t)(sign >> (8 * b));
    FieldWriter fw{o};
    if (k)
      for (int i = 0; i < L; ++i)
        if (code[i] != 0) fw.put(magnitude(code[i]) - 1u, k);
    fw.flush();
  }
}

SZ_HD void store_raw(const float* x, int L, uint8_t* out) {
  for (int i = 0; i < L; ++i) store_u32le(out + 4 * i, f2u(x[i]));
}

// Encodes one block. Writes the descriptor to *desc and, when out != nullptr, the data
// bytes to out. Returns the number of data bytes.
template <bool kCompact = kCompactDefault>
SZ_HD uint32_t encode_block(const float* x, int L, uint64_t row_pos, uint64_t W,
                            const QuantParams& p, uint16_t* desc, uint8_t* out) {
  int32_t q[kBlock], c[kBlock];
  if (!quantize_block(x, L, p, q)) {
    *desc = kDescRaw;
    if (out) store_raw(x, L, out);
    return 4u * (uint32_t)L;
  }
  CodeStats s0 = code_stats(q, L);
  if (s0.nnz == 0) { *desc = kDescZero; return 0; }
  lorenzo_forward(q, L, row_pos, W, c);
  CodeStats s1 = code_stats(c, L);
  uint16_t d0 = make_desc(s0, kPredNone), d1 = make_desc(s1, kPredLorenzo);
  uint32_t z0 = block_data_size(d0, L), z1 = block_data_size(d1, L);
  bool use1 = z1 < z0;
  *desc = use1 ? d1 : d0;
  uint32_t size = use1 ? z1 : z0;
  if (!out) return size;
  pack_codes<kCompact>(use1 ? c : q, L, *desc, use1 ? s1.bitmap : s0.bitmap, out);
  return size;
}

// Writes the data bytes of a block whose descriptor encode_block already chose for the same
// values and geometry (the second step of the device encoder); returns their number.
template <bool kCompact = kCompactDefault>
SZ_HD uint32_t pack_block(const float* x, int L, uint64_t row_pos, uint64_t W,
                          const QuantParams& p, uint16_t desc, uint8_t* out) {
  if (desc == kDescZero) return 0;
  if (desc == kDescRaw) { store_raw(x, L, out); return 4u * (uint32_t)L; }
  int32_t q[kBlock], code[kBlock];
  quantize_block(x, L, p, q);  // true: encode_block found no outlier in these values
  if (((desc >> 5) & 1) == kPredLorenzo) lorenzo_forward(q, L, row_pos, W, code);
  else for (int i = 0; i < L; ++i) code[i] = q[i];
  pack_codes<kCompact>(code, L, desc, nonzero_bitmap(code, L), out);
  return block_data_size(desc, L);
}

// Reads k-bit fields LSB first from [d, end): 32-bit words while 4 bytes remain, then bytes.
struct FieldReader {
  const uint8_t* d;
  const uint8_t* end;
  int k;
  uint64_t acc = 0;
  int nb = 0;
  SZ_HD uint32_t get() {
    if (k == 0) return 0;
    if (nb < k) {
      if (end - d >= 4) { acc |= (uint64_t)load_u32le(d) << nb; d += 4; nb += 32; }
      else while (nb < k) { acc |= (uint64_t)(*d++) << nb; nb += 8; }
    }
    const uint32_t m = (uint32_t)acc & (0xFFFFFFFFu >> (32 - k));
    acc >>= k;
    nb -= k;
    return m;
  }
  // nonzero code t: magnitude field + 1, negated when sign bit t is set
  SZ_HD int32_t signed_code(uint32_t sign, int t) {
    const uint32_t mag = get() + 1u;
    return (int32_t)((sign >> t) & 1u ? (uint32_t)0 - mag : mag);
  }
};

// Decodes one block whose data (block_data_size(desc, L) bytes, already bounds-checked by
// the caller) starts at d. Returns false when the data contradicts the descriptor.
template <bool kCompact = kCompactDefault>
SZ_HD bool decode_block(const uint8_t* d, uint16_t desc, int L, uint64_t row_pos, uint64_t W,
                        float two_eb, float* y) {
  if (desc == kDescZero) {
    for (int i = 0; i < L; ++i) y[i] = 0.0f;
    return true;
  }
  if (desc == kDescRaw) {
    for (int i = 0; i < L; ++i) y[i] = u2f(load_u32le(d + 4 * i));
    return true;
  }
  int k = desc & 31, pred = (desc >> 5) & 1, signs = (desc >> 6) & 1, nnz = (desc >> 7) & 63;
  const uint8_t* const end = d + block_data_size(desc, L);  // the reader stays below end
  uint32_t full = L == 32 ? 0xFFFFFFFFu : ((1u << L) - 1u);
  uint32_t bitmap = full;
  if (nnz < L) { bitmap = load_u32le(d); d += 4; }
  // read the nnz sign bits and k-bit fields into compact arrays, then scatter (branch-free)
  uint32_t sign = 0;
  if (signs) {
    for (int b = 0; b < (nnz + 7) / 8; ++b) sign |= (uint32_t)d[b] << (8 * b);
    d += (nnz + 7) / 8;
  }
  if ((bitmap & ~full) != 0 || popc32(bitmap) != nnz) return false;
  int32_t c[kBlock];
  if constexpr (kCompact) {
    // unpack the fields, sign them into a dense array, then scatter (branch-free)
    uint32_t mags[kBlock];
    if (k) {
      uint8_t buf[kFieldBuf] = {};
      memcpy(buf, d, (size_t)(end - d));  // (nnz * k + 7) / 8 <= 124 bytes
      unpack_fields(k, nnz, buf, mags);
    } else {
      for (int t = 0; t < kBlock; ++t) mags[t] = 0;
    }
    int32_t vals[kBlock + 1];
    for (int t = 0; t < kBlock; ++t) {
      const uint32_t neg_t = (sign >> t) & 1u, mag = mags[t] + 1u;
      vals[t] = (int32_t)((mag ^ ((uint32_t)0 - neg_t)) + neg_t);
    }
    vals[nnz] = 0;
    int t = 0;
    for (int i = 0; i < L; ++i) {
      uint32_t bit = (bitmap >> i) & 1u;
      c[i] = (int32_t)((uint32_t)vals[t] & ((uint32_t)0 - bit));
      t += (int)bit;
    }
  } else {
    FieldReader fr{d, end, k};
    int t = 0;
    SZ_UNROLL
    for (int i = 0; i < L; ++i) {
      int32_t v = 0;
      if ((bitmap >> i) & 1u) v = fr.signed_code(sign, t++);
      c[i] = v;
    }
  }
  if (pred == kPredLorenzo) lorenzo_inverse(c, L, row_pos, W);
  for (int i = 0; i < L; ++i) y[i] = recon(c[i], two_eb);
  return true;
}

}  // namespace szi
