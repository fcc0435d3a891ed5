// test_device_twin.cpp - the CUDA backend's thread steps (device_steps.h), run as CPU loops by
// device_twin.h, against the host backend: the same stream bytes (lossless none), the same
// decoded values, and the same verdict on forged and corrupt streams. This is where the device
// logic is tested without a GPU; test_gpu checks the real kernels where there is one.
#include "test_util.h"
#include "forge.h"
#include "device_twin.h"
#include <tuple>

using namespace szt;

namespace {

class Twin : public ::testing::TestWithParam<std::tuple<ShapeCase, int>> {};

TEST_P(Twin, SameStreamAsHostAndSameValues) {
  const ShapeCase& c = std::get<0>(GetParam());
  const int mode = std::get<1>(GetParam());
  const std::vector<float> x = make_case(c);
  for (double eb : {1e-1, 1e-3, 1e-6, 1e-300}) {
    Stream host = compress(x, c.dims, eb, mode, SZ_LOSSLESS_NONE);
    ASSERT_EQ(host.status, SZ_OK);
    std::vector<uint8_t> twin;
    ASSERT_EQ(szi::twin_compress(x.data(), c.dims.data(), (int)c.dims.size(), eb, mode, &twin), SZ_OK);
    ASSERT_EQ(twin.size(), host.bytes.size()) << "eb " << eb;
    EXPECT_TRUE(twin == host.bytes) << "device-shape and host streams differ, eb " << eb;
    std::vector<float> y_host(x.size()), y_twin(x.size());
    ASSERT_EQ(sz_decompress_host(twin.data(), twin.size(), y_host.data(), y_host.size()), SZ_OK);
    ASSERT_EQ(szi::twin_decompress(host.bytes.data(), host.bytes.size(), y_twin.data(), y_twin.size()),
              SZ_OK);
    EXPECT_EQ(0, x.empty() ? 0 : std::memcmp(y_host.data(), y_twin.data(), 4 * x.size()));
  }
}

INSTANTIATE_TEST_SUITE_P(DeviceShape, Twin,
                         ::testing::Combine(::testing::ValuesIn(device_cases()),
                                            ::testing::Values(SZ_EB_ABS, SZ_EB_REL)),
                         case_mode_name<::testing::TestParamInfo<Twin::ParamType>>);

// The plan alone gives the exact size (what a caller allocates), and a plan can be written twice.
TEST(DeviceShape, PlanSizeIsTheStreamSize) {
  const std::vector<float> x = relu_sparse(3 * 64 * 64, 0.6, 9);
  const size_t dims[3] = {3, 64, 64};
  szi::TwinPlan p;
  ASSERT_EQ(szi::twin_plan(x.data(), dims, 3, 1e-2, SZ_EB_ABS, &p), SZ_OK);
  Stream host = compress(x, {3, 64, 64}, 1e-2, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(p.stream_size(), host.bytes.size());
  std::vector<uint8_t> a(p.stream_size(), 0xAA), b(p.stream_size(), 0x55);
  szi::twin_write(x.data(), p, a.data());
  szi::twin_write(x.data(), p, b.data());
  EXPECT_TRUE(a == host.bytes);
  EXPECT_TRUE(b == host.bytes);  // every byte written: the fill pattern does not show
}

TEST(DeviceShape, BadRequestsRefusedAsOnTheHost) {
  std::vector<float> x(64, 1.0f);
  std::vector<uint8_t> s;
  const size_t ok_dims[1] = {64}, huge[2] = {(size_t)1 << 30, (size_t)1 << 34};
  EXPECT_EQ(szi::twin_compress(x.data(), ok_dims, 1, 0.0, SZ_EB_ABS, &s), SZ_ERR_PARAM);
  EXPECT_EQ(szi::twin_compress(x.data(), ok_dims, 1, INFINITY, SZ_EB_ABS, &s), SZ_ERR_PARAM);
  EXPECT_EQ(szi::twin_compress(x.data(), ok_dims, 1, 1e-3, 2, &s), SZ_ERR_PARAM);
  EXPECT_EQ(szi::twin_compress(x.data(), ok_dims, 5, 1e-3, SZ_EB_ABS, &s), SZ_ERR_PARAM);
  EXPECT_EQ(szi::twin_compress(x.data(), huge, 2, 1e-3, SZ_EB_ABS, &s), SZ_ERR_PARAM);
}

// Every single-byte change of a stream, checksums recomputed so that only the structural
// checks can object: the device-shape decoder says what the host decoder says, and where
// both accept they decode the same values.
TEST(DeviceShape, ForgedStreamsSameVerdictAsHost) {
  std::vector<float> x = relu_sparse(7 * 197, 0.6, 17);
  x[100] = NAN;
  x[900] = 1e30f;
  for (double eb : {1e-2, 1e-300}) {
    Stream s = compress(x, {7, 197}, eb, SZ_EB_ABS, SZ_LOSSLESS_NONE);
    ASSERT_EQ(s.status, SZ_OK);
    int accepted = 0, rejected = 0;
    for (size_t i = 0; i < s.bytes.size(); ++i) {
      for (uint8_t mask : {0x01, 0x10, 0x80, 0xFF}) {
        std::vector<uint8_t> c = s.bytes;
        c[i] ^= mask;
        if (i < 88 || i >= 104) reseal(c);  // leave checksum-field flips as they are
        std::vector<float> yh(x.size(), 1.0f), yt(x.size(), 2.0f);
        const int h = sz_decompress_host(c.data(), c.size(), yh.data(), yh.size());
        const int t = szi::twin_decompress(c.data(), c.size(), yt.data(), yt.size());
        ASSERT_EQ(h, t) << "byte " << i << " mask " << (int)mask << " eb " << eb;
        if (h == SZ_OK) {
          accepted++;
          ASSERT_EQ(0, std::memcmp(yh.data(), yt.data(), 4 * x.size())) << "byte " << i;
        } else {
          rejected++;
        }
      }
    }
    EXPECT_GT(rejected, 0);
    EXPECT_GT(accepted, 0);  // some resealed data flips are valid streams: both must agree there
  }
}

// Lies that keep every length and count consistent, so that only one check can catch each:
// a flag moved past the last block, a flagged block whose descriptor says "zero block" (its
// data removed and the lengths shortened), a descriptor with more nonzeros than the short last
// block holds.
TEST(DeviceShape, DescriptorLiesRejectedByBoth) {
  std::vector<float> x = random_uniform(70, 3);  // blocks of 32, 32, 6
  const float last[6] = {0.0f, 0.5f, 0.0f, 0.0f, 0.0f, 0.0f};  // sparse: it keeps a bitmap
  std::copy(last, last + 6, x.begin() + 64);
  Stream s = compress(x, {70}, 1e-3, SZ_EB_ABS, SZ_LOSSLESS_NONE);
  ASSERT_EQ(s.status, SZ_OK);
  ASSERT_EQ(s.bytes[SZ_HEADER_SIZE], 0x07);
  const size_t descs = SZ_HEADER_SIZE + 1, data = descs + 6;
  const uint16_t d0 = szi::load_u16le(s.bytes.data() + descs);
  const uint16_t d1 = szi::load_u16le(s.bytes.data() + descs + 2);
  const uint16_t d2 = szi::load_u16le(s.bytes.data() + descs + 4);
  // the last block's size is the same whether it is read as 6 values or as a full block
  ASSERT_EQ(szi::block_data_size(d2, 6), szi::block_data_size(d2, 32));
  std::vector<float> y(x.size());
  auto both = [&](std::vector<uint8_t> c, const char* what) {
    reseal(c);
    EXPECT_EQ(sz_decompress_host(c.data(), c.size(), y.data(), y.size()), SZ_ERR_CORRUPT) << what;
    EXPECT_EQ(szi::twin_decompress(c.data(), c.size(), y.data(), y.size()), SZ_ERR_CORRUPT) << what;
  };
  std::vector<uint8_t> c = s.bytes;
  c[SZ_HEADER_SIZE] = 0x0B;  // block 2's flag moved to block 3, which does not exist
  both(c, "flag past the end");
  c = s.bytes;
  const size_t s1 = szi::block_data_size(d1, 32);
  const size_t at = data + szi::block_data_size(d0, 32);
  c.erase(c.begin() + at, c.begin() + at + s1);
  szi::store_u16le(c.data() + descs + 2, szi::kDescZero);
  szi::store_u64le(c.data() + 64, szi::load_u64le(c.data() + 64) - s1);
  szi::store_u64le(c.data() + 72, szi::load_u64le(c.data() + 72) - s1);
  both(c, "zero descriptor for a flagged block");
  c = s.bytes;
  szi::store_u16le(c.data() + descs + 4, (uint16_t)((d2 & ~(63 << 7)) | 7 << 7));  // nnz 7 > 6
  both(c, "more nonzeros than the last block holds");
}

}  // namespace
