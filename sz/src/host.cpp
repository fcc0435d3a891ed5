// host.cpp - CPU backend and the host half of the C API.
// Blocks are split into one contiguous range per thread; each thread quantizes, predicts and
// packs its blocks (the shared per-block code in blockpack.h) into a private buffer; a prefix
// sum over the thread totals places the pieces; the lossless stage runs on chunks.
#include "sz/sz.h"
#include "format.h"
#include "blockpack.h"
#include "lossless.h"
#include "blockpack_avx2.h"
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <atomic>
#include <memory>
#include <vector>
#include "parallel.h"

using namespace szi;

// The hot loops are compiled twice (AVX2 and baseline x86-64), the right one picked at load
// time. Same IEEE operations either way (no contraction, no fast-math), so the same stream.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(SZ_NO_CLONES)
#define SZ_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SZ_CLONES
#endif

namespace szi {
unsigned hardware_threads() {
  unsigned h = std::thread::hardware_concurrency();
  return h ? h : 1;
}

namespace {
std::atomic<sz_executor> g_executor{nullptr};
std::atomic<void*> g_executor_ctx{nullptr};
}  // namespace

Executor executor() { return Executor{g_executor.load(), g_executor_ctx.load()}; }
}  // namespace szi

namespace {

int pick_threads(int requested, uint64_t n) {
  int t = requested > 0 ? requested : (int)hardware_threads();
  uint64_t cap = n / 65536 + 1;  // small tensors are not worth a team
  if ((uint64_t)t > cap) t = (int)cap;
  return t < 1 ? 1 : t;
}

struct FreeDeleter { void operator()(void* p) const { free(p); } };
using Buf = std::unique_ptr<uint8_t, FreeDeleter>;

SZ_CLONES void minmax_range(const float* x, uint64_t lo_i, uint64_t hi_i, float* lo, float* hi) {
  float a = INFINITY, b = -INFINITY;
  for (uint64_t i = lo_i; i < hi_i; ++i) {
    float v = x[i];
    bool fin = fabsf(v) <= FLT_MAX;  // false for NaN and Inf
    a = fin && v < a ? v : a;
    b = fin && v > b ? v : b;
  }
  *lo = a;
  *hi = b;
}

void finite_range(const float* x, uint64_t n, int T, double* vmin, double* vmax, bool* any) {
  std::vector<float> lo((size_t)T), hi((size_t)T);
  parallel_run(T, [&](int t) {
    uint64_t a, b;
    share(n, t, T, &a, &b);
    minmax_range(x, a, b, &lo[t], &hi[t]);
  });
  float l = INFINITY, h = -INFINITY;
  for (int t = 0; t < T; ++t) { l = lo[t] < l ? lo[t] : l; h = hi[t] > h ? hi[t] : h; }
  *any = l <= h;
  *vmin = l;
  *vmax = h;
}

// Words [a, b), all of them whole: a loop without checksum_word's tail test, which vectorizes.
SZ_CLONES uint64_t checksum_whole_words(const uint8_t* p, uint64_t a, uint64_t b) {
  uint64_t s = 0;
  for (uint64_t i = a; i < b; ++i) s += checksum_term(i, load_u32le(p + 4 * i));
  return s;
}

uint64_t checksum_parallel(const uint8_t* p, uint64_t len, int T) {
  if (len < (1u << 20)) T = 1;
  const uint64_t nw = (len + 3) / 4, whole = len / 4;
  std::vector<uint64_t> part((size_t)T, 0);
  parallel_run(T, [&](int t) {
    uint64_t a, b;
    share(nw, t, T, &a, &b);
    uint64_t s = checksum_whole_words(p, a, b < whole ? b : whole);
    for (uint64_t i = a > whole ? a : whole; i < b; ++i) s += checksum_term(i, checksum_word(p, len, i));
    part[t] = s;
  });
  uint64_t s = 0;
  for (uint64_t v : part) s += v;
  return s;
}


#ifdef SZ_HAVE_AVX2_ENCODER
// SZ_NO_AVX2=1 in the environment keeps the generic loops (to compare them: same bytes, same
// values).
bool use_avx2() {
  static const bool use = avx2::cpu_has_avx2() && !getenv("SZ_NO_AVX2");
  return use;
}
#endif

// Blocks [b0, b1): kAvx2 takes full blocks through blockpack_avx2.h (instantiated only inside
// an AVX2 function); the last short block and blocks with a value the fast quantizer flags take
// encode_block. Same bytes either way.
template <bool kAvx2>
SZ_HD uint64_t encode_blocks(const float* in, uint64_t n, uint64_t b0, uint64_t b1, uint64_t W,
                             const QuantParams& qp, uint16_t* desc_full, uint8_t* mine) {
  uint64_t pos = 0;
  uint64_t row_pos = (b0 * kBlock) % W;
  for (uint64_t b = b0; b < b1; ++b) {
    uint16_t d;
    uint32_t size = 0;
    const float* x = in + b * kBlock;
    const int L = block_len(b, n);
    bool done = false;
#ifdef SZ_HAVE_AVX2_ENCODER
    if constexpr (kAvx2) done = L == kBlock && avx2::encode_block32(x, row_pos, W, qp, &d, mine + pos, &size);
#endif
    if (!done) size = encode_block(x, L, row_pos, W, qp, &d, mine + pos);
    pos += size;
    desc_full[b] = d;
    row_pos += kBlock;
    if (row_pos >= W) row_pos %= W;
  }
  return pos;
}

// Decodes blocks [b0, b1) of a validated payload (every descriptor passed desc_run, and the
// totals match). Returns false on a block whose data contradicts its descriptor. r = rank of
// block b0 among the flagged blocks; pos = offset of block b0's data. kAvx2 as above: full
// coded blocks through blockpack_avx2.h, the same values.
template <bool kAvx2>
SZ_HD bool decode_blocks(const uint8_t* flags, const uint8_t* descs, uint64_t r,
                         const uint8_t* data, uint64_t pos, uint64_t n, uint64_t b0, uint64_t b1,
                         uint64_t W, float two_eb, float* out) {
  uint64_t row_pos = (b0 * kBlock) % W;
  for (uint64_t b = b0; b < b1; ++b) {
    const int L = block_len(b, n);
    const uint16_t d = flag_bit(flags, b) ? load_u16le(descs + 2 * r++) : kDescZero;
    // pos + size <= data_len holds: sizes were validated and sum to data_len
    bool ok;
#ifdef SZ_HAVE_AVX2_ENCODER
    if constexpr (kAvx2) {
      ok = d != kDescZero && d != kDescRaw && L == kBlock
               ? avx2::decode_block32(data + pos, d, row_pos, W, two_eb, out + b * kBlock)
               : decode_block(data + pos, d, L, row_pos, W, two_eb, out + b * kBlock);
    } else
#endif
    {
      ok = decode_block(data + pos, d, L, row_pos, W, two_eb, out + b * kBlock);
    }
    if (!ok) return false;
    pos += block_data_size(d, L);
    row_pos += kBlock;
    if (row_pos >= W) row_pos %= W;
  }
  return true;
}

SZ_CLONES uint64_t encode_range_generic(const float* in, uint64_t n, uint64_t b0, uint64_t b1,
                                        uint64_t W, const QuantParams& qp, uint16_t* desc_full,
                                        uint8_t* mine) {
  return encode_blocks<false>(in, n, b0, b1, W, qp, desc_full, mine);
}

SZ_CLONES bool decode_range_generic(const uint8_t* flags, const uint8_t* descs, uint64_t r,
                                    const uint8_t* data, uint64_t pos, uint64_t n, uint64_t b0,
                                    uint64_t b1, uint64_t W, float two_eb, float* out) {
  return decode_blocks<false>(flags, descs, r, data, pos, n, b0, b1, W, two_eb, out);
}

#ifdef SZ_HAVE_AVX2_ENCODER
SZ_AVX2_TARGET uint64_t encode_range_avx2(const float* in, uint64_t n, uint64_t b0, uint64_t b1,
                                          uint64_t W, const QuantParams& qp, uint16_t* desc_full,
                                          uint8_t* mine) {
  return encode_blocks<true>(in, n, b0, b1, W, qp, desc_full, mine);
}

SZ_AVX2_TARGET bool decode_range_avx2(const uint8_t* flags, const uint8_t* descs, uint64_t r,
                                      const uint8_t* data, uint64_t pos, uint64_t n, uint64_t b0,
                                      uint64_t b1, uint64_t W, float two_eb, float* out) {
  return decode_blocks<true>(flags, descs, r, data, pos, n, b0, b1, W, two_eb, out);
}
#endif

uint64_t encode_range(const float* in, uint64_t n, uint64_t b0, uint64_t b1, uint64_t W,
                      const QuantParams& qp, uint16_t* desc_full, uint8_t* mine) {
#ifdef SZ_HAVE_AVX2_ENCODER
  if (use_avx2()) return encode_range_avx2(in, n, b0, b1, W, qp, desc_full, mine);
#endif
  return encode_range_generic(in, n, b0, b1, W, qp, desc_full, mine);
}

bool decode_range(const uint8_t* flags, const uint8_t* descs, uint64_t r, const uint8_t* data,
                  uint64_t pos, uint64_t n, uint64_t b0, uint64_t b1, uint64_t W, float two_eb,
                  float* out) {
#ifdef SZ_HAVE_AVX2_ENCODER
  if (use_avx2()) return decode_range_avx2(flags, descs, r, data, pos, n, b0, b1, W, two_eb, out);
#endif
  return decode_range_generic(flags, descs, r, data, pos, n, b0, b1, W, two_eb, out);
}

// Worker t of T gets whole flag bytes: blocks [b0, b1) in units of 8.
inline void share_blocks(uint64_t nb, int t, int T, uint64_t* b0, uint64_t* b1) {
  uint64_t u0, u1;
  share(div_up(nb, 8), t, T, &u0, &u1);
  *b0 = u0 * 8 < nb ? u0 * 8 : nb;
  *b1 = u1 * 8 < nb ? u1 * 8 : nb;
}

}  // namespace

extern "C" {

const char* sz_strerror(int status) {
  switch (status) {
    case SZ_OK: return "ok";
    case SZ_ERR_PARAM: return "invalid argument";
    case SZ_ERR_BUFFER: return "output buffer too small";
    case SZ_ERR_TRUNCATED: return "truncated stream";
    case SZ_ERR_FORMAT: return "not an sz stream or unknown format version";
    case SZ_ERR_CORRUPT: return "corrupt stream (checksum, length or offset mismatch)";
    case SZ_ERR_UNSUPPORTED: return "stream uses a feature this build or backend lacks";
    case SZ_ERR_NOMEM: return "out of host memory";
    case SZ_ERR_CUDA: return "CUDA error or library built without CUDA";
    case SZ_ERR_SCRATCH: return "device scratch buffer too small";
    case SZ_ERR_TRAILING: return "trailing bytes after the end of the stream";
    case SZ_ERR_EMPTY: return "empty input (0 bytes)";
    default: return "unknown sz status";
  }
}

void sz_set_executor(sz_executor run, void* ctx) {
  szi::g_executor_ctx.store(ctx);
  szi::g_executor.store(run);
}

const char* sz_version(void) { return "sz 1.0 (format 1)"; }

void sz_params_default(sz_params* p, double eb, int mode) {
  if (!p) return;
  p->eb = eb;
  p->mode = mode;
  p->lossless = zstd_available() ? SZ_LOSSLESS_ZSTD : SZ_LOSSLESS_NONE;
  p->zstd_level = 0;
  p->nthreads = 0;
}

size_t sz_compress_bound(size_t n_elems) {
  uint64_t raw = raw_len_bound(n_elems);
  uint64_t packed = zstd_packed_bound(raw, kDefaultChunk);
  return (size_t)(kHeaderSize + (packed > raw ? packed : raw));
}

int sz_restore_host(const float* in, size_t n, double eb, float* out) {
  if (n && (!in || !out)) return SZ_ERR_PARAM;
  const QuantParams qp = make_quant_params(eb_to_float(eb));
  for (size_t i = 0; i < n; ++i) {
    int32_t q;
    out[i] = quantize(in[i], qp, &q) ? recon(q, qp.two_eb) : in[i];
  }
  return SZ_OK;
}

int sz_compress_host(const float* in, const size_t* dims, int ndims, double eb, int mode,
                     void* out, size_t out_capacity, size_t* out_size) {
  sz_params p;
  sz_params_default(&p, eb, mode);
  return sz_compress_host_ex(in, dims, ndims, &p, out, out_capacity, out_size);
}

int sz_compress_host_ex(const float* in, const size_t* dims, int ndims, const sz_params* prm,
                        void* out_v, size_t cap, size_t* out_size) {
  if (!prm || !out_v || !out_size) return SZ_ERR_PARAM;
  if (prm->lossless != SZ_LOSSLESS_NONE && prm->lossless != SZ_LOSSLESS_ZSTD) return SZ_ERR_PARAM;
  Header h;
  int st = set_request(&h, dims, ndims, prm->eb, prm->mode);
  if (st) return st;
  const uint64_t n = h.n();
  if (n && !in) return SZ_ERR_PARAM;
  uint8_t* out = (uint8_t*)out_v;
  if (cap < kHeaderSize) return SZ_ERR_BUFFER;
  const int T = pick_threads(prm->nthreads, n);
  double eb_abs = prm->eb;
  if (prm->mode == SZ_EB_REL) {
    double lo, hi;
    bool any;
    finite_range(in, n, T, &lo, &hi, &any);
    eb_abs = rel_to_abs(prm->eb, lo, hi, any);
  }
  h.eb_abs = eb_to_float(eb_abs);
  const QuantParams qp = make_quant_params(h.eb_abs);
  const bool zstd = prm->lossless == SZ_LOSSLESS_ZSTD && zstd_available() && n > 0;
  h.lossless = zstd ? 1 : 0;
  h.chunk = zstd ? kDefaultChunk : 0;

  const uint64_t nb = h.nblocks(), W = n ? h.inner() : 1;
  // Raw payload: [block flags][descriptors of flagged blocks][block data]. Workers encode
  // whole flag bytes of blocks; worker 0 writes its data in place at the position it would
  // have if no block were zero (moved down once the count is known), the others into private
  // buffers that a prefix sum places behind it.
  const uint64_t fb = flag_bytes(nb);
  Buf raw_buf;
  uint8_t* base;
  if (!zstd) {
    if (cap - kHeaderSize < fb + 2 * nb) return SZ_ERR_BUFFER;
    base = out + kHeaderSize;
  } else {
    raw_buf.reset((uint8_t*)malloc(raw_len_bound(n)));  // pages are touched only as written
    if (!raw_buf) return SZ_ERR_NOMEM;
    base = raw_buf.get();
  }
  uint8_t* const provisional = base + fb + 2 * nb;
  const uint64_t room0 = zstd ? ~0ull : cap - kHeaderSize - fb - 2 * nb;
  std::vector<uint16_t> desc_full((size_t)nb);
  std::vector<uint64_t> tsize((size_t)T + 1, 0), tcount((size_t)T + 1, 0);
  std::vector<Buf> local((size_t)T);
  std::atomic<int> err{SZ_OK};
  bool in_place0 = false;
  // phase 1: encode
  parallel_run(T, [&](int t) {
    uint64_t b0, b1;
    share_blocks(nb, t, T, &b0, &b1);
    if (b1 == b0) return;
    uint8_t* dst;
    if (t == 0 && (b1 - b0) * kBlock * 4 <= room0) {
      dst = provisional;
      in_place0 = true;
    } else {
      dst = (uint8_t*)malloc((b1 - b0) * kBlock * 4);
      if (!dst) { err = SZ_ERR_NOMEM; return; }
      local[t].reset(dst);
    }
    tsize[t + 1] = encode_range(in, n, b0, b1, W, qp, desc_full.data(), dst);
    uint64_t c = 0;
    for (uint64_t b = b0; b < b1; ++b) c += desc_full[b] != kDescZero;
    tcount[t + 1] = c;
  });
  if (err != SZ_OK) return err;
  for (int t = 0; t < T; ++t) {
    tsize[t + 1] += tsize[t];
    tcount[t + 1] += tcount[t];
  }
  h.nzb = tcount[T];
  const uint64_t data_start = fb + 2 * h.nzb;
  const uint64_t raw_len = data_start + tsize[T];
  if (!zstd && cap - kHeaderSize < raw_len) return SZ_ERR_BUFFER;
  if (in_place0) memmove(base + data_start, provisional, tsize[1]);
  // phase 2: flags, compact descriptors, and the private pieces to their places
  parallel_run(T, [&](int t) {
    uint64_t b0, b1;
    share_blocks(nb, t, T, &b0, &b1);
    uint64_t r = tcount[t];
    for (uint64_t b = b0; b < b1; b += 8) {
      uint8_t f = 0;
      for (uint64_t i = b; i < b + 8 && i < b1; ++i) {
        uint16_t d = desc_full[i];
        if (d == kDescZero) continue;
        f |= (uint8_t)(1u << (i - b));
        store_u16le(base + fb + 2 * r++, d);
      }
      base[b >> 3] = f;
    }
    if (local[t]) memcpy(base + data_start + tsize[t], local[t].get(), tsize[t + 1] - tsize[t]);
  });
  local.clear();

  h.raw_len = raw_len;
  if (zstd) {
    uint64_t packed = 0;
    int level = prm->zstd_level != 0 ? prm->zstd_level : 1;  // negative: zstd fast levels
    st = zstd_pack(raw_buf.get(), raw_len, h.chunk, level, T, out + kHeaderSize,
                   cap - kHeaderSize, &packed);
    if (st) return st;
    h.payload_len = packed;
  } else {
    h.payload_len = raw_len;
  }
  h.payload_sum = checksum_parallel(out + kHeaderSize, h.payload_len, T);
  write_header(out, h);
  *out_size = (size_t)(kHeaderSize + h.payload_len);
  return SZ_OK;
}

static int header_info(const uint8_t* in, uint64_t avail, sz_header_info* info) {
  Header h;
  int st = parse_header(in, avail, &h);
  if (st) return st;
  info->version = kVersion;
  info->ndims = h.ndims;
  for (int i = 0; i < 4; ++i) info->dims[i] = h.dims[i];
  info->n_elems = h.n();
  info->mode = h.mode;
  info->eb_requested = h.eb_req;
  info->eb_abs = h.eb_abs;
  info->lossless = h.lossless;
  info->stream_size = kHeaderSize + h.payload_len;
  info->raw_payload_size = h.raw_len;
  return SZ_OK;
}

int sz_read_header(const void* in, size_t in_size, sz_header_info* info) {
  if (in_size == 0) return SZ_ERR_EMPTY;
  if (!in || !info) return SZ_ERR_PARAM;
  int st = header_info((const uint8_t*)in, in_size, info);
  if (st) return st;
  return info->stream_size == in_size ? SZ_OK : SZ_ERR_TRAILING;
}

int sz_peek_header(const void* header, size_t header_size, sz_header_info* info) {
  if (header_size == 0) return SZ_ERR_EMPTY;
  if (!header || !info) return SZ_ERR_PARAM;
  if (header_size < kHeaderSize) return header_info((const uint8_t*)header, header_size, info);
  // parse_header reads only the first kHeaderSize bytes; an unbounded size skips the length check
  return header_info((const uint8_t*)header, ~(uint64_t)0, info);
}

}  // extern "C"

namespace {

// The host decoder. prefix: the stream may be followed by other bytes (else they are an
// error); *consumed (may be null) gets the stream's size once the header is valid.
int decode_host(const void* in_v, size_t in_size, float* out, size_t out_elems, int nthreads,
                bool prefix, size_t* consumed) {
  if (in_size == 0) return SZ_ERR_EMPTY;
  if (!in_v) return SZ_ERR_PARAM;
  const uint8_t* in = (const uint8_t*)in_v;
  Header h;
  int st = parse_header(in, in_size, &h);
  if (st) return st;
  if (!prefix && in_size - kHeaderSize != h.payload_len) return SZ_ERR_TRAILING;
  if (consumed) *consumed = (size_t)(kHeaderSize + h.payload_len);
  const uint64_t n = h.n(), nb = h.nblocks(), W = n ? h.inner() : 1;
  if (out_elems < n) return SZ_ERR_BUFFER;
  if (n && !out) return SZ_ERR_PARAM;
  const int T = pick_threads(nthreads, n);
  const uint8_t* payload = in + kHeaderSize;
  if (checksum_parallel(payload, h.payload_len, T) != h.payload_sum) return SZ_ERR_CORRUPT;
  Buf raw_buf;
  const uint8_t* raw = payload;
  if (h.lossless == 1) {
    if (!zstd_available()) return SZ_ERR_UNSUPPORTED;
    raw_buf.reset((uint8_t*)malloc(h.raw_len ? h.raw_len : 1));
    if (!raw_buf) return SZ_ERR_NOMEM;
    st = zstd_unpack(payload, h.payload_len, h.raw_len, h.chunk, T, raw_buf.get());
    if (st) return st;
    raw = raw_buf.get();
  }
  const uint64_t fb = flag_bytes(nb);
  const uint8_t* flags = raw;
  const uint8_t* descs = raw + fb;
  const uint8_t* data = descs + 2 * h.nzb;  // parse_header checked raw_len >= fb + 2 nzb
  const uint64_t data_len = h.raw_len - fb - 2 * h.nzb;
  const float two_eb = make_quant_params(h.eb_abs).two_eb;
  const bool all_raw = eb_all_raw(h.eb_abs);  // no step: a legitimate stream has raw blocks only
  // flags: none past the last block, and exactly nzb set; rank of each worker's first block
  if (nb && !flag_word_ok(flag_word(flags, fb, (nb - 1) / 32), (nb - 1) / 32, nb)) return SZ_ERR_CORRUPT;
  std::vector<uint64_t> rank((size_t)T + 1, 0);
  {
    uint64_t c = 0, prev = 0;
    for (int t = 0; t < T; ++t) {
      uint64_t b0, b1;
      share_blocks(nb, t, T, &b0, &b1);
      for (uint64_t i = prev >> 3; i < (b0 >> 3); ++i) c += (uint64_t)popc32(flags[i]);
      rank[t] = c;
      prev = b0;
    }
    for (uint64_t i = prev >> 3; i < fb; ++i) c += (uint64_t)popc32(flags[i]);
    if (c != h.nzb) return SZ_ERR_CORRUPT;
    rank[T] = c;
  }
  const Tail tail = compact_tail(flags, nb, n, h.nzb);
  std::vector<Tally> part((size_t)T + 1, Tally{0, 0});
  std::atomic<int> err{SZ_OK};
  // phase 1: validate each worker's descriptors (compact order) and sum their data bytes
  parallel_run(T, [&](int t) {
    bool ok = true;
    part[t + 1] = desc_run(descs, rank[t], rank[t + 1], tail, true, all_raw, &ok, nullptr);
    if (!ok) err = SZ_ERR_CORRUPT;
  });
  if (err != SZ_OK) return err;
  for (int t = 0; t < T; ++t) part[t + 1] = part[t + 1] + part[t];
  if (!totals_ok(Tally{rank[T], part[T].bytes}, h.nzb, data_len)) return SZ_ERR_CORRUPT;
  // phase 2: decode; every block's bytes lie inside the payload
  parallel_run(T, [&](int t) {
    uint64_t b0, b1;
    share_blocks(nb, t, T, &b0, &b1);
    if (!decode_range(flags, descs, rank[t], data, part[t].bytes, n, b0, b1, W, two_eb, out))
      err = SZ_ERR_CORRUPT;
  });
  return err;
}

}  // namespace

extern "C" {

int sz_decompress_host(const void* in, size_t in_size, float* out, size_t out_elems) {
  return decode_host(in, in_size, out, out_elems, 0, false, nullptr);
}

int sz_decompress_host_ex(const void* in, size_t in_size, float* out, size_t out_elems,
                          int nthreads) {
  return decode_host(in, in_size, out, out_elems, nthreads, false, nullptr);
}

int sz_decompress_host_prefix(const void* in, size_t in_size, float* out, size_t out_elems,
                              int nthreads, size_t* consumed) {
  if (!consumed) return SZ_ERR_PARAM;
  size_t used = 0;
  int st = decode_host(in, in_size, out, out_elems, nthreads, true, &used);
  *consumed = st == SZ_OK ? used : 0;
  return st;
}

}  // extern "C"
