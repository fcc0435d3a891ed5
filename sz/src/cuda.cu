// cuda.cu - CUDA backend. Same stream format and the same per-block functions
// (quantizer.h, predictor.h, blockpack.h, format.h) as the CPU backend; what each thread does
// is in device_steps.h (run on the CPU by device_twin.h in the tests); this file only loads,
// stores, launches and scans. One thread per 32-value block (cuSZp-style independent blocks):
// the encoder chooses every block's descriptor once (plan), one exclusive scan of per-tile
// (blocks, bytes) pairs places them, and the write step packs each block at its place; the
// decoder validates, scans once and decodes. All memory comes from the caller: output,
// scratch, stream.
#include "sz/sz.h"
#include "format.h"
#include "blockpack.h"
#include "device_steps.h"
#include <cuda_runtime.h>
#include <cub/device/device_scan.cuh>
#include <cstdio>

using namespace szi;

namespace {

constexpr int kThreads = 128;  // threads per CUDA block in the per-block kernels

struct DevState {
  QuantParams qp;
  float eb_abs;
  unsigned int min_key, max_key;  // order-preserving keys of the finite min / max
  int error;                      // 0, an sz_status (< 0), or 1 (corrupt stream)
  unsigned int planned;           // kPlanned once the plan below is complete
  unsigned long long checksum;
  Tally total;                    // flagged blocks and data bytes of the plan
  Header request;                 // dims, mode and eb the plan was made for
};
constexpr size_t kStateBytes = 256;
constexpr unsigned int kPlanned = 0x504C414Eu;
static_assert(sizeof(DevState) <= kStateBytes, "state too large");

size_t align256(size_t v) { return (v + 255) & ~(size_t)255; }

size_t cub_temp_bytes(size_t items) {
  size_t t = 0;
  Tally* p = nullptr;
  cub::DeviceScan::ExclusiveScan(nullptr, t, p, p, TallySum(), Tally{0, 0},
                                 (int64_t)(items ? items : 1));
  return t;
}

// Scratch: the state, the encoder's plan (u16 descriptor per block), a u16 offset per block
// (encoder: inside its tile; decoder: per compact descriptor, inside its run of 32), a flag
// word per tile, a tally per tile before and after the scan, CUB's temporary storage.
struct Scratch {
  DevState* st;
  uint8_t* plan;
  uint16_t* offs;
  uint32_t* words;
  Tally* tiles;
  Tally* base;
  void* cub_tmp;
  size_t cub_bytes;
};

size_t scratch_layout(size_t n, void* base, Scratch* s) {
  const size_t nb = (size_t)div_up(n, kBlock), nw = (size_t)div_up(nb, 32), nw1 = nw ? nw : 1;
  const size_t a = kStateBytes, p = align256(2 * 32 * nw1), o = p, w = align256(4 * nw1);
  const size_t t = align256(sizeof(Tally) * nw1), c = cub_temp_bytes(nw);
  if (s) {
    char* q = (char*)base;
    s->st = (DevState*)q;
    s->plan = (uint8_t*)(q + a);
    s->offs = (uint16_t*)(q + a + p);
    s->words = (uint32_t*)(q + a + p + o);
    s->tiles = (Tally*)(q + a + p + o + w);
    s->base = (Tally*)(q + a + p + o + w + t);
    s->cub_tmp = q + a + p + o + w + 2 * t;
    s->cub_bytes = c;
  }
  return a + p + o + w + 2 * t + align256(c);
}

__device__ __forceinline__ unsigned int float_key(float f) {
  unsigned int u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned int k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// Copies one block to registers, with 16-byte loads when the block is aligned and full.
__device__ __forceinline__ void load_block(const float* x, uint64_t b, int L, float* v) {
  const float* p = x + b * kBlock;
  if (L == kBlock && ((uintptr_t)p & 15) == 0) {
    const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < kBlock / 4; ++i) {
      float4 f = __ldg(q + i);
      v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
  } else {
    for (int i = 0; i < L; ++i) v[i] = __ldg(p + i);
  }
}

__device__ __forceinline__ uint64_t thread_index() {
  return blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
}

__global__ void k_init(DevState* st, int mode, double eb) {
  st->min_key = 0xFFFFFFFFu;
  st->max_key = 0u;
  st->error = 0;
  st->planned = 0;
  st->checksum = 0ull;
  st->total = Tally{0, 0};
  if (mode == SZ_EB_ABS) {
    st->eb_abs = eb_to_float(eb);
    st->qp = make_quant_params(st->eb_abs);
  }
}

__global__ void k_minmax(const float* x, uint64_t n, DevState* st) {
  unsigned int lo = 0xFFFFFFFFu, hi = 0u;
  for (uint64_t i = thread_index(); i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    float v = x[i];
    if (fabsf(v) <= 3.402823466e38f) {
      unsigned int k = float_key(v);
      lo = min(lo, k);
      hi = max(hi, k);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xFFFFFFFFu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xFFFFFFFFu, hi, o));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMin(&st->min_key, lo);
    atomicMax(&st->max_key, hi);
  }
}

__global__ void k_set_rel(DevState* st, double rel) {
  bool any = st->min_key <= st->max_key;
  double lo = any ? (double)key_float(st->min_key) : 0.0;
  double hi = any ? (double)key_float(st->max_key) : 0.0;
  st->eb_abs = eb_to_float(rel_to_abs(rel, lo, hi, any));
  st->qp = make_quant_params(st->eb_abs);
}

// Encoder plan: descriptor per block.
__global__ void k_plan(const float* x, uint64_t n, uint64_t W, const DevState* st, uint8_t* plan) {
  const uint64_t nb = div_up(n, kBlock), b = thread_index();
  if (b >= nb) return;
  const int L = block_len(b, n);
  const QuantParams qp = st->qp;
  float v[kBlock];
  load_block(x, b, L, v);  // a literal 32 lets the compiler keep the block in registers
  if (L == kBlock) plan_step(v, kBlock, b, W, qp, plan);
  else plan_step(v, L, b, W, qp, plan);
}

// Encoder tiles: flag word, in-tile offsets and tally of each 32 blocks.
__global__ void k_plan_tiles(const uint8_t* plan, uint64_t n, uint16_t* offs, uint32_t* words,
                             Tally* tiles) {
  const uint64_t nb = div_up(n, kBlock), w = thread_index();
  if (w < div_up(nb, 32)) tiles[w] = plan_tile(plan, w, nb, n, offs, words);
}

__global__ void k_plan_done(const Tally* tiles, const Tally* base, uint64_t nw, Header request,
                            DevState* st) {
  st->total = nw ? base[nw - 1] + tiles[nw - 1] : Tally{0, 0};
  st->request = request;
  st->planned = kPlanned;
}

__device__ __forceinline__ bool same_request(const Header& a, const Header& b) {
  bool same = a.ndims == b.ndims && a.mode == b.mode && d2u(a.eb_req) == d2u(b.eb_req);
  for (int i = 0; i < 4; ++i) same = same && a.dims[i] == b.dims[i];
  return same;
}

// Before a write: the plan is complete, for this request, and the stream fits.
__global__ void k_write_begin(DevState* st, Header request, uint64_t fb, uint64_t cap) {
  st->checksum = 0ull;
  st->error = 0;
  if (st->planned != kPlanned || !same_request(st->request, request)) st->error = SZ_ERR_PARAM;
  else if (fb + 2 * st->total.count + st->total.bytes > cap) st->error = SZ_ERR_BUFFER;
}

// Encoder write: flags, descriptor at its rank, data at its offset.
__global__ void k_write(const float* x, uint64_t n, uint64_t W, const DevState* st,
                        const uint8_t* plan, const uint16_t* offs, const uint32_t* words,
                        const Tally* base, uint8_t* payload) {
  const uint64_t nb = div_up(n, kBlock), b = thread_index();
  if (b >= nb || st->error) return;
  uint8_t* data = nullptr;
  const uint16_t d = write_place(plan, offs, words, base, b, nb, st->total.count, payload, &data);
  if (d == kDescZero) return;
  const int L = block_len(b, n);
  const QuantParams qp = st->qp;
  float v[kBlock];
  load_block(x, b, L, v);
  if (L == kBlock) pack_block(v, kBlock, (b * kBlock) % W, W, qp, d, data);
  else pack_block(v, L, (b * kBlock) % W, W, qp, d, data);
}

// Sum of checksum terms over len bytes at p; with st_len, len = fb + 2 nzb + data bytes.
__global__ void k_checksum(const uint8_t* p, uint64_t len, bool st_len, uint64_t fb, DevState* st) {
  if (st_len) {
    if (st->error) return;  // lengths may exceed the buffer: nothing valid to sum
    len = fb + 2 * st->total.count + st->total.bytes;
  }
  uint64_t nw = (len + 3) / 4;
  unsigned long long s = 0;
  for (uint64_t i = thread_index(); i < nw; i += (uint64_t)gridDim.x * blockDim.x)
    s += checksum_term(i, checksum_word(p, len, i));
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
  if ((threadIdx.x & 31) == 0 && s) atomicAdd(&st->checksum, s);
}

__global__ void k_header(uint8_t* out, Header h, DevState* st, uint64_t fb) {
  h.eb_abs = st->eb_abs;
  h.nzb = st->total.count;
  h.raw_len = fb + 2 * st->total.count + st->total.bytes;
  h.payload_len = h.raw_len;
  h.payload_sum = st->checksum;
  write_header(out, h);
}

// Decoder tiles: flag word i and compact descriptors [32i, 32i + 32).
__global__ void k_dec_tiles(const uint8_t* flags, uint64_t nb, uint64_t n, const uint8_t* descs,
                            uint64_t nzb, bool all_raw, uint16_t* offs, Tally* tiles, DevState* st) {
  const uint64_t i = thread_index();
  if (i >= div_up(nb, 32)) return;
  if (!decode_tile(flags, nb, n, descs, nzb, all_raw, i, offs, &tiles[i])) st->error = 1;
}

__global__ void k_dec_total(const Tally* tiles, const Tally* base, uint64_t nw, uint64_t nzb,
                            uint64_t data_len, DevState* st) {
  if (!decode_totals(base[nw - 1], tiles[nw - 1], nzb, data_len)) st->error = 1;
}

__global__ void k_decode(const uint8_t* flags, uint64_t nb, const uint8_t* descs,
                         const uint8_t* data, uint64_t n, uint64_t W, float two_eb,
                         const uint16_t* offs, const Tally* base, float* y, DevState* st) {
  const uint64_t b = thread_index();
  if (b >= nb || st->error) return;  // nothing is decoded from a payload that failed a check
  uint64_t off;
  const uint16_t d = decode_place(flags, nb, descs, offs, base, b, &off);
  const int L = block_len(b, n);
  float v[kBlock];
  bool ok = L == kBlock ? decode_block(data + off, d, kBlock, (b * kBlock) % W, W, two_eb, v)
                        : decode_block(data + off, d, L, (b * kBlock) % W, W, two_eb, v);
  if (!ok) {
    st->error = 1;
    return;
  }
  float* o = y + b * kBlock;
  if (L == kBlock && ((uintptr_t)o & 15) == 0) {
    float4* o4 = reinterpret_cast<float4*>(o);
#pragma unroll
    for (int i = 0; i < kBlock / 4; ++i) o4[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  } else {
    for (int i = 0; i < L; ++i) o[i] = v[i];
  }
}

unsigned grid_for(uint64_t items, int threads) {
  uint64_t g = (items + threads - 1) / threads;
  return (unsigned)(g ? g : 1);
}

}  // namespace

// The thread's last CUDA failure, for sz_cuda_error().
static thread_local char g_cuda_error[256] = "";

static int cuda_fail(cudaError_t e, const char* what) {
  std::snprintf(g_cuda_error, sizeof(g_cuda_error), "%s (%s) in %s", cudaGetErrorName(e),
                cudaGetErrorString(e), what);
  return SZ_ERR_CUDA;
}

// An error left pending by an earlier call (another library's kernel) would otherwise surface
// at our first cudaGetLastError and be blamed on us: report it as what it is.
static int cuda_check_pending() {
  g_cuda_error[0] = 0;
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? SZ_OK : cuda_fail(e, "an earlier call (pending before sz's)");
}

#define SZ_CU(call)                                     \
  do {                                                  \
    const cudaError_t sz_e_ = (call);                   \
    if (sz_e_ != cudaSuccess) return cuda_fail(sz_e_, #call); \
  } while (0)

extern "C" {

int sz_has_cuda(void) { return 1; }

const char* sz_cuda_error(void) { return g_cuda_error; }

size_t sz_device_scratch_size(size_t n_elems) { return scratch_layout(n_elems, nullptr, nullptr); }

}  // extern "C"

namespace {

// A compress call's checks (the same as the host's, set_request) and its scratch.
int device_request(const float* d_in, const size_t* dims, int ndims, double eb, int mode,
                   void* d_scratch, size_t scratch_size, Header* h, Scratch* sc) {
  int st = set_request(h, dims, ndims, eb, mode);
  if (st) return st;
  if (h->n() && !d_in) return SZ_ERR_PARAM;
  if (cuda_check_pending() != SZ_OK) return SZ_ERR_CUDA;
  if (!d_scratch || scratch_size < sz_device_scratch_size(h->n())) return SZ_ERR_SCRATCH;
  scratch_layout(h->n(), d_scratch, sc);
  return SZ_OK;
}

// Enqueues the plan: bound, descriptors, one scan; the totals land in the state.
int enqueue_plan(const float* d_in, const Header& h, const Scratch& sc, cudaStream_t s) {
  const uint64_t n = h.n(), nb = h.nblocks(), nw = div_up(nb, 32), W = n ? h.inner() : 1;
  k_init<<<1, 1, 0, s>>>(sc.st, h.mode, h.eb_req);
  if (h.mode == SZ_EB_REL) {
    if (n) k_minmax<<<grid_for(n / 8 + 1, 256) < 2048 ? grid_for(n / 8 + 1, 256) : 2048, 256, 0, s>>>(d_in, n, sc.st);
    k_set_rel<<<1, 1, 0, s>>>(sc.st, h.eb_req);
  }
  if (nb) {
    k_plan<<<grid_for(nb, kThreads), kThreads, 0, s>>>(d_in, n, W, sc.st, sc.plan);
    k_plan_tiles<<<grid_for(nw, 256), 256, 0, s>>>(sc.plan, n, sc.offs, sc.words, sc.tiles);
    size_t tb = sc.cub_bytes;
    SZ_CU(cub::DeviceScan::ExclusiveScan(sc.cub_tmp, tb, sc.tiles, sc.base, TallySum(), Tally{0, 0},
                                         (int64_t)nw, s));
  }
  k_plan_done<<<1, 1, 0, s>>>(sc.tiles, sc.base, nw, h, sc.st);
  SZ_CU(cudaGetLastError());
  return SZ_OK;
}

// Enqueues the write of a planned stream into out (cap bytes, at least the header and flags).
int enqueue_write(const float* d_in, const Header& h, const Scratch& sc, uint8_t* out, size_t cap,
                  cudaStream_t s) {
  const uint64_t n = h.n(), nb = h.nblocks(), fb = flag_bytes(nb), W = n ? h.inner() : 1;
  uint8_t* payload = out + kHeaderSize;
  k_write_begin<<<1, 1, 0, s>>>(sc.st, h, fb, cap - kHeaderSize);
  if (nb)
    k_write<<<grid_for(nb, kThreads), kThreads, 0, s>>>(d_in, n, W, sc.st, sc.plan, sc.offs,
                                                        sc.words, sc.base, payload);
  k_checksum<<<1024, 256, 0, s>>>(payload, 0, true, fb, sc.st);
  k_header<<<1, 1, 0, s>>>(out, h, sc.st, fb);
  SZ_CU(cudaGetLastError());
  return SZ_OK;
}

// Waits for the stream; returns the state's error and, when there is none, the stream size.
int finish(const Scratch& sc, uint64_t fb, cudaStream_t s, size_t* size) {
  struct { int error; Tally total; } res;
  SZ_CU(cudaMemcpyAsync(&res.error, &sc.st->error, sizeof(int), cudaMemcpyDeviceToHost, s));
  SZ_CU(cudaMemcpyAsync(&res.total, &sc.st->total, sizeof(Tally), cudaMemcpyDeviceToHost, s));
  SZ_CU(cudaStreamSynchronize(s));
  if (res.error) return res.error < 0 ? res.error : SZ_ERR_CUDA;
  *size = (size_t)(kHeaderSize + fb + 2 * res.total.count + res.total.bytes);
  return SZ_OK;
}

// The three compress entry points: plan and/or write, then wait for the size or the error.
int device_compress(bool plan, bool write, const float* d_in, const size_t* dims, int ndims,
                    double eb, int mode, void* d_out, size_t cap, size_t* size, void* d_scratch,
                    size_t scratch_size, void* stream_v) {
  if (!size || (write && !d_out)) return SZ_ERR_PARAM;
  Header h;
  Scratch sc;
  int st = device_request(d_in, dims, ndims, eb, mode, d_scratch, scratch_size, &h, &sc);
  if (st) return st;
  const uint64_t fb = flag_bytes(h.nblocks());
  if (write && cap < kHeaderSize + fb) return SZ_ERR_BUFFER;
  cudaStream_t s = (cudaStream_t)stream_v;
  if (plan && (st = enqueue_plan(d_in, h, sc, s)) != SZ_OK) return st;
  if (write && (st = enqueue_write(d_in, h, sc, (uint8_t*)d_out, cap, s)) != SZ_OK) return st;
  return finish(sc, fb, s, size);
}

}  // namespace

extern "C" {

int sz_compress_device(const float* d_in, const size_t* dims, int ndims, double eb, int mode,
                       void* d_out, size_t out_capacity, size_t* out_size, void* d_scratch,
                       size_t scratch_size, void* stream_v) {
  return device_compress(true, true, d_in, dims, ndims, eb, mode, d_out, out_capacity, out_size,
                         d_scratch, scratch_size, stream_v);
}

int sz_compress_device_plan(const float* d_in, const size_t* dims, int ndims, double eb, int mode,
                            void* d_scratch, size_t scratch_size, size_t* stream_size,
                            void* stream_v) {
  return device_compress(true, false, d_in, dims, ndims, eb, mode, nullptr, 0, stream_size,
                         d_scratch, scratch_size, stream_v);
}

int sz_compress_device_write(const float* d_in, const size_t* dims, int ndims, double eb, int mode,
                             void* d_out, size_t out_capacity, size_t* out_size, void* d_scratch,
                             size_t scratch_size, void* stream_v) {
  return device_compress(false, true, d_in, dims, ndims, eb, mode, d_out, out_capacity, out_size,
                         d_scratch, scratch_size, stream_v);
}

int sz_decompress_device(const void* d_in, size_t in_size, float* d_out, size_t out_elems,
                         void* d_scratch, size_t scratch_size, void* stream_v) {
  if (in_size == 0) return SZ_ERR_EMPTY;
  if (!d_in) return SZ_ERR_PARAM;
  if (cuda_check_pending() != SZ_OK) return SZ_ERR_CUDA;
  cudaStream_t s = (cudaStream_t)stream_v;
  uint8_t hb[kHeaderSize];
  size_t hlen = in_size < kHeaderSize ? in_size : kHeaderSize;
  if (hlen) {
    SZ_CU(cudaMemcpyAsync(hb, d_in, hlen, cudaMemcpyDeviceToHost, s));
    SZ_CU(cudaStreamSynchronize(s));
  }
  Header h;
  int st = device_read_header(hb, in_size, out_elems, &h);  // as on the host
  if (st) return st;
  const uint64_t n = h.n(), nb = h.nblocks(), nw = div_up(nb, 32), fb = flag_bytes(nb);
  const uint64_t W = n ? h.inner() : 1;
  if (n && !d_out) return SZ_ERR_PARAM;
  if (!d_scratch || scratch_size < sz_device_scratch_size(n)) return SZ_ERR_SCRATCH;
  Scratch sc;
  scratch_layout(n, d_scratch, &sc);
  const uint8_t* flags = (const uint8_t*)d_in + kHeaderSize;
  const uint8_t* descs = flags + fb;
  const uint8_t* data = descs + 2 * h.nzb;  // parse_header checked raw_len >= fb + 2 nzb
  const uint64_t data_len = h.raw_len - fb - 2 * h.nzb;
  k_init<<<1, 1, 0, s>>>(sc.st, SZ_EB_REL, 0.0);
  k_checksum<<<1024, 256, 0, s>>>(flags, h.payload_len, false, 0, sc.st);
  if (nb) {
    k_dec_tiles<<<grid_for(nw, 256), 256, 0, s>>>(flags, nb, n, descs, h.nzb, eb_all_raw(h.eb_abs),
                                                  sc.offs, sc.tiles, sc.st);
    size_t tb = sc.cub_bytes;
    SZ_CU(cub::DeviceScan::ExclusiveScan(sc.cub_tmp, tb, sc.tiles, sc.base, TallySum(), Tally{0, 0},
                                         (int64_t)nw, s));
    k_dec_total<<<1, 1, 0, s>>>(sc.tiles, sc.base, nw, h.nzb, data_len, sc.st);
    const float two_eb = make_quant_params(h.eb_abs).two_eb;
    k_decode<<<grid_for(nb, kThreads), kThreads, 0, s>>>(flags, nb, descs, data, n, W, two_eb,
                                                         sc.offs, sc.base, d_out, sc.st);
  }
  SZ_CU(cudaGetLastError());
  struct { int error; unsigned long long checksum; } res;
  SZ_CU(cudaMemcpyAsync(&res.error, &sc.st->error, sizeof(int), cudaMemcpyDeviceToHost, s));
  SZ_CU(cudaMemcpyAsync(&res.checksum, &sc.st->checksum, 8, cudaMemcpyDeviceToHost, s));
  SZ_CU(cudaStreamSynchronize(s));
  if (res.checksum != h.payload_sum || res.error) return SZ_ERR_CORRUPT;
  return SZ_OK;
}

}  // extern "C"
