// test_corrupt.cpp - corrupt, truncated, forged, padded, empty and foreign input is rejected
// with an error (and a prefix read is only what the caller asks for).
#include "test_util.h"
#include "forge.h"
#include "sz/sz.hpp"
#include <cfloat>
#include <memory>
#include <set>
#include <string>

using namespace szt;

namespace {

int decode(const std::vector<uint8_t>& s, size_t n) {
  std::vector<float> y(n + 1);
  return sz_decompress_host(s.data(), s.size(), y.data(), y.size());
}

class Corrupt : public ::testing::TestWithParam<int> {};

TEST_P(Corrupt, EverySingleByteFlipIsRejected) {
  int lossless = GetParam();
  std::vector<float> x = relu_sparse(700, 0.6, 17);
  x[100] = NAN;
  Stream s = compress(x, {7, 100}, 1e-2, SZ_EB_ABS, lossless);
  ASSERT_EQ(s.status, SZ_OK);
  ASSERT_EQ(decode(s.bytes, x.size()), SZ_OK);
  std::set<int> seen;
  for (size_t i = 0; i < s.bytes.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xFF}) {
      std::vector<uint8_t> c = s.bytes;
      c[i] ^= mask;
      int st = decode(c, x.size());
      EXPECT_LT(st, 0) << "flip 0x" << std::hex << (int)mask << " at byte " << std::dec << i;
      seen.insert(st);
    }
  }
  EXPECT_TRUE(seen.count(SZ_ERR_CORRUPT));
  EXPECT_TRUE(seen.count(SZ_ERR_FORMAT));  // magic bytes
}

TEST_P(Corrupt, EveryTruncationIsRejected) {
  std::vector<float> x = smooth(500);
  Stream s = compress(x, {500}, 1e-3, SZ_EB_ABS, GetParam());
  ASSERT_EQ(s.status, SZ_OK);
  for (size_t len = 0; len < s.bytes.size(); ++len) {
    // the prefix lives in its own exact-size heap block so that ASan/valgrind catch overreads
    std::unique_ptr<uint8_t[]> t(new uint8_t[len + 1]);
    std::memcpy(t.get(), s.bytes.data(), len);
    std::vector<float> y(x.size());
    int st = sz_decompress_host(t.get(), len, y.data(), y.size());
    const int want = len == 0 ? SZ_ERR_EMPTY : SZ_ERR_TRUNCATED;
    EXPECT_EQ(st, want) << "length " << len << " gave " << st;
  }
  sz_header_info info;
  EXPECT_EQ(sz_read_header(s.bytes.data(), 50, &info), SZ_ERR_TRUNCATED);
  // the header alone: sz_read_header says truncated, sz_peek_header reads it
  EXPECT_EQ(sz_read_header(s.bytes.data(), SZ_HEADER_SIZE, &info), SZ_ERR_TRUNCATED);
  ASSERT_EQ(sz_peek_header(s.bytes.data(), SZ_HEADER_SIZE, &info), SZ_OK);
  EXPECT_EQ(info.stream_size, s.bytes.size());
  EXPECT_EQ(info.n_elems, x.size());
  EXPECT_EQ(sz_peek_header(s.bytes.data(), SZ_HEADER_SIZE - 1, &info), SZ_ERR_TRUNCATED);
  std::vector<uint8_t> bad(s.bytes.begin(), s.bytes.begin() + SZ_HEADER_SIZE);
  bad[20] ^= 1;  // a dim: header checksum
  EXPECT_EQ(sz_peek_header(bad.data(), bad.size(), &info), SZ_ERR_CORRUPT);
}

std::string g(double v) {
  char b[32];
  snprintf(b, sizeof b, "%.9g", v);
  return b;
}

// A header forged with recomputed checksums whose absolute bound does not follow from its
// mode and requested bound is corrupt, whatever reads it.
void expect_forged(const std::vector<uint8_t>& c, size_t n, const std::string& what) {
  std::vector<float> y(n);
  sz_header_info info;
  EXPECT_EQ(sz_decompress_host(c.data(), c.size(), y.data(), y.size()), SZ_ERR_CORRUPT) << what;
  EXPECT_EQ(sz_read_header(c.data(), c.size(), &info), SZ_ERR_CORRUPT) << what;
  EXPECT_EQ(sz_peek_header(c.data(), SZ_HEADER_SIZE, &info), SZ_ERR_CORRUPT) << what;
}

TEST_P(Corrupt, ForgedAbsoluteBoundRejected) {
  std::vector<float> x = relu_sparse(700, 0.6, 17);
  Stream s = compress(x, {7, 100}, 1e-2, SZ_EB_ABS, GetParam());
  ASSERT_EQ(s.status, SZ_OK);
  sz_header_info info;
  ASSERT_EQ(sz_read_header(s.bytes.data(), s.bytes.size(), &info), SZ_OK);
  const float eb = (float)info.eb_abs;
  ASSERT_EQ(decode(with_eb_abs(s.bytes, eb), x.size()), SZ_OK);  // resealing alone is harmless
  for (float f : {0.0f, 1.0f, 2.0f * eb, nextafterf(eb, INFINITY), nextafterf(eb, 0.0f), -eb,
                  1e-45f, FLT_MAX, (float)NAN, (float)INFINITY})
    expect_forged(with_eb_abs(s.bytes, f), x.size(), "abs, eb_abs " + g(f));
  // the requested bound changed under the stored one
  for (double r : {1.0, 2e-2, 0.999e-2})
    expect_forged(with_eb_req(s.bytes, r), x.size(), "abs, eb_req " + g(r));
  // both changed consistently to "no usable step": a stream of zero blocks and coded blocks
  // cannot be one that the encoder wrote with that bound (it stores every block verbatim)
  expect_forged(with_eb_abs(with_eb_req(s.bytes, 1e-300), 0.0f), x.size(), "abs, eb 1e-300 / 0");
}

TEST_P(Corrupt, ForgedRelativeBoundRejected) {
  std::vector<float> x = relu_sparse(700, 0.6, 18);
  Stream s = compress(x, {700}, 1e-6, SZ_EB_REL, GetParam());
  ASSERT_EQ(s.status, SZ_OK);
  ASSERT_EQ(decode(s.bytes, x.size()), SZ_OK);
  // 0 and denormal steps: only all-verbatim streams; above rel * 2^129: no float range gives it
  for (float f : {0.0f, 1e-44f, 1e34f, FLT_MAX, -1.0f, (float)NAN})
    expect_forged(with_eb_abs(s.bytes, f), x.size(), "rel, eb_abs " + g(f));
  // a large rel: the smallest range (2^-149) bounds eb_abs from below (1e12 * 2^-149 is
  // about 1.4e-33; 1e-35 is a usable step, so only this bound catches it)
  Stream r = compress(x, {700}, 1e12, SZ_EB_REL, GetParam());
  ASSERT_EQ(r.status, SZ_OK);
  ASSERT_EQ(decode(r.bytes, x.size()), SZ_OK);
  expect_forged(with_eb_abs(r.bytes, 1e-35f), x.size(), "rel 1e12, eb_abs 1e-35");
}

INSTANTIATE_TEST_SUITE_P(Streams, Corrupt, ::testing::Values(SZ_LOSSLESS_NONE, SZ_LOSSLESS_ZSTD));

TEST(Forged, CodedBlockInAllVerbatimStreamRejected) {
  // eb 1e-300 rounds to an absolute bound of 0: every block is stored verbatim
  std::vector<float> x = random_uniform(64, 5);
  Stream s = compress(x, {64}, 1e-300, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(s.status, SZ_OK);
  sz_header_info info;
  ASSERT_EQ(sz_read_header(s.bytes.data(), s.bytes.size(), &info), SZ_OK);
  ASSERT_EQ(info.eb_abs, 0.0);
  std::vector<float> y(64);
  ASSERT_EQ(sz_decompress_host(s.bytes.data(), s.bytes.size(), y.data(), y.size()), SZ_OK);
  EXPECT_EQ(std::memcmp(x.data(), y.data(), 4 * x.size()), 0);
  // block 0's descriptor rewritten as a coded block of the same size (k 31, signs, 32 nonzero:
  // 4 + 124 bytes), which would decode to multiples of a zero step
  std::vector<uint8_t> c = s.bytes;
  const size_t desc0 = SZ_HEADER_SIZE + 1;  // after one byte of block flags
  ASSERT_EQ(szi::load_u16le(c.data() + desc0), szi::kDescRaw);
  szi::store_u16le(c.data() + desc0, (uint16_t)(31 | 1 << 6 | 32 << 7));
  reseal(c);
  ASSERT_EQ(sz_read_header(c.data(), c.size(), &info), SZ_OK);  // the header itself is fine
  EXPECT_EQ(sz_decompress_host(c.data(), c.size(), y.data(), y.size()), SZ_ERR_CORRUPT);
}

TEST(Trailing, BytesAfterTheStreamRejected) {
  std::vector<float> x = relu_sparse(1000, 0.5, 21);
  for (int lossless : {SZ_LOSSLESS_NONE, SZ_LOSSLESS_ZSTD}) {
    Stream s = compress(x, {10, 100}, 1e-3, SZ_EB_ABS, lossless);
    ASSERT_EQ(s.status, SZ_OK);
    std::vector<float> y(x.size()), z(x.size());
    ASSERT_EQ(sz_decompress_host(s.bytes.data(), s.bytes.size(), y.data(), y.size()), SZ_OK);
    for (size_t extra : {1, 3, 4096}) {
      std::vector<uint8_t> t = s.bytes;
      t.resize(t.size() + extra, 0);
      sz_header_info info;
      EXPECT_EQ(sz_decompress_host(t.data(), t.size(), z.data(), z.size()), SZ_ERR_TRAILING);
      EXPECT_EQ(sz_decompress_host_ex(t.data(), t.size(), z.data(), z.size(), 1), SZ_ERR_TRAILING);
      EXPECT_EQ(sz_read_header(t.data(), t.size(), &info), SZ_ERR_TRAILING);
      ASSERT_EQ(sz_peek_header(t.data(), t.size(), &info), SZ_OK);  // header at a buffer's start
      EXPECT_EQ(info.stream_size, s.bytes.size());
      try {
        sz::decompress(t);
        ADD_FAILURE() << "sz::decompress accepted trailing bytes";
      } catch (const sz::Error& e) {
        EXPECT_EQ(e.status(), SZ_ERR_TRAILING);
      }
      // asked for: a prefix read reports the bytes it used
      size_t used = 0;
      std::fill(z.begin(), z.end(), -1.0f);
      EXPECT_EQ(sz_decompress_host_prefix(t.data(), t.size(), z.data(), z.size(), 0, &used), SZ_OK);
      EXPECT_EQ(used, s.bytes.size());
      EXPECT_EQ(std::memcmp(y.data(), z.data(), 4 * y.size()), 0);
      EXPECT_EQ(sz::decompress_prefix(t.data(), t.size(), z.data(), z.size()), s.bytes.size());
    }
  }
  EXPECT_NE(std::string(sz_strerror(SZ_ERR_TRAILING)).find("trailing"), std::string::npos);
}

TEST(Trailing, PrefixReadsWalkAConcatenation) {
  std::vector<float> a = relu_sparse(500, 0.7, 1), b = smooth(333);
  Stream sa = compress(a, {500}, 1e-2, SZ_EB_ABS, SZ_LOSSLESS_ZSTD);
  Stream sb = compress(b, {3, 111}, 1e-3, SZ_EB_REL, SZ_LOSSLESS_NONE);
  ASSERT_EQ(sa.status, SZ_OK);
  ASSERT_EQ(sb.status, SZ_OK);
  std::vector<uint8_t> cat = sa.bytes;
  cat.insert(cat.end(), sb.bytes.begin(), sb.bytes.end());
  std::vector<float> ya(a.size()), yb(b.size());
  size_t used = 0;
  ASSERT_EQ(sz_decompress_host_prefix(cat.data(), cat.size(), ya.data(), ya.size(), 0, &used), SZ_OK);
  ASSERT_EQ(used, sa.bytes.size());
  size_t used2 = 0;
  ASSERT_EQ(sz_decompress_host_prefix(cat.data() + used, cat.size() - used, yb.data(), yb.size(), 0,
                                      &used2), SZ_OK);
  EXPECT_EQ(used + used2, cat.size());
  sz_header_info ib;
  ASSERT_EQ(sz_read_header(sb.bytes.data(), sb.bytes.size(), &ib), SZ_OK);
  check_bound(a, ya, 1e-2);
  check_bound(b, yb, ib.eb_abs);
  // a prefix read is still checked: truncation, corruption, arguments
  used = 7;
  EXPECT_EQ(sz_decompress_host_prefix(cat.data(), sa.bytes.size() - 1, ya.data(), ya.size(), 0, &used),
            SZ_ERR_TRUNCATED);
  EXPECT_EQ(used, 0u);
  std::vector<uint8_t> bad = cat;
  bad[SZ_HEADER_SIZE + 3] ^= 0x10;
  EXPECT_EQ(sz_decompress_host_prefix(bad.data(), bad.size(), ya.data(), ya.size(), 0, &used),
            SZ_ERR_CORRUPT);
  EXPECT_EQ(sz_decompress_host_prefix(cat.data(), cat.size(), ya.data(), ya.size(), 0, nullptr),
            SZ_ERR_PARAM);
  EXPECT_EQ(sz_decompress_host_prefix(cat.data(), 0, ya.data(), ya.size(), 0, &used), SZ_ERR_EMPTY);
}

TEST(Empty, EmptyInputNamedAsEmpty) {
  uint8_t byte = 0;
  float y[4];
  sz_header_info info;
  EXPECT_EQ(sz_decompress_host(&byte, 0, y, 4), SZ_ERR_EMPTY);
  EXPECT_EQ(sz_decompress_host(nullptr, 0, y, 4), SZ_ERR_EMPTY);  // e.g. data() of an empty vector
  EXPECT_EQ(sz_decompress_host_ex(nullptr, 0, y, 4, 1), SZ_ERR_EMPTY);
  EXPECT_EQ(sz_read_header(nullptr, 0, &info), SZ_ERR_EMPTY);
  EXPECT_EQ(sz_peek_header(&byte, 0, &info), SZ_ERR_EMPTY);
  EXPECT_NE(std::string(sz_strerror(SZ_ERR_EMPTY)).find("empty"), std::string::npos);
  EXPECT_STRNE(sz_strerror(SZ_ERR_EMPTY), sz_strerror(SZ_ERR_PARAM));
  // a stream of an empty tensor is not an empty input
  Stream s = compress({}, {0}, 1e-3, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(s.status, SZ_OK);
  EXPECT_EQ(sz_decompress_host(s.bytes.data(), s.bytes.size(), nullptr, 0), SZ_OK);
}

TEST(Foreign, RandomAndTextInputRejected) {
  std::mt19937 g(99);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint8_t> b(g() % 400);
    for (auto& v : b) v = (uint8_t)g();
    EXPECT_LT(decode(b, 1000), 0);
  }
  std::string text = "hello, this is not a compressed stream at all, not even close.........."
                     "......................................................................";
  std::vector<uint8_t> t(text.begin(), text.end());
  EXPECT_EQ(decode(t, 10), SZ_ERR_FORMAT);
  EXPECT_EQ(sz_decompress_host(nullptr, 10, nullptr, 0), SZ_ERR_PARAM);
}

}  // namespace

// A device call that fails says why (sz_cuda_error); without the CUDA backend, that it is absent.
TEST(CudaError, FailuresSayWhy) {
  std::vector<float> x(64, 1.f);
  std::vector<uint8_t> out(4096);
  size_t used = 0;
  const size_t dims[1] = {x.size()};
  if (sz_has_cuda()) {
    // no device here (or a NULL device pointer): an error with the CUDA runtime's words
    const int rc = sz_compress_device(nullptr, dims, 1, 1e-3, SZ_EB_ABS, out.data(), out.size(),
                                      &used, nullptr, 0, nullptr);
    EXPECT_NE(rc, SZ_OK);
    if (rc == SZ_ERR_CUDA) EXPECT_STRNE(sz_cuda_error(), "");
  } else {
    EXPECT_EQ(sz_compress_device(x.data(), dims, 1, 1e-3, SZ_EB_ABS, out.data(), out.size(), &used,
                                 nullptr, 0, nullptr),
              SZ_ERR_CUDA);
    EXPECT_STREQ(sz_cuda_error(), "library built without CUDA");
  }
}

// Dims whose product overflows 64 bits are refused, not wrapped: 2^32 x 2^32 is not 0 values,
// and 2^30 x 2^34 is not 0 values either (the product modulo 2^64 is 0 for both).
TEST(Dims, ProductOverflowRefused) {
  std::vector<float> x(4, 1.0f);
  std::vector<uint8_t> out(sz_compress_bound(4));
  size_t used = 0;
  const size_t wrap[2] = {(size_t)1 << 30, (size_t)1 << 34}, big[3] = {1 << 20, 1 << 20, 2};
  EXPECT_EQ(sz_compress_host(x.data(), wrap, 2, 1e-3, SZ_EB_ABS, out.data(), out.size(), &used),
            SZ_ERR_PARAM);
  EXPECT_EQ(sz_compress_host(x.data(), big, 3, 1e-3, SZ_EB_ABS, out.data(), out.size(), &used),
            SZ_ERR_PARAM);
  // an empty stream whose header claims 2^32 x 2^32 values
  Stream s = compress({}, {0}, 1e-3, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(s.status, SZ_OK);
  std::vector<uint8_t> c = s.bytes;
  c[9] = 2;  // ndims
  szi::store_u64le(c.data() + 16, (uint64_t)1 << 32);
  szi::store_u64le(c.data() + 24, (uint64_t)1 << 32);
  reseal(c);
  sz_header_info info;
  EXPECT_EQ(sz_read_header(c.data(), c.size(), &info), SZ_ERR_CORRUPT);
  EXPECT_EQ(sz_decompress_host(c.data(), c.size(), nullptr, 0), SZ_ERR_CORRUPT);
}
