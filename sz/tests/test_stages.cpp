// test_stages.cpp - unit tests of the shared per-element / per-block stages (the same
// functions the CUDA kernels call), and of the decoder against re-checksummed lies.
#include <algorithm>
#include <vector>

#include "test_util.h"
#include "blockpack.h"
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
      }
    }
  }
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
