// COMET-Caffe: compressed payloads of SyncedMemory, their encoders and decoders, the GPU pool.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "boost/thread/mutex.hpp"
#include "caffe/comet/mask.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/syncedmem.hpp"
#include "caffe/util/benchmark.hpp"
#include "sz/sz.h"

namespace caffe {

#ifndef CPU_ONLY
// mask.cu
void CometMaskPackGpu(const float* x, size_t count, uint32_t* words, uint32_t* popcount,
                      bool* nonfinite);
void CometMaskDecodeGpu(const uint32_t* words, size_t count, float* x, bool apply_signs,
                        uint32_t* popcount);
#endif

CometPayload::CometPayload(Kind kind, bool on_device, size_t count, const std::string& name)
    : mask_popcount(0), kind_(kind), on_device_(on_device), count_(count), bytes_(0),
      name_(name), device_(NULL) {}

CometPayload::~CometPayload() {
#ifndef CPU_ONLY
  if (device_) CometGpuFree(device_, bytes_);
#endif
}

void CometPayload::Allocate(size_t bytes) {
  CHECK_EQ(bytes_, 0) << "payload allocated twice";
  bytes_ = bytes;
  if (on_device_) {
#ifndef CPU_ONLY
    CometGpuMalloc(&device_, std::max<size_t>(bytes, 1));
#else
    NO_GPU;
#endif
  } else {
    host_.resize(bytes);
  }
}

namespace {

size_t ShapeToDims(const std::vector<int>& shape, size_t dims[SZ_MAX_DIMS]) {
  // Leading axes beyond four are folded into the first; a scalar is one element.
  int nd = static_cast<int>(shape.size());
  if (nd == 0) { dims[0] = 1; return 1; }
  int fold = std::max(0, nd - SZ_MAX_DIMS);
  size_t first = 1;
  for (int i = 0; i <= fold; ++i) first *= shape[i];
  dims[0] = first;
  size_t out = 1;
  for (int i = fold + 1; i < nd; ++i) dims[out++] = shape[i];
  return out;
}

// Scratch for the worst-case stream; payloads keep only the bytes used.
std::vector<uint8_t>& HostScratch() {
  static thread_local std::vector<uint8_t> scratch;
  return scratch;
}

}  // namespace

shared_ptr<CometPayload> CometEncodeLossy(const float* data, const std::vector<int>& shape,
                                          bool on_device, double eb, const std::string& name) {
  size_t dims[SZ_MAX_DIMS];
  const int nd = static_cast<int>(ShapeToDims(shape, dims));
  size_t count = 1;
  for (int i = 0; i < nd; ++i) count *= dims[i];
  shared_ptr<CometPayload> p(new CometPayload(CometPayload::LOSSY, on_device, count, name));
  const size_t bound = sz_compress_bound(count);
  size_t used = 0;
  if (!on_device) {
    std::vector<uint8_t>& scratch = HostScratch();
    if (scratch.size() < bound) scratch.resize(bound);
    sz_params params;
    sz_params_default(&params, eb, SZ_EB_ABS);
    params.lossless = SZ_LOSSLESS_NONE;  // zstd costs time and gains little on quantized codes
    const int rc = sz_compress_host_ex(data, dims, nd, &params, scratch.data(), bound, &used);
    CHECK_EQ(rc, SZ_OK) << "COMET: compressing " << name << " failed: " << sz_strerror(rc);
    p->Allocate(used);
    std::copy(scratch.begin(), scratch.begin() + used, static_cast<uint8_t*>(p->data()));
    return p;
  }
#ifndef CPU_ONLY
  const size_t scratch_bytes = sz_device_scratch_size(count);
  void* out = NULL;
  void* scratch = NULL;
  CometGpuMalloc(&out, bound);
  CometGpuMalloc(&scratch, std::max<size_t>(scratch_bytes, 1));
  const int rc = sz_compress_device(data, dims, nd, eb, SZ_EB_ABS, out, bound, &used, scratch,
                                    scratch_bytes, NULL);
  CHECK_EQ(rc, SZ_OK) << "COMET: compressing " << name << " on the GPU failed: "
                      << sz_strerror(rc);
  p->Allocate(used);
  CUDA_CHECK(cudaMemcpy(p->data(), out, used, cudaMemcpyDeviceToDevice));
  CometGpuFree(scratch, std::max<size_t>(scratch_bytes, 1));
  CometGpuFree(out, bound);
#else
  NO_GPU;
#endif
  return p;
}

shared_ptr<CometPayload> CometEncodeMask(const float* data, size_t count, bool on_device,
                                         const std::string& name) {
  shared_ptr<CometPayload> p(new CometPayload(CometPayload::MASK, on_device, count, name));
  const size_t nwords = comet_mask::words(count);
  p->Allocate(nwords * sizeof(uint32_t));
  bool nonfinite = false;
  uint32_t popcount = 0;
  if (!on_device) {
    uint32_t* words = static_cast<uint32_t*>(p->data());
    const size_t full = count / 32;
    for (size_t w = 0; w < full; ++w) {  // fixed 32-wide inner loop: the compiler vectorizes it
      const float* x = data + 32 * w;
      uint32_t word = 0;
      for (int b = 0; b < 32; ++b) word |= static_cast<uint32_t>(comet_mask::bit_of(x[b])) << b;
      words[w] = word;
    }
    if (full < nwords) words[full] = comet_mask::pack_word(data, count, full, &nonfinite);
    int finite = 1;
    for (size_t i = 0; i < count; ++i) finite &= comet_mask::finite(data[i]);
    nonfinite = nonfinite || !finite;
    for (size_t w = 0; w < nwords; ++w) popcount += __builtin_popcount(words[w]);
  } else {
#ifndef CPU_ONLY
    CometMaskPackGpu(data, count, static_cast<uint32_t*>(p->data()), &popcount, &nonfinite);
#else
    NO_GPU;
#endif
  }
  if (nonfinite) return shared_ptr<CometPayload>();
  p->mask_popcount = popcount;
  return p;
}

namespace {

// Unpacks a mask into out (1 or 0), or with apply_signs clamps out to the recorded signs.
bool DecodeMask(const CometPayload& p, float* out, bool apply_signs, std::string* error) {
  uint32_t popcount = 0;
  if (!p.on_device()) {
    const uint32_t* words = static_cast<const uint32_t*>(p.data());
    const size_t full = p.count() / 32;
    for (size_t w = 0; w < full; ++w) {  // fixed 32-wide inner loops, vectorizable
      float* o = out + 32 * w;
      const uint32_t word = words[w];
      if (apply_signs) {
        for (int b = 0; b < 32; ++b) o[b] = comet_mask::apply_sign(o[b], word, b);
      } else {
        for (int b = 0; b < 32; ++b) o[b] = comet_mask::value_of(word, b);
      }
    }
    for (size_t i = 32 * full; i < p.count(); ++i) {
      out[i] = apply_signs ? comet_mask::apply_sign(out[i], words[i / 32], i % 32)
                           : comet_mask::value_of(words[i / 32], i % 32);
    }
    const size_t nwords = comet_mask::words(p.count());
    for (size_t w = 0; w < nwords; ++w) popcount += __builtin_popcount(words[w]);
    // bits past the end of the last word must be clear
    if (p.count() % 32 && (words[nwords - 1] >> (p.count() % 32))) popcount = ~popcount;
  } else {
#ifndef CPU_ONLY
    CometMaskDecodeGpu(static_cast<const uint32_t*>(p.data()), p.count(), out, apply_signs,
                       &popcount);
#else
    NO_GPU;
#endif
  }
  if (popcount != p.mask_popcount) {
    *error = "mask check failed (bits changed since it was stored)";
    return false;
  }
  return true;
}

}  // namespace

void CometMarkReleased(SyncedMemory* mem, const std::string& what) {
  mem->comet_release();
  mem->comet_payload().reset(new CometPayload(CometPayload::RELEASED, false,
                                              mem->size() / sizeof(float), what));
}

bool CometDecode(const CometPayload& p, float* out, std::string* error) {
  if (p.kind() == CometPayload::RELEASED) {
    // The memory was freshly allocated and zeroed by SyncedMemory; say why it is zero.
    LOG_FIRST_N(WARNING, 20) << "COMET: the " << p.name() << " was freed after its last use in "
        << "the training step (comet { release_unused, release_diffs }); it reads as zeros";
    return true;
  }
  if (p.kind() == CometPayload::LOSSY) {
    // The header must describe exactly this blob before any payload byte is decoded.
    uint8_t header[SZ_HEADER_SIZE];
    const size_t hbytes = std::min<size_t>(SZ_HEADER_SIZE, p.bytes());
    if (p.on_device()) {
#ifndef CPU_ONLY
      CUDA_CHECK(cudaMemcpy(header, p.data(), hbytes, cudaMemcpyDeviceToHost));
#else
      NO_GPU;
#endif
    } else {
      std::copy(static_cast<const uint8_t*>(p.data()),
                static_cast<const uint8_t*>(p.data()) + hbytes, header);
    }
    sz_header_info info;
    int rc = sz_peek_header(header, hbytes, &info);
    if (rc == SZ_OK && (info.n_elems != p.count() || info.stream_size != p.bytes())) {
      *error = "stream header does not match the blob";
      return false;
    }
    if (rc == SZ_OK) {
      if (!p.on_device()) {
        rc = sz_decompress_host(p.data(), p.bytes(), out, p.count());
      } else {
#ifndef CPU_ONLY
        const size_t scratch_bytes = sz_device_scratch_size(p.count());
        void* scratch = NULL;
        CometGpuMalloc(&scratch, std::max<size_t>(scratch_bytes, 1));
        rc = sz_decompress_device(p.data(), p.bytes(), out, p.count(), scratch, scratch_bytes,
                                  NULL);
        CometGpuFree(scratch, std::max<size_t>(scratch_bytes, 1));
#else
        NO_GPU;
#endif
      }
    }
    if (rc != SZ_OK) {
      *error = sz_strerror(rc);
      return false;
    }
    if (p.sign_mask) {
      if (p.sign_mask->count() != p.count()) {
        *error = "sign mask does not match the stream";
        return false;
      }
      return DecodeMask(*p.sign_mask, out, true, error);
    }
    return true;
  }
  return DecodeMask(p, out, false, error);
}

void CometRestore(SyncedMemory* mem) {
  shared_ptr<CometPayload> p;
  p.swap(mem->comet_payload());  // detached first: the accesses below must not recurse
  CPUTimer timer;
  timer.Start();
  float* out = static_cast<float*>(p->on_device() ? mem->mutable_gpu_data()
                                                  : mem->mutable_cpu_data());
  CHECK_GE(mem->size(), p->dense_bytes()) << "COMET: blob " << p->name() << " shrank";
  std::string error;
  if (!CometDecode(*p, out, &error)) {
    LOG(FATAL) << "COMET: the compressed data of blob '" << p->name() << "' is corrupt ("
               << error << "); refusing to use it";
  }
  if (p->timing) p->timing->decode_ms += timer.MilliSeconds();
}

// ------------------------------------------------------------------------------ GPU pool
#ifndef CPU_ONLY
namespace {

struct GpuPool {
  boost::mutex mutex;
  int enabled;
  std::multimap<std::pair<int, size_t>, void*> free_blocks;  // (device, size) -> block
  size_t in_use, cached, peak_in_use;
  GpuPool() : enabled(0), in_use(0), cached(0), peak_in_use(0) {}

  void ReleaseCached() {
    for (std::multimap<std::pair<int, size_t>, void*>::iterator it = free_blocks.begin();
         it != free_blocks.end(); ++it) {
      CUDA_CHECK(cudaFree(it->second));
    }
    free_blocks.clear();
    cached = 0;
  }
};

GpuPool& Pool() {
  static GpuPool* pool = new GpuPool();  // never destroyed: frees may come during exit
  return *pool;
}

}  // namespace

void CometGpuPoolEnable(bool on) {
  GpuPool& pool = Pool();
  boost::mutex::scoped_lock lock(pool.mutex);
  pool.enabled += on ? 1 : -1;
}

void CometGpuMalloc(void** ptr, size_t size) {
  GpuPool& pool = Pool();
  boost::mutex::scoped_lock lock(pool.mutex);
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  std::multimap<std::pair<int, size_t>, void*>::iterator it =
      pool.free_blocks.find(std::make_pair(device, size));
  if (it != pool.free_blocks.end()) {
    *ptr = it->second;
    pool.free_blocks.erase(it);
    pool.cached -= size;
  } else {
    cudaError_t err = cudaMalloc(ptr, size);
    if (err == cudaErrorMemoryAllocation && pool.cached) {
      cudaGetLastError();  // clear it, give the cache back and try once more
      pool.ReleaseCached();
      err = cudaMalloc(ptr, size);
    }
    CUDA_CHECK(err);
  }
  pool.in_use += size;
  pool.peak_in_use = std::max(pool.peak_in_use, pool.in_use);
}

void CometGpuFree(void* ptr, size_t size) {
  GpuPool& pool = Pool();
  boost::mutex::scoped_lock lock(pool.mutex);
  pool.in_use -= std::min(pool.in_use, size);
  if (!pool.enabled) {
    CUDA_CHECK(cudaFree(ptr));
    return;
  }
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  pool.free_blocks.insert(std::make_pair(std::make_pair(device, size), ptr));
  pool.cached += size;
}

CometGpuPoolStats CometGpuPoolQuery() {
  GpuPool& pool = Pool();
  boost::mutex::scoped_lock lock(pool.mutex);
  CometGpuPoolStats s = {pool.in_use, pool.cached, pool.peak_in_use};
  return s;
}
#else
void CometGpuPoolEnable(bool) {}
CometGpuPoolStats CometGpuPoolQuery() {
  CometGpuPoolStats s = {0, 0, 0};
  return s;
}
#endif  // CPU_ONLY

}  // namespace caffe
