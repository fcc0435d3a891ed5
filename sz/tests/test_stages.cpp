// test_stages.cpp - unit tests of the shared per-element / per-block stages (the same
// functions the CUDA kernels call), and of the decoder against re-checksummed lies.
#include <algorithm>
#include <vector>

#include "test_util.h"
#include "blockpack.h"
#include "blockpack_avx2.h"
#include "format.h"
#include "quantizer.h"

using namespace szi;
using namespace szt;

namespace {

TEST(Quantizer, BoundAndRoundingOverManyMagnitudes) {
  std::mt19937 g(1);
  for (double eb : {1e-7, 1e-3, 0.5, 3.0, 1e10}) {
    QuantParams p = make_quant_params(eb_to_float(eb));
    ASSERT_LE((double)p.eb, eb);
    int outliers = 0;
    for (int i = 0; i < 200000; ++i) {
      uint32_t bits = g();
      float x = u2f(bits);
      if (!std::isfinite(x)) continue;
      int32_t q;
      if (!quantize(x, p, &q)) { outliers++; continue; }
      double e = std::fabs((double)x - (double)recon(q, p.two_eb));
      ASSERT_LE(e, (double)p.eb) << "x=" << x << " eb=" << eb;
      ASSERT_LT(std::abs((long long)q), (1LL << 29) + 2);
    }
    EXPECT_GT(outliers, 0);  // random bit patterns include values far beyond 2^29 steps
  }
}

TEST(Quantizer, HalfwayValuesAndZeros) {
  QuantParams p = make_quant_params(0.5f);  // step 1
  int32_t q;
  for (float x : {0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 1e6f + 0.5f}) {
    ASSERT_TRUE(quantize(x, p, &q));
    EXPECT_LE(std::fabs(x - recon(q, p.two_eb)), 0.5f);
  }
  ASSERT_TRUE(quantize(-0.0f, p, &q));
  EXPECT_EQ(q, 0);
  EXPECT_EQ(f2u(recon(0, p.two_eb)), 0u);
  EXPECT_FALSE(quantize(NAN, p, &q));
  EXPECT_FALSE(quantize(INFINITY, p, &q));
  QuantParams zero = make_quant_params(0.0f);
  EXPECT_FALSE(quantize(0.0f, zero, &q));  // eb 0: lossless, everything verbatim
}

TEST(Quantizer, EbToFloatNeverExceeds) {
  for (double eb : {1e-3, 0.1, 1.0 / 3.0, 1e-40, 1e-46, 1e300, 7.0}) {
    float f = eb_to_float(eb);
    EXPECT_LE((double)f, eb);
    EXPECT_GE(f, 0.0f);
  }
  EXPECT_EQ(eb_to_float(-1.0), 0.0f);
  EXPECT_EQ(eb_to_float(NAN), 0.0f);
}

TEST(Predictor, LorenzoInverts) {
  std::mt19937 g(2);
  for (uint64_t W : {1ull, 5ull, 32ull, 100ull}) {
    for (int L : {1, 7, 32}) {
      int32_t q[32], c[32];
      for (int i = 0; i < L; ++i) q[i] = (int32_t)(g() % 2001) - 1000;
      uint64_t row_pos = g() % W;
      lorenzo_forward(q, L, row_pos, W, c);
      if (W > 1 && row_pos + 1 < W && L > 1) EXPECT_EQ(c[1], q[1] - q[0]);
      lorenzo_inverse(c, L, row_pos, W);
      for (int i = 0; i < L; ++i) ASSERT_EQ(c[i], q[i]);
    }
  }
}

TEST(BlockPack, RandomBlocksRoundTripAndSizeMatchesDescriptor) {
  std::mt19937 g(3);
  QuantParams p = make_quant_params(0.01f);
  int kinds[4] = {0, 0, 0, 0};
  for (int trial = 0; trial < 20000; ++trial) {
    int L = 1 + g() % 32;
    float x[32];
    int style = g() % 5;
    for (int i = 0; i < L; ++i) {
      float v = (float)((int)(g() % 20001) - 10000) * 0.0137f;
      if (style == 0) v = 0;
      if (style == 1 && g() % 4) v = 0;
      if (style == 2) v = std::fabs(v);
      if (style == 3) v = 5.0f + 0.001f * i;  // smooth: Lorenzo wins
      if (style == 2 && g() % 2) v = -v * 1000.0f;  // wide fields, signs
      x[i] = v;
    }
    if (style == 4 && g() % 3 == 0) x[g() % L] = NAN;
    uint16_t d;
    uint8_t buf[4 * 32];
    uint32_t size0 = encode_block(x, L, g() % 7, 7, p, &d, nullptr);
    uint16_t d2, d3;
    uint32_t size = encode_block<true>(x, L, 0, 1u << 20, p, &d2, buf);
    ASSERT_EQ(size, block_data_size(d2, L));
    // the GPU loop shape writes the same bytes
    uint8_t buf2[4 * 32];
    ASSERT_EQ(encode_block<false>(x, L, 0, 1u << 20, p, &d3, buf2), size);
    ASSERT_EQ(d2, d3);
    ASSERT_EQ(0, std::memcmp(buf, buf2, size));
    (void)size0;
    // decode with the row geometry used for writing, both loop shapes
    float y[32], y2[32];
    ASSERT_TRUE(decode_block<true>(buf, d2, L, 0, 1u << 20, p.two_eb, y));
    ASSERT_TRUE(decode_block<false>(buf, d2, L, 0, 1u << 20, p.two_eb, y2));
    ASSERT_EQ(0, std::memcmp(y, y2, 4 * L));
    for (int i = 0; i < L; ++i) {
      if (std::isnan(x[i])) { ASSERT_EQ(f2u(x[i]), f2u(y[i])); continue; }
      ASSERT_LE(std::fabs((double)x[i] - y[i]), (double)p.eb) << "trial " << trial;
      if (x[i] == 0.0f) ASSERT_EQ(y[i], 0.0f);
    }
    if (d2 == kDescZero) kinds[0]++;
    else if (d2 == kDescRaw) kinds[1]++;
    else kinds[2 + ((d2 >> 5) & 1)]++;
  }
  for (int k = 0; k < 4; ++k) EXPECT_GT(kinds[k], 0) << "block kind " << k << " never produced";
}

// The host packs and unpacks fields at compile-time widths (pack_fields/unpack_fields); the
// device keeps FieldWriter/FieldReader. Every width 1..31 and every count of nonzeros, with and
// without signs, must give the same bytes and the same codes both ways.
TEST(BlockPack, EveryFieldWidthAndCountMatchesTheGenericLoops) {
  std::mt19937 g(11);
  for (int k = 1; k <= 31; ++k) {
    for (int nnz = 1; nnz <= 32; ++nnz) {
      for (int trial = 0; trial < 4; ++trial) {
        const int L = trial == 3 ? nnz : 32;  // a short last block too
        // nnz nonzero codes of magnitude in [1, 2^k], the widest one reaching 2^k
        int32_t code[32] = {};
        std::vector<int> pos(L);
        for (int i = 0; i < L; ++i) pos[i] = i;
        std::shuffle(pos.begin(), pos.end(), g);
        // (width 31 only in forged streams: the quantizer's deltas stay below 2^30)
        const uint32_t top = k == 31 ? 0x7FFFFFFEu : (1u << k) - 1u;
        for (int t = 0; t < nnz; ++t) {
          const uint32_t m = t == 0 ? top : (uint32_t)(g() & top);
          const int32_t v = (int32_t)(m + 1u);
          code[pos[t]] = (trial & 1) && (g() & 1) ? -v : v;
        }
        CodeStats st = code_stats(code, L);
        const uint16_t desc = make_desc(st, kPredNone);
        const int kk = desc & 31;
        ASSERT_EQ(kk, k);
        uint8_t a[4 * 32 + 8], b[4 * 32 + 8];
        std::memset(a, 0xA5, sizeof(a));
        std::memset(b, 0x5A, sizeof(b));
        pack_codes<true>(code, L, desc, st.bitmap, a);
        pack_codes<false>(code, L, desc, st.bitmap, b);
        const uint32_t size = block_data_size(desc, L);
        ASSERT_NE(size, kBadSize);
        ASSERT_EQ(0, std::memcmp(a, b, size)) << "k " << kk << " nnz " << nnz;
        ASSERT_EQ(a[size], 0xA5) << "wrote past the block's " << size << " bytes";
        float y1[32], y2[32];
        ASSERT_TRUE(decode_block<true>(a, desc, L, 0, 1u << 20, 1.0f, y1));
        ASSERT_TRUE(decode_block<false>(a, desc, L, 0, 1u << 20, 1.0f, y2));
        for (int i = 0; i < L; ++i) {
          ASSERT_EQ(f2u(y1[i]), f2u(y2[i])) << "k " << kk << " nnz " << nnz << " i " << i;
          ASSERT_EQ(y1[i], (float)code[i]) << "k " << kk << " nnz " << nnz << " i " << i;
        }
#ifdef SZ_HAVE_AVX2_ENCODER
        if (L == 32 && avx2::cpu_has_avx2()) {
          // the AVX2 decoder, with and without the 1-D predictor over rows of several widths
          for (int pred = 0; pred < 2; ++pred) {
            const uint16_t dp = (uint16_t)(desc | (pred << 5));
            const uint64_t W = 1 + g() % 40, row_pos = g() % W;
            float y3[32];
            ASSERT_TRUE(decode_block<true>(a, dp, 32, row_pos, W, 1.0f, y1));
            ASSERT_TRUE(avx2::decode_block32(a, dp, row_pos, W, 1.0f, y3));
            for (int i = 0; i < 32; ++i)
              ASSERT_EQ(f2u(y3[i]), f2u(y1[i])) << "k " << kk << " nnz " << nnz << " W " << W << " i " << i;
          }
        }
#endif
      }
    }
  }
}

// The host encodes full blocks in AVX2 registers where the CPU has AVX2 (blockpack_avx2.h):
// it must choose the same descriptor and write the same bytes as encode_block, or hand the
// block back (a value the fast quantizer flags), for every kind of block: zeros, sparse and
// dense codes, wide fields and signs, row starts at every position, halfway values, outliers.
TEST(BlockPack, Avx2EncoderMatchesTheGenericEncoder) {
#ifndef SZ_HAVE_AVX2_ENCODER
  GTEST_SKIP() << "no AVX2 encoder on this platform";
#else
  if (!avx2::cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937 g(5);
  int handed_back = 0, kinds[4] = {0, 0, 0, 0}, widths = 0;
  for (int trial = 0; trial < 60000; ++trial) {
    const float eb = trial % 3 == 0 ? 0.5f : trial % 3 == 1 ? 0.01f : 3e-5f;
    const QuantParams p = make_quant_params(eb);
    float x[32];
    const int style = g() % 8;
    const float scale = std::ldexp(1.0f, (int)(g() % 24) - 4);
    float walk = 0;
    for (int i = 0; i < 32; ++i) {
      float v = (float)((int)(g() % 20001) - 10000) * 1e-4f * scale;
      walk += v * 0.05f;
      if (style == 0) v = 0;
      if (style == 1 && g() % 4) v = 0;                  // sparse
      if (style == 2) v = std::fabs(v);                   // no signs
      if (style == 3) v = walk;                           // smooth: Lorenzo wins
      if (style == 4) v = (float)((int)(g() % 9) - 4) * p.two_eb + p.eb * (g() % 2 ? 1 : -1);  // halfway
      if (style == 5 && g() % 8 == 0) v = g() % 2 ? NAN : INFINITY;  // outliers
      if (style == 6) v = std::ldexp(1.0f, (int)(g() % 40)) * p.two_eb * (g() % 2 ? 1 : -1);  // wide, some past 2^29 steps
      if (style == 7) v = g() % 2 ? 0.0f : -0.0f;
      x[i] = v;
    }
    const uint64_t W = 1 + g() % 70, row_pos = g() % W;
    uint16_t d_ref, d_avx;
    uint8_t ref[4 * 32 + 8], got[4 * 32 + 8];
    std::memset(ref, 0xA5, sizeof(ref));
    std::memset(got, 0xA5, sizeof(got));
    const uint32_t z_ref = encode_block<true>(x, 32, row_pos, W, p, &d_ref, ref);
    uint32_t z_avx = 0;
    if (!avx2::encode_block32(x, row_pos, W, p, &d_avx, got, &z_avx)) {
      ++handed_back;
      ASSERT_EQ(got[0], 0xA5) << "wrote a block it handed back";
      int32_t q[32];
      ASSERT_FALSE(quantize_block_fast(x, 32, p, q)) << "handed back a block the fast loop takes, trial " << trial;
      continue;
    }
    ASSERT_EQ(d_avx, d_ref) << "trial " << trial << " style " << style << " W " << W;
    ASSERT_EQ(z_avx, z_ref);
    ASSERT_EQ(0, std::memcmp(got, ref, sizeof(got))) << "trial " << trial << " style " << style;
    if (d_ref != kDescZero && d_ref != kDescRaw) {
      // and the AVX2 decoder gives decode_block's values, bit for bit
      float y_ref[32], y_avx[32];
      ASSERT_TRUE(decode_block<true>(ref, d_ref, 32, row_pos, W, p.two_eb, y_ref));
      ASSERT_TRUE(avx2::decode_block32(ref, d_ref, row_pos, W, p.two_eb, y_avx));
      for (int i = 0; i < 32; ++i)
        ASSERT_EQ(f2u(y_avx[i]), f2u(y_ref[i])) << "trial " << trial << " i " << i << " W " << W;
      // a bitmap that does not hold nnz bits is refused by both
      if (((d_ref >> 7) & 63) < 32) {
        uint8_t bad[sizeof(ref)];
        std::memcpy(bad, ref, sizeof(ref));
        bad[0] ^= (uint8_t)(1u << (g() % 8));
        ASSERT_FALSE(decode_block<true>(bad, d_ref, 32, row_pos, W, p.two_eb, y_ref));
        ASSERT_FALSE(avx2::decode_block32(bad, d_ref, row_pos, W, p.two_eb, y_avx));
      }
    }
    uint16_t d_plan;
    uint32_t z_plan = 0;
    ASSERT_TRUE(avx2::encode_block32(x, row_pos, W, p, &d_plan, nullptr, &z_plan));
    ASSERT_EQ(d_plan, d_ref);
    ASSERT_EQ(z_plan, z_ref);
    if (d_ref == kDescZero) kinds[0]++;
    else if (d_ref == kDescRaw) kinds[1]++;
    else kinds[2 + ((d_ref >> 5) & 1)]++;
    if (d_ref != kDescZero && d_ref != kDescRaw) widths |= 1 << (d_ref & 31);
  }
  EXPECT_GT(kinds[0], 0);
  EXPECT_EQ(kinds[1], 0) << "a raw block should have been handed back";
  EXPECT_GT(kinds[2], 0);
  EXPECT_GT(kinds[3], 0);
  EXPECT_GT(handed_back, 0);
  EXPECT_GT(__builtin_popcount(widths), 20) << "field widths covered: " << std::hex << widths;
#endif
}

TEST(BlockPack, InvalidDescriptorsRejected) {
  EXPECT_EQ(block_data_size(0x0001, 32), kBadSize);              // nnz 0 with k set
  EXPECT_EQ(block_data_size((uint16_t)(33 << 7), 32), kBadSize);  // nnz > 32
  EXPECT_EQ(block_data_size((uint16_t)(8 << 7), 7), kBadSize);    // nnz > L
  EXPECT_EQ(block_data_size((uint16_t)(1 << 13 | 1 << 7), 32), kBadSize);
  EXPECT_EQ(block_data_size((uint16_t)(32 << 7 | 5), 32), 20u);
  EXPECT_EQ(block_data_size((uint16_t)(3 << 7 | 1 << 6 | 4), 32), 4u + 1u + 2u);
  // bitmap popcount must match nnz
  uint8_t data[8] = {0x03, 0, 0, 0, 0, 0, 0, 0};
  float y[32];
  EXPECT_FALSE(decode_block(data, (uint16_t)(3 << 7 | 1), 32, 0, 32, 1.0f, y));
  EXPECT_TRUE(decode_block(data, (uint16_t)(2 << 7 | 1), 32, 0, 32, 1.0f, y));
  // bits beyond L in the bitmap
  uint8_t data2[8] = {0x80, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_FALSE(decode_block(data2, (uint16_t)(1 << 7), 5, 0, 32, 1.0f, y));
}

// Rewrites the checksums of a stream so that only structural validation can catch a lie.
void fix_checksums(std::vector<uint8_t>& s) {
  Header h;
  // parse without trusting the header checksum: recompute it first
  uint64_t sum = 0;
  for (uint64_t i = 0; i < 24; ++i) sum += checksum_term(i, load_u32le(s.data() + 4 * i));
  store_u64le(s.data() + 96, sum);
  uint64_t plen = load_u64le(s.data() + 72);
  if (plen <= s.size() - kHeaderSize) {
    store_u64le(s.data() + 88, checksum_serial(s.data() + kHeaderSize, plen));
    sum = 0;
    for (uint64_t i = 0; i < 24; ++i) sum += checksum_term(i, load_u32le(s.data() + 4 * i));
    store_u64le(s.data() + 96, sum);
  }
  (void)h;
}

TEST(Decoder, StructuralLiesWithValidChecksumsRejected) {
  std::vector<float> x = relu_sparse(640, 0.5, 3);
  x[10] = NAN;
  Stream s = compress(x, {640}, 1e-2, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(s.status, SZ_OK);
  std::vector<float> y(640);
  int rejected = 0, total = 0;
  // every descriptor byte, every value with a few flips
  for (size_t i = kHeaderSize; i < kHeaderSize + 2 * 20; ++i) {
    for (uint8_t m : {0x01, 0x02, 0x20, 0x40, 0x80, 0xFF}) {
      std::vector<uint8_t> c = s.bytes;
      c[i] ^= m;
      fix_checksums(c);
      int st = sz_decompress_host(c.data(), c.size(), y.data(), y.size());
      total++;
      if (st < 0) rejected++;
      else EXPECT_EQ(st, SZ_OK);
    }
  }
  // a descriptor change alters the total length, so nearly all must be caught structurally
  EXPECT_GT(rejected, total * 9 / 10) << rejected << " of " << total;
  // header fields: lengths and dims lies
  for (int off : {16, 24, 64, 72}) {
    std::vector<uint8_t> c = s.bytes;
    c[off] ^= 0x04;
    fix_checksums(c);
    EXPECT_LT(sz_decompress_host(c.data(), c.size(), y.data(), y.size()), 0) << "offset " << off;
  }
}

}  // namespace
