// COMET-Caffe: compressed payloads of SyncedMemory, their encoders and decoders (the memory pools:
// pool.cpp).
#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <atomic>  // NOLINT(build/c++11)
#include <cmath>
#include <mutex>  // NOLINT(build/c++11)
#include <thread>  // NOLINT(build/c++11)

#include "caffe/comet/batchnorm_moments.hpp"
#include "caffe/comet/mask.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/payload_gpu.hpp"
#include "caffe/comet/worker.hpp"
#include "caffe/syncedmem.hpp"
#include "sz/sz.h"

namespace caffe {


namespace {

// Lossy streams differ in size every step, so no pool could reuse them; large ones are mapped
// directly so that freeing them really returns the memory.
const size_t kDirectMapBytes = 1 << 20;

}  // namespace

CometPayload::CometPayload(Kind kind, bool on_device, size_t count, const std::string& name)
    : mask_popcount(0), code_bits(0), eb(0), inner(0), negative_slope(0), kind_(kind), on_device_(on_device), count_(count), bytes_(0),
      name_(name), host_(NULL), host_cuda_(false), host_mapped_(false), device_(NULL) {}

CometPayload::~CometPayload() {
  if (host_ && host_mapped_) {
    CometHostUnmap(host_, bytes_);
  } else if (host_) {
    CometHostFree(host_, std::max<size_t>(bytes_, 1), host_cuda_);
  }
  if (device_) CometGpuFree(device_, std::max<size_t>(bytes_, 1));
}

void CometPayload::Allocate(size_t bytes) {
  CHECK_EQ(bytes_, 0) << "payload allocated twice";
  bytes_ = bytes;
  if (on_device_) {
    CometGpuMalloc(&device_, std::max<size_t>(bytes, 1));
  } else {
    if (kind_ == LOSSY && bytes >= kDirectMapBytes) {
      host_ = CometHostMap(bytes);
      host_mapped_ = true;
    } else {
      CometHostMalloc(&host_, std::max<size_t>(bytes, 1), &host_cuda_);
    }
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

// Runs fn(begin, end) on [0, n) split into one contiguous range per hardware thread (ranges
// start at multiples of `align`) on the cores' team, or inline when n is small. Caffe's own
// work (BLAS) is idle while the store encodes or decodes in the step, so the cores are free; on
// the store's worker thread (comet { async }) the step runs beside it, and the work stays on the
// worker's core.
template <typename Fn>
void ParallelRanges(size_t n, size_t align, Fn fn) {
  const size_t threads = std::max(1u, std::thread::hardware_concurrency());
  if (threads == 1 || n < (size_t(1) << 16) || CometWorker::OnWorker()) {
    fn(size_t(0), n);
    return;
  }
  const size_t chunk = ((n + threads - 1) / threads + align - 1) / align * align;
  struct Ranges {
    Fn* fn;
    size_t n, chunk;
  } ranges = {&fn, n, chunk};
  CometTeam::Get().Run(static_cast<int>((n + chunk - 1) / chunk), [](void* arg, int t) {
    const Ranges& r = *static_cast<const Ranges*>(arg);
    (*r.fn)(t * r.chunk, std::min(r.n, (t + 1) * r.chunk));
  }, &ranges);
}

// sz's host backend takes its threads from the same team (sz_set_executor): no codec call in
// the step creates threads. Installed when this library loads; the team starts on first use.
void TeamExecutor(void*, int n, sz_task task, void* arg) { CometTeam::Get().Run(n, task, arg); }
const bool team_installed = (sz_set_executor(&TeamExecutor, NULL), true);

std::atomic<size_t> host_scratch_bytes(0);  // all threads' HostScratch together, as resident

// Each thread's encoder output (payloads keep only the bytes used), sized for the worst case
// (sz_compress_bound, about 4 bytes a value) but mapped untouched: only the pages an encode
// writes become resident (a stream and the room of its block descriptors), not all 4 bytes a
// value of the largest blob stored lossy (a zero-filled vector made 73 MB of CaffeNet's pool1 at
// batch 256 resident for good).
struct HostScratch {
  HostScratch() : data(NULL), capacity(0), resident(0) {}
  ~HostScratch() { Reset(0); }
  void Reset(size_t bytes) {
    if (data) CometHostUnmap(data, capacity);
    host_scratch_bytes -= resident;
    data = bytes ? static_cast<uint8_t*>(CometHostMap(bytes)) : NULL;
    capacity = bytes;
    resident = 0;
  }
  // An encode of `count` values wrote a stream of `used` bytes: the pages it touched are the
  // stream and the room of the worst-case descriptors (2 bytes a block of 32, flag bits).
  void Wrote(size_t used, size_t count) {
    const size_t touched = std::min(capacity, used + count / 16 + count / 256 + 4096);
    if (touched > resident) {
      host_scratch_bytes += touched - resident;
      resident = touched;
    }
  }
  uint8_t* data;
  size_t capacity, resident;
};
// One such buffer is held between encodes, whichever thread encodes. An encode that finds it in
// use (the step runs a queued job beside the worker's: CometWorker::Wait) maps one of its own for
// that encode alone: a buffer per thread held for good put a second ~22 MB in CaffeNet's peak at
// batch 256 (tracked scratch 43.5 against 22.6 MB).
std::mutex held_scratch_lock;
HostScratch& HeldScratch() {
  static HostScratch scratch;
  return scratch;
}
std::atomic<size_t> transient_peak(0);      // largest device transient since the last take


}  // namespace

void CometNoteTransient(size_t bytes) {
  size_t seen = transient_peak.load();
  while (bytes > seen && !transient_peak.compare_exchange_weak(seen, bytes)) {}
}

namespace {

// The codec's threads: all of them in the step, one on the store's worker (ParallelRanges).
int CodecThreads() { return CometWorker::OnWorker() ? 1 : 0; }

// An sz status in words, with CUDA's own error where the status is a CUDA failure.
std::string SzError(int rc) {
  std::string why = sz_strerror(rc);
  if (rc == SZ_ERR_CUDA) why += std::string(": ") + sz_cuda_error();
  return why;
}

}  // namespace

shared_ptr<CometPayload> CometEncodeLossy(const float* data, const std::vector<int>& shape,
                                          bool on_device, double eb, const std::string& name,
                                          std::string* error) {
  size_t dims[SZ_MAX_DIMS];
  const int nd = static_cast<int>(ShapeToDims(shape, dims));
  size_t count = 1;
  for (int i = 0; i < nd; ++i) count *= dims[i];
  shared_ptr<CometPayload> p(new CometPayload(CometPayload::LOSSY, on_device, count, name));
  const size_t bound = sz_compress_bound(count);
  int rc;
  if (!on_device) {
    std::unique_lock<std::mutex> held(held_scratch_lock, std::try_to_lock);
    HostScratch own;  // unmapped when this encode returns
    HostScratch& scratch = held.owns_lock() ? HeldScratch() : own;
    if (scratch.capacity < bound) scratch.Reset(bound);
    sz_params params;
    sz_params_default(&params, eb, SZ_EB_ABS);
    params.lossless = SZ_LOSSLESS_NONE;  // zstd costs time and gains little on quantized codes
    params.nthreads = CodecThreads();
    size_t used = 0;
    rc = sz_compress_host_ex(data, dims, nd, &params, scratch.data, bound, &used);
    if (rc == SZ_OK) {
      scratch.Wrote(used, count);
      p->Allocate(used);
      std::copy(scratch.data, scratch.data + used, static_cast<uint8_t*>(p->data()));
    }
    p->eb = eb;
  } else {
    rc = CometLossyEncodeGpu(data, dims, nd, eb, p.get());
    p->eb = eb;
  }
  if (rc != SZ_OK) {
    if (error) {
      *error = SzError(rc);
      return shared_ptr<CometPayload>();
    }
    LOG(FATAL) << "COMET: compressing " << name << (on_device ? " on the GPU" : "")
               << " failed: " << SzError(rc);
  }
  return p;
}

namespace {
// Per-lane running maxima of |x| over 32 values: a fixed-width loop the compiler vectorizes
// (lane > v ? lane : v is maxps exactly; NaN is caught by the finite test beside it).
inline void MaxAbs32(const float* x, float* lanes) {
  for (int b = 0; b < 32; ++b) {
    const float v = std::fabs(x[b]);
    lanes[b] = lanes[b] > v ? lanes[b] : v;
  }
}
inline float LanesMax(const float* lanes) {
  float m = 0;
  for (int b = 0; b < 32; ++b) m = std::max(m, lanes[b]);
  return m;
}
}  // namespace

float CometMaxAbs(const float* data, size_t count, bool* finite) {
  float lanes[32] = {0};
  int fin = 1;
  const size_t full = count / 32;
  for (size_t w = 0; w < full; ++w) {
    const float* x = data + 32 * w;
    MaxAbs32(x, lanes);
    for (int b = 0; b < 32; ++b) fin &= comet_mask::finite(x[b]);
  }
  float m = LanesMax(lanes);
  for (size_t i = 32 * full; i < count; ++i) {
    fin &= comet_mask::finite(data[i]);
    m = std::max(m, std::fabs(data[i]));
  }
  *finite = fin != 0;
  return m;
}

shared_ptr<CometPayload> CometEncodeMask(const float* data, size_t count, bool on_device,
                                         const std::string& name, float* max_abs) {
  CHECK(!(on_device && max_abs)) << "COMET: a mask's largest magnitude is a host pass";
  shared_ptr<CometPayload> p(new CometPayload(CometPayload::MASK, on_device, count, name));
  const size_t nwords = comet_mask::words(count);
  p->Allocate(nwords * sizeof(uint32_t));
  bool nonfinite = false;
  uint32_t popcount = 0;
  if (!on_device) {
    uint32_t* words = static_cast<uint32_t*>(p->data());
    const size_t full = count / 32;
    std::atomic<uint32_t> counted(0);
    std::atomic<int> finite(1);
    std::mutex largest_lock;
    float largest = 0;
    ParallelRanges(full, 1, [&](size_t w0, size_t w1) {
      uint32_t pc = 0;
      int fin = 1;
      float lanes[32] = {0};
      for (size_t w = w0; w < w1; ++w) {  // fixed 32-wide inner loops: vectorized
        const float* x = data + 32 * w;
        const uint32_t word = comet_mask::word32::pack(x);
        for (int b = 0; b < 32; ++b) fin &= comet_mask::finite(x[b]);
        if (max_abs) MaxAbs32(x, lanes);
        words[w] = word;
        pc += __builtin_popcount(word);
      }
      counted += pc;
      finite &= fin;
      if (max_abs) {
        std::lock_guard<std::mutex> hold(largest_lock);
        largest = std::max(largest, LanesMax(lanes));
      }
    });
    popcount = counted;
    nonfinite = !finite;
    if (full < nwords) {
      words[full] = comet_mask::pack_word(data, count, full, &nonfinite);
      popcount += __builtin_popcount(words[full]);
      if (max_abs)
        for (size_t i = 32 * full; i < count; ++i) largest = std::max(largest, std::fabs(data[i]));
    }
    if (max_abs) *max_abs = largest;
  } else {
    CometMaskPackGpu(data, count, static_cast<uint32_t*>(p->data()), &popcount, &nonfinite);
  }
  if (nonfinite) return shared_ptr<CometPayload>();
  p->mask_popcount = popcount;
  return p;
}

namespace {

// Every mask and code payload carries the popcount of its words when stored; a different count
// when it is read means its bits changed.
bool PopcountMatches(const CometPayload& p, uint32_t popcount, std::string* error) {
  if (popcount == p.mask_popcount) return true;
  *error = "bit check failed (the " + std::string(p.kind() == CometPayload::MASK ? "mask" : "codes") +
           " changed since stored)";
  return false;
}

// An argmax code whose popcount still matches may name padding or lie past its window: refused
// (upstream's backward would send the gradient outside the window, or outside the plane).
const char kCodeOutsideItsWindow[] = "a code names no element of its window";

// Popcount of a host bit stream of total_bits bits; bits past the end must be clear, and a set
// one makes the count wrong on purpose.
// Built for the popcnt instruction where the CPU has it (Caffe's flags target baseline x86-64,
// where __builtin_popcount is a call into libgcc).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("popcnt", "default")))
#endif
uint32_t HostPopcount(const uint32_t* words, size_t total_bits) {
  const size_t nwords = (total_bits + 31) / 32;
  uint32_t popcount = 0;
  for (size_t w = 0; w < nwords; ++w) popcount += __builtin_popcount(words[w]);
  if (total_bits % 32 && (words[nwords - 1] >> (total_bits % 32))) popcount = ~popcount;
  return popcount;
}

// An ARGMAX or BINARY payload with room for `count` codes of `bits` bits.
shared_ptr<CometPayload> NewCodes(CometPayload::Kind kind, size_t count, int bits,
                                  const comet_codes::PoolGeometry& g,
                                  const comet_codes::BinaryRule& r, bool on_device,
                                  const std::string& name) {
  shared_ptr<CometPayload> p(new CometPayload(kind, on_device, count, name));
  p->Allocate(comet_codes::words(count, bits) * sizeof(uint32_t));
  p->code_bits = bits;
  p->pool = g;
  p->binary = r;
  return p;
}

// Whether a codes payload has the width its kind and window give, and the bytes that takes.
bool CodeWidthMatches(const CometPayload& p) {
  const bool argmax = p.kind() == CometPayload::ARGMAX;
  return comet_codes::bits_for(argmax ? p.pool.kernel_h * p.pool.kernel_w : 2) == p.code_bits &&
         p.bytes() == comet_codes::words(p.count(), p.code_bits) * sizeof(uint32_t);
}

shared_ptr<CometPayload> EncodeCodes(CometPayload::Kind kind, const int32_t* v, size_t count,
                                     int bits, const comet_codes::PoolGeometry& g,
                                     const comet_codes::BinaryRule& r, bool on_device,
                                     const std::string& name) {
  shared_ptr<CometPayload> p = NewCodes(kind, count, bits, g, r, on_device, name);
  const bool argmax = kind == CometPayload::ARGMAX;
  const size_t nwords = comet_codes::words(count, bits);
  bool bad = false;
  uint32_t popcount = 0;
  if (!on_device && argmax) {
    // Sequential walk over the pooled positions, the width's division as a multiply, and each
    // word built in a register and stored once (every word is written).
    uint32_t* words = static_cast<uint32_t*>(p->data());
    const size_t per = 32 / bits;  // ranges of whole words: no two threads share a word
    const comet_codes::Divider by_width = comet_codes::make_divider(g.width);
    std::atomic<int> any_bad(0);
    ParallelRanges(count, per, [&](size_t i0, size_t i1) {
      int ph = static_cast<int>((i0 / g.pooled_width) % g.pooled_height);
      int pw = static_cast<int>(i0 % g.pooled_width);
      int b = 0;
      for (size_t w = i0 / per; w * per < i1; ++w) {  // i0 is a multiple of per
        const size_t end = std::min(i1, (w + 1) * per);
        uint32_t word = 0;
        int shift = 0;
        for (size_t i = w * per; i < end; ++i, shift += bits) {
          uint32_t code = 0;
          if (!comet_codes::argmax_code_fast(v[i], ph, pw, g, by_width, &code)) b = 1;
          word |= code << shift;
          if (++pw == g.pooled_width) {
            pw = 0;
            if (++ph == g.pooled_height) ph = 0;
          }
        }
        words[w] = word;
      }
      any_bad |= b;
    });
    bad = any_bad != 0;
    popcount = HostPopcount(words, count * bits);
  } else if (!on_device) {
    uint32_t* words = static_cast<uint32_t*>(p->data());
    for (size_t w = 0; w < nwords; ++w)
      words[w] = comet_codes::pack_codes(v, count, bits, w, argmax, g, r, &bad);
    popcount = HostPopcount(words, count * bits);
  } else {
    CometCodesPackGpu(v, count, bits, argmax, g, r, static_cast<uint32_t*>(p->data()),
                      &popcount, &bad);
  }
  if (bad) return shared_ptr<CometPayload>();
  p->mask_popcount = popcount;
  return p;
}

bool DecodeCodes(const CometPayload& p, int32_t* out, std::string* error) {
  const bool argmax = p.kind() == CometPayload::ARGMAX;
  if (!CodeWidthMatches(p)) {
    *error = "code width does not match";
    return false;
  }
  uint32_t popcount = 0;
  if (!p.on_device()) {
    const uint32_t* words = static_cast<const uint32_t*>(p.data());
    const comet_codes::PoolGeometry& g = p.pool;
    // argmax_index_at is linear in the window's corner: the index is the corner (code 0) plus
    // an offset that depends on the code alone, so a table of offsets replaces its division per
    // element, and tables of the code's row and column in the window check that it names an
    // element of the plane. Codes past the tables name none.
    const int ncodes = argmax ? g.kernel_h * g.kernel_w : 0;
    std::vector<int> offset(ncodes), row(ncodes), col(ncodes);
    for (int c = 0; c < ncodes; ++c) {
      offset[c] = comet_codes::argmax_index_at(static_cast<uint32_t>(c), 0, 0, g) -
                  comet_codes::argmax_index_at(0, 0, 0, g);
      row[c] = c / g.kernel_w;
      col[c] = c % g.kernel_w;
    }
    std::atomic<int> any_bad(0);
    ParallelRanges(p.count(), 1, [&](size_t i0, size_t i1) {
      int ph = static_cast<int>((i0 / g.pooled_width) % g.pooled_height);
      int pw = static_cast<int>(i0 % g.pooled_width);
      int corner = comet_codes::argmax_index_at(0, ph, pw, g);
      bool bad = false;
      for (size_t i = i0; i < i1; ++i) {
        const uint32_t code = comet_codes::code_at(words, i, p.code_bits);
        if (!argmax) {
          out[i] = static_cast<int32_t>(code ? p.binary.one : 0u);
          continue;
        }
        if (code < static_cast<uint32_t>(ncodes)) {
          out[i] = corner + offset[code];
          const int h = ph * g.stride_h - g.pad_h + row[code];
          const int w = pw * g.stride_w - g.pad_w + col[code];
          bad = bad || h < 0 || h >= g.height || w < 0 || w >= g.width;
        } else {
          bad = true;  // the decode is refused: no index to write
        }
        corner += g.stride_w;
        if (++pw == g.pooled_width) {
          pw = 0;
          if (++ph == g.pooled_height) ph = 0;
          corner = comet_codes::argmax_index_at(0, ph, 0, g);
        }
      }
      if (bad) any_bad = 1;
    });
    if (any_bad) {
      *error = kCodeOutsideItsWindow;
      return false;
    }
    popcount = HostPopcount(words, p.count() * p.code_bits);
  } else {
    bool bad = false;
    CometCodesUnpackGpu(static_cast<const uint32_t*>(p.data()), p.count(), p.code_bits, argmax,
                        p.pool, p.binary, out, &popcount, &bad);
    if (bad) {
      *error = kCodeOutsideItsWindow;
      return false;
    }
  }
  return PopcountMatches(p, popcount, error);
}

}  // namespace

shared_ptr<CometPayload> CometEncodeArgmax(const int* idx, size_t count,
                                           const comet_codes::PoolGeometry& g, bool on_device,
                                           const std::string& name) {
  const int bits = comet_codes::bits_for(g.kernel_h * g.kernel_w);
  if (bits == 0) return shared_ptr<CometPayload>();  // a window of more than 65536 values
  const comet_codes::BinaryRule unused = {0, 1};
  return EncodeCodes(CometPayload::ARGMAX, idx, count, bits, g, unused, on_device, name);
}

shared_ptr<CometPayload> CometEncodeBinary(const unsigned int* v, size_t count,
                                           const comet_codes::BinaryRule& rule, bool on_device,
                                           const std::string& name) {
  comet_codes::PoolGeometry none = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0};
  return EncodeCodes(CometPayload::BINARY, reinterpret_cast<const int32_t*>(v), count, 1, none,
                     rule, on_device, name);
}

shared_ptr<CometPayload> CometPoolToCodes(const float* bottom, float* top, size_t count,
                                          const comet_codes::PoolGeometry& g, bool on_device,
                                          const std::string& name) {
  const int bits = comet_codes::bits_for(g.kernel_h * g.kernel_w);
  const size_t pooled = static_cast<size_t>(g.pooled_height) * g.pooled_width;
  if (bits == 0 || pooled == 0 || count % pooled) return shared_ptr<CometPayload>();
  shared_ptr<CometPayload> p = NewCodes(CometPayload::ARGMAX, count, bits, g,
                                        comet_codes::BinaryRule{0, 1}, on_device, name);
  uint32_t popcount = 0;
  bool bad = false;
  if (!on_device) {
    uint32_t* words = static_cast<uint32_t*>(p->data());
    const size_t per = 32 / bits;  // ranges of whole words
    std::atomic<int> any_bad(0);
    ParallelRanges(count, per, [&](size_t i0, size_t i1) {
      bool b = false;
      for (size_t w = i0 / per; w * per < i1; ++w)
        words[w] = comet_codes::max_pool_word(bottom, top, count, bits, w, g, &b);
      if (b) any_bad = 1;
    });
    bad = any_bad != 0;
    popcount = HostPopcount(words, count * bits);
  } else {
    CometPoolToCodesGpu(bottom, top, count, bits, g, static_cast<uint32_t*>(p->data()), &popcount,
                        &bad);
  }
  if (bad) return shared_ptr<CometPayload>();
  p->mask_popcount = popcount;
  return p;
}

bool CometPoolBackwardFromCodes(const CometPayload& codes, const float* top_diff,
                                float* bottom_diff, std::string* error) {
  const comet_codes::PoolGeometry& g = codes.pool;
  const size_t pooled = static_cast<size_t>(g.pooled_height) * g.pooled_width;
  const size_t plane = static_cast<size_t>(g.height) * g.width;
  if (codes.kind() != CometPayload::ARGMAX || pooled == 0 || codes.count() % pooled ||
      !CodeWidthMatches(codes)) {
    *error = "not max pooling codes of this shape";
    return false;
  }
  const int bits = codes.code_bits;
  uint32_t popcount = 0;
  if (!codes.on_device()) {
    // PoolingLayer::Backward_cpu's scatter, plane by plane (a plane to one thread), with each
    // target checked to lie in its window's plane: a corrupt code writes nowhere else.
    const uint32_t* words = static_cast<const uint32_t*>(codes.data());
    std::atomic<int> any_bad(0);
    ParallelRanges(codes.count(), pooled, [&](size_t i0, size_t i1) {
      bool b = false;
      for (size_t q = i0 / pooled; q * pooled < i1; ++q) {
        float* out = bottom_diff + q * plane;
        const float* in = top_diff + q * pooled;
        std::fill(out, out + plane, 0.f);
        for (int ph = 0, r = 0; ph < g.pooled_height; ++ph) {
          for (int pw = 0; pw < g.pooled_width; ++pw, ++r) {
            const int t = comet_codes::max_pool_target(
                comet_codes::code_at(words, q * pooled + r, bits), ph, pw, g);
            if (t < 0) {
              b = true;
              continue;
            }
            out[t] += in[r];
          }
        }
      }
      if (b) any_bad = 1;
    });
    if (any_bad) {
      *error = kCodeOutsideItsWindow;
      return false;
    }
    popcount = HostPopcount(words, codes.count() * bits);
  } else {
    bool bad = false;
    CometPoolBackwardGpu(static_cast<const uint32_t*>(codes.data()), codes.count(), bits, g,
                         top_diff, bottom_diff, &popcount, &bad);
    if (bad) {
      *error = kCodeOutsideItsWindow;
      return false;
    }
  }
  return PopcountMatches(codes, popcount, error);
}

bool CometReluBackward(const CometPayload& mask, const float* top_diff, float* bottom_diff,
                       float negative_slope, std::string* error) {
  if (mask.kind() != CometPayload::MASK) {
    *error = "not a sign mask";
    return false;
  }
  uint32_t popcount = 0;
  const size_t count = mask.count();
  if (!mask.on_device()) {
    const uint32_t* words = static_cast<const uint32_t*>(mask.data());
    const size_t full = count / 32;
    ParallelRanges(full, 1, [&](size_t w0, size_t w1) {
      for (size_t w = w0; w < w1; ++w) {  // a word at a time, vectorized
        const float* t = top_diff + 32 * w;
        float* b = bottom_diff + 32 * w;
        const uint32_t word = words[w];
        comet_mask::word32::relu_diff(t, b, word, negative_slope);
      }
    });
    for (size_t i = 32 * full; i < count; ++i) {
      bottom_diff[i] = comet_codes::relu_diff(top_diff[i], words[i / 32],
                                              static_cast<int>(i % 32), negative_slope);
    }
    popcount = HostPopcount(words, count);
  } else {
    CometReluBackwardGpu(static_cast<const uint32_t*>(mask.data()), count, top_diff, bottom_diff,
                         negative_slope, &popcount);
  }
  return PopcountMatches(mask, popcount, error);
}

namespace {

// Unpacks a mask into out (1 or 0), or with apply_signs clamps out to the recorded signs.
bool DecodeMask(const CometPayload& p, float* out, bool apply_signs, std::string* error) {
  uint32_t popcount = 0;
  if (!p.on_device()) {
    const uint32_t* words = static_cast<const uint32_t*>(p.data());
    const size_t full = p.count() / 32;
    ParallelRanges(full, 1, [&](size_t w0, size_t w1) {
      for (size_t w = w0; w < w1; ++w) {  // a word at a time, vectorized
        float* o = out + 32 * w;
        const uint32_t word = words[w];
        if (apply_signs) {
          comet_mask::word32::apply_signs(o, word);
        } else {
          comet_mask::word32::values(o, word);
        }
      }
    });
    for (size_t i = 32 * full; i < p.count(); ++i) {
      out[i] = apply_signs ? comet_mask::apply_sign(out[i], words[i / 32], i % 32)
                           : comet_mask::value_of(words[i / 32], i % 32);
    }
    popcount = HostPopcount(words, p.count());
  } else {
    CometMaskDecodeGpu(static_cast<const uint32_t*>(p.data()), p.count(), out, apply_signs,
                       &popcount);
  }
  return PopcountMatches(p, popcount, error);
}

}  // namespace

size_t CometEncoderHeldBytes() { return host_scratch_bytes.load(); }
void CometReleaseEncoderBuffer() {
  std::lock_guard<std::mutex> held(held_scratch_lock);
  HeldScratch().Reset(0);
}
size_t CometTakeTransientPeak() { return transient_peak.exchange(0); }

void CometMarkReleased(SyncedMemory* mem, const std::string& what, const std::string& kept_by) {
  mem->comet_release();
  mem->comet_payload().reset(new CometPayload(CometPayload::RELEASED, false,
                                              mem->size() / sizeof(float), what));
  mem->comet_payload()->kept_by = kept_by;
}

void CometMarkFill(SyncedMemory* mem) {
  if (mem->head() != SyncedMemory::UNINITIALIZED) return;
  const shared_ptr<CometPayload>& held = mem->comet_payload();
  if (held && held->kind() != CometPayload::RELEASED) return;
  static const shared_ptr<CometPayload> fill(new CometPayload(CometPayload::FILL, false, 0, ""));
  mem->comet_payload() = fill;
}

shared_ptr<CometPayload> CometMakeDerived(const shared_ptr<CometPayload>& source,
                                          const std::vector<float>& scale,
                                          const std::vector<float>& bias, size_t inner,
                                          const shared_ptr<CometPayload>& sign_mask,
                                          float negative_slope, const std::string& name) {
  CHECK(source && source->kind() == CometPayload::LOSSY && !source->on_device())
      << "COMET: " << name << " is rebuilt from a host lossy stream only";
  shared_ptr<CometPayload> p(new CometPayload(CometPayload::DERIVED, false, source->count(), name));
  p->source = source;
  p->channel_scale = scale;
  p->channel_bias = bias;
  p->inner = inner;
  p->sign_mask = sign_mask;
  p->negative_slope = negative_slope;
  return p;
}

bool CometRebuild(const CometPayload& p, const float* x, float* out, std::string* error) {
  const size_t count = p.count(), channels = p.channel_scale.size(), inner = p.inner;
  if (p.kind() != CometPayload::DERIVED || p.on_device() || !channels || !inner ||
      count % (channels * inner) || (!p.channel_bias.empty() && p.channel_bias.size() != channels) ||
      (p.sign_mask && p.sign_mask->count() != count)) {
    *error = "the parts it is rebuilt from do not fit together";
    return false;
  }
  const uint32_t* words = p.sign_mask ? static_cast<const uint32_t*>(p.sign_mask->data()) : NULL;
  const float slope = p.negative_slope;
  const float* a = p.channel_scale.data();
  const float* b = p.channel_bias.empty() ? NULL : p.channel_bias.data();
  // Two vectorizable passes per piece of kPiece values (in cache for the second): a x + b along
  // each plane (image n, channel c: the factors are constant along it), then ReLU from the mask,
  // a word of 32 values at a time (pieces start at multiples of 32; planes need not).
  const size_t kPiece = 4096;
  ParallelRanges(count, kPiece, [&](size_t r0, size_t r1) {
    for (size_t p0 = r0; p0 < r1; p0 += kPiece) {
      const size_t p1 = std::min(r1, p0 + kPiece);
      for (size_t i = p0; i < p1;) {
        const size_t q = i / inner, end = std::min(p1, (q + 1) * inner);
        const float ac = a[q % channels], bc = b ? b[q % channels] : 0.f;
        for (size_t k = i; k < end; ++k) out[k] = ac * x[k] + bc;
        i = end;
      }
      if (!words) continue;
      const size_t w1 = p1 / 32;
      for (size_t w = p0 / 32; w < w1; ++w) comet_mask::word32::relu(out + 32 * w, words[w], slope);
      for (size_t i = 32 * w1; i < p1; ++i)  // the last word of the blob, when partial
        out[i] = comet_mask::relu_of(out[i], words[w1], static_cast<int>(i % 32), slope);
    }
  });
  return !words || PopcountMatches(*p.sign_mask, HostPopcount(words, count), error);
}

namespace {
// A LOSSY stream's channel offsets added back to its decoded values.
bool AddOffsetsBack(const CometPayload& p, float* out, std::string* error) {
  const CometPayload& o = *p.channel_offsets;
  const size_t channels = o.count();
  if (o.kind() != CometPayload::OFFSETS || o.on_device() != p.on_device() || !channels ||
      o.bytes() != channels * sizeof(float) || !o.inner || p.count() % (channels * o.inner)) {
    *error = "its channel offsets do not fit the stream";
    return false;
  }
  const float* offsets = static_cast<const float*>(o.data());
  if (!p.on_device()) {
    CometAddChannelOffsets(p.count(), static_cast<int>(channels), o.inner, offsets, 1.f, out);
  } else {
#ifndef CPU_ONLY
    CometAddChannelOffsetsGpu(p.count(), static_cast<int>(channels), o.inner, offsets, 1.f, out);
#else
    NO_GPU;
#endif
  }
  return true;
}
}  // namespace

bool CometDecode(const CometPayload& p, void* dense, std::string* error) {
  if (p.kind() == CometPayload::ARGMAX || p.kind() == CometPayload::BINARY)
    return DecodeCodes(p, static_cast<int32_t*>(dense), error);
  float* out = static_cast<float*>(dense);
  if (p.kind() == CometPayload::DERIVED) {
    if (!p.source || p.source->kind() != CometPayload::LOSSY || p.source->count() != p.count()) {
      *error = "the stream it is rebuilt from is missing or of another size";
      return false;
    }
    return CometDecode(*p.source, out, error) && CometRebuild(p, out, out, error);
  }
  if (p.kind() == CometPayload::RELEASED || p.kind() == CometPayload::IN_FLIGHT ||
      p.kind() == CometPayload::FILL) {
    *error = "the memory was freed; nothing holds its content";
    return false;
  }
  if (p.kind() == CometPayload::LOSSY) {
    // The header must describe exactly this blob before any payload byte is decoded.
    uint8_t header[SZ_HEADER_SIZE];
    const size_t hbytes = std::min<size_t>(SZ_HEADER_SIZE, p.bytes());
    if (p.on_device()) {
      CometCopyToHost(header, p.data(), hbytes);
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
        rc = sz_decompress_host_ex(p.data(), p.bytes(), out, p.count(), CodecThreads());
      } else {
        rc = CometLossyDecodeGpu(p, out);
      }
    }
    if (rc != SZ_OK) {
      *error = SzError(rc);
      return false;
    }
    if (p.channel_offsets && !AddOffsetsBack(p, out, error)) return false;
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

namespace {
std::string& ReadContext() {
  static std::string* context = new std::string("outside a COMET training step");
  return *context;
}
const CometReadDescriber* read_describer = NULL;
bool fatal_throws = false;
}  // namespace

void CometSetReadContext(const CometReadDescriber* describer) { read_describer = describer; }
void CometSetReadContext(const std::string& context) {
  read_describer = NULL;
  ReadContext() = context;
}
std::string CometReadContext() {
  return read_describer ? read_describer->Describe() : ReadContext();
}
void CometSetFatalThrows(bool on) { fatal_throws = on; }

double CometMsSince(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

void CometFatal(const std::string& message) {
  if (fatal_throws) throw std::runtime_error(message);
  LOG(FATAL) << message;
}

std::string CometNum(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

namespace {
const char kLaterStart[] = ": a forward that begins after the layer that writes a blob finds "
                           "what the last pass left of it; begin at that layer or earlier "
                           "(net.forward() runs the whole net), or comet { ";

// A read of memory the plan said nobody reads now: `state` says what the memory is, `reads`
// how the reader came to it, `setting` what avoids it. Only a layer's read is the plan's to
// foresee; pycaffe's or a tool's, between passes or after the store is gone, is the reader's.
void FatalUnforeseenRead(const std::string& state, const char* reads,
                         const std::string& setting) {
  const std::string what = "COMET: " + state + ", and " + CometReadContext() + " " + reads;
  if (!read_describer) {  // no store runs the net now (its solver is gone, a tool, a test)
    CometFatal(what + "; the next forward (backward, for a diff) writes it again");
  } else if (!read_describer->InLayer()) {
    CometFatal(what + "; the next forward (backward, for a diff) writes it again, and comet { " +
               setting);
  } else if (read_describer->InForwardFromLater()) {
    CometFatal(what + kLaterStart + setting);
  } else {
    CometFatal(what + ". The plan did not foresee this read: report it with the net "
               "(docs/comet.md#layer-facts); comet { " + setting);
  }
}
}  // namespace

void* CometDenseFor(SyncedMemory* mem, const CometPayload& p) {
  CHECK_GE(mem->size(), p.dense_bytes()) << "COMET: blob " << p.name() << " shrank";
  // The decode writes every byte of a memory of exactly its size: upstream's zero fill of the
  // fresh buffer would be a second pass over it for nothing.
  CometFillWhole whole(mem->size() == p.dense_bytes() ? mem : NULL);
  return p.on_device() ? mem->mutable_gpu_data() : mem->mutable_cpu_data();
}

void CometFatalCorrupt(const std::string& blob, const std::string& error) {
  CometFatal("COMET: the compressed data of blob '" + blob + "' is corrupt (" + error +
             "), read by " + CometReadContext() + "; refusing to use it");
}

void CometRestore(SyncedMemory* mem) {
  const CometPayload& held = *mem->comet_payload();
  if (held.kind() == CometPayload::FILL) {
    // The writer the marker was set for: its allocation, which follows at once, is not zeroed.
    if (mem->head() == SyncedMemory::UNINITIALIZED) CometFillNext(mem);
    mem->comet_payload().reset();
    return;
  }
  if (held.kind() == CometPayload::RELEASED) {
    // The payload stays attached: every later read fails the same way until a forward writes it.
    FatalUnforeseenRead("the " + held.name() + " was freed after its last use in the training "
                        "step", "reads it",
                        (held.kept_by.empty() ? "release_unused: false release_diffs: false"
                                              : held.kept_by) + " } keeps such memory");
    return;
  }
  if (held.kind() == CometPayload::IN_FLIGHT) {
    FatalUnforeseenRead(held.name() + " is being decoded ahead for a later backward layer",
                        "reads it first", "decode_ahead: 0 } decodes on demand");
    return;
  }
  if (held.kind() == CometPayload::MASK) {
    const bool later = read_describer && read_describer->InForwardFromLater();
    CometFatal("COMET: blob '" + held.name() + "' is held only as the signs of its values (a "
               "ReLU mask) until the next forward, and " + CometReadContext() + " reads its "
               "values" + (later ? kLaterStart : "; comet { ") + "relu_masks: false } keeps them");
    return;
  }
  shared_ptr<CometPayload> p;
  p.swap(mem->comet_payload());  // detached first: the accesses below must not recurse
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  void* out = CometDenseFor(mem, *p);
  std::string error;
  if (!CometDecode(*p, out, &error)) {
    // What the failed decode left is not the blob's data: freed again, and the payload back on,
    // so that a reader who catches the error (pycaffe) and reads again fails the same way.
    mem->comet_release();
    mem->comet_payload() = p;
    CometFatalCorrupt(p->name(), error);
    return;
  }
  if (p->timing) p->timing->DecodedInStep(CometMsSince(start));  // the reader waited for it
}

#ifdef CPU_ONLY
// The device halves (payload_gpu.hpp) in a build without CUDA: never reached, since no payload
// is made on a device here.
void CometMaskPackGpu(const float*, size_t, uint32_t*, uint32_t*, bool*) { NO_GPU; }
void CometMaskDecodeGpu(const uint32_t*, size_t, float*, bool, uint32_t*) { NO_GPU; }
void CometCodesPackGpu(const int32_t*, size_t, int, bool, const comet_codes::PoolGeometry&,
                       const comet_codes::BinaryRule&, uint32_t*, uint32_t*, bool*) { NO_GPU; }
void CometCodesUnpackGpu(const uint32_t*, size_t, int, bool, const comet_codes::PoolGeometry&,
                         const comet_codes::BinaryRule&, int32_t*, uint32_t*, bool*) { NO_GPU; }
void CometReluBackwardGpu(const uint32_t*, size_t, const float*, float*, float, uint32_t*) {
  NO_GPU;
}
void CometPoolToCodesGpu(const float*, float*, size_t, int, const comet_codes::PoolGeometry&,
                         uint32_t*, uint32_t*, bool*) { NO_GPU; }
void CometPoolBackwardGpu(const uint32_t*, size_t, int, const comet_codes::PoolGeometry&,
                          const float*, float*, uint32_t*, bool*) { NO_GPU; }
int CometLossyEncodeGpu(const float*, const size_t*, int, double, CometPayload*) {
  NO_GPU;
  return SZ_ERR_CUDA;
}
int CometLossyDecodeGpu(const CometPayload&, float*) {
  NO_GPU;
  return SZ_ERR_CUDA;
}
void CometCopyToHost(void*, const void*, size_t) { NO_GPU; }
#endif

}  // namespace caffe
