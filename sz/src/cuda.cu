// cuda.cu - CUDA backend. Same stream format and the same per-block functions
// (quantizer.h, predictor.h, blockpack.h, format.h) as the CPU backend; only loading,
// scheduling and the prefix sums are device-specific. One thread encodes one 32-value block
// (cuSZp-style independent blocks); a warp's 32 block flags are one ballot; the global steps
// are two exclusive scans (CUB): block sizes, and flag counts per 32 blocks. All memory comes
// from the caller: output, scratch, stream.
#include "sz/sz.h"
#include "format.h"
#include "blockpack.h"
#include <cuda_runtime.h>
#include <cub/device/device_scan.cuh>
#include <cstdio>

using namespace szi;

namespace {

constexpr int kThreads = 128;  // a multiple of 32: warp w encodes blocks 32w..32w+31

struct DevState {
  QuantParams qp;
  float eb_abs;
  unsigned int min_key, max_key;  // order-preserving keys of the finite min / max
  int error;
  unsigned long long checksum;
  unsigned long long data_len;    // total block data bytes
  unsigned long long nzb;         // flagged (nonzero) blocks
  unsigned long long pad[8];
};
constexpr size_t kStateBytes = 256;
static_assert(sizeof(DevState) <= kStateBytes, "state too large");

size_t align256(size_t v) { return (v + 255) & ~(size_t)255; }

size_t cub_temp_bytes(size_t items) {
  size_t t = 0;
  unsigned long long* p = nullptr;
  cub::DeviceScan::ExclusiveSum(nullptr, t, p, p, (int64_t)(items ? items : 1));
  return t;
}

struct Scratch {
  DevState* st;
  unsigned long long* sizes;  // per block
  unsigned long long* offs;   // per block
  unsigned long long* wcnt;   // flags set per 32 blocks
  unsigned long long* wrank;  // flags set before each 32 blocks
  void* cub_tmp;
  size_t cub_bytes;
};

size_t scratch_layout(size_t n, void* base, Scratch* s) {
  size_t nb = (size_t)div_up(n, kBlock), nw = (size_t)div_up(nb, 32);
  size_t a = kStateBytes, b = align256(8 * (nb ? nb : 1)), w = align256(8 * (nw ? nw : 1));
  size_t c1 = cub_temp_bytes(nb), c2 = cub_temp_bytes(nw), c = c1 > c2 ? c1 : c2;
  if (s) {
    char* p = (char*)base;
    s->st = (DevState*)p;
    s->sizes = (unsigned long long*)(p + a);
    s->offs = (unsigned long long*)(p + a + b);
    s->wcnt = (unsigned long long*)(p + a + 2 * b);
    s->wrank = (unsigned long long*)(p + a + 2 * b + w);
    s->cub_tmp = p + a + 2 * b + 2 * w;
    s->cub_bytes = c;
  }
  return a + 2 * b + 2 * w + align256(c);
}

__device__ __forceinline__ unsigned int float_key(float f) {
  unsigned int u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned int k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

__device__ __forceinline__ int block_len(uint64_t b, uint64_t n) {
  uint64_t first = b * kBlock;
  return (int)(n - first < (uint64_t)kBlock ? n - first : kBlock);
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

// Encodes block b (b < nb) with the shared per-block code; a literal 32 lets the compiler
// unroll everything and keep the block in registers.
__device__ __forceinline__ uint32_t encode_one(const float* x, uint64_t b, uint64_t n, uint64_t W,
                                               const QuantParams& qp, uint16_t* d, uint8_t* out) {
  int L = block_len(b, n);
  float v[kBlock];
  load_block(x, b, L, v);
  return L == kBlock ? encode_block(v, kBlock, (b * kBlock) % W, W, qp, d, out)
                     : encode_block(v, L, (b * kBlock) % W, W, qp, d, out);
}

__global__ void k_init(DevState* st, int mode, double eb) {
  st->min_key = 0xFFFFFFFFu;
  st->max_key = 0u;
  st->error = 0;
  st->checksum = 0ull;
  st->data_len = 0ull;
  st->nzb = 0ull;
  if (mode == SZ_EB_ABS) {
    st->eb_abs = eb_to_float(eb);
    st->qp = make_quant_params(st->eb_abs);
  }
}

__global__ void k_minmax(const float* x, uint64_t n, DevState* st) {
  unsigned int lo = 0xFFFFFFFFu, hi = 0u;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x) {
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

// Pass 1: sizes per block, flags (one ballot per 32 blocks) and flag counts per 32 blocks.
__global__ void k_encode_sizes(const float* x, uint64_t n, uint64_t W, const DevState* st,
                               uint8_t* flags, uint64_t fb, unsigned long long* sizes,
                               unsigned long long* wcnt) {
  const uint64_t nb = div_up(n, kBlock);
  const uint64_t b = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  const uint64_t w = b / 32;
  if (w * 32 >= nb) return;  // whole warp past the end
  uint16_t d = kDescZero;
  if (b < nb) {
    QuantParams qp = st->qp;
    sizes[b] = encode_one(x, b, n, W, qp, &d, nullptr);
  }
  uint32_t word = __ballot_sync(0xFFFFFFFFu, d != kDescZero);
  if ((threadIdx.x & 31) == 0) {
    wcnt[w] = (unsigned long long)__popc(word);
    for (uint64_t i = 0; i < 4; ++i)
      if (4 * w + i < fb) flags[4 * w + i] = (uint8_t)(word >> (8 * i));
  }
}

__global__ void k_total(uint64_t nb, uint64_t nw, const unsigned long long* sizes,
                        const unsigned long long* offs, const unsigned long long* wcnt,
                        const unsigned long long* wrank, uint64_t fb, uint64_t cap,
                        DevState* st) {
  unsigned long long t = nb ? offs[nb - 1] + sizes[nb - 1] : 0ull;
  unsigned long long z = nw ? wrank[nw - 1] + wcnt[nw - 1] : 0ull;
  st->data_len = t;
  st->nzb = z;
  if (fb + 2 * z + t > cap) st->error = SZ_ERR_BUFFER;
}

// Pass 2: descriptors of flagged blocks at their rank, data at their offset.
__global__ void k_encode_write(const float* x, uint64_t n, uint64_t W, const DevState* st,
                               uint8_t* base, uint64_t fb, const unsigned long long* offs,
                               const unsigned long long* wrank) {
  const uint64_t nb = div_up(n, kBlock);
  const uint64_t b = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  const uint64_t w = b / 32;
  if (w * 32 >= nb || st->error) return;  // uniform per warp
  uint8_t* data = base + fb + 2 * st->nzb;
  uint16_t d = kDescZero;
  if (b < nb) {
    QuantParams qp = st->qp;
    encode_one(x, b, n, W, qp, &d, data + offs[b]);
  }
  uint32_t word = __ballot_sync(0xFFFFFFFFu, d != kDescZero);
  if (d != kDescZero) {
    uint64_t rank = wrank[w] + (uint64_t)__popc(word & ((1u << (threadIdx.x & 31)) - 1u));
    store_u16le(base + fb + 2 * rank, d);
  }
}

// Sum of checksum terms over len bytes at p; with st_len, len = fb + 2 nzb + data_len.
__global__ void k_checksum(const uint8_t* p, uint64_t len, bool st_len, uint64_t fb, DevState* st) {
  if (st_len) {
    if (st->error) return;  // lengths may exceed the buffer: nothing valid to sum
    len = fb + 2 * st->nzb + st->data_len;
  }
  uint64_t nw = (len + 3) / 4;
  unsigned long long s = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < nw;
       i += (uint64_t)gridDim.x * blockDim.x)
    s += checksum_term(i, checksum_word(p, len, i));
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
  if ((threadIdx.x & 31) == 0 && s) atomicAdd(&st->checksum, s);
}

__global__ void k_header(uint8_t* out, Header h, DevState* st, uint64_t fb) {
  h.eb_abs = st->eb_abs;
  h.nzb = st->nzb;
  h.raw_len = fb + 2 * st->nzb + st->data_len;
  h.payload_len = h.raw_len;
  h.payload_sum = st->checksum;
  write_header(out, h);
}

// Decoder: flag counts per 32 blocks; no flag past the last block.
__global__ void k_flag_counts(const uint8_t* flags, uint64_t fb, uint64_t nb,
                              unsigned long long* wcnt, DevState* st) {
  const uint64_t nw = div_up(nb, 32);
  const uint64_t w = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  if (w >= nw) return;
  uint32_t word = flag_word(flags, fb, w);
  uint64_t valid = nb - 32 * w;  // blocks in this word
  if (valid < 32 && (word >> valid) != 0) st->error = 1;
  wcnt[w] = (unsigned long long)__popc(word);
}

// Descriptor of block b from the flags and the compact array; 0xFFFFFFFF when inconsistent.
__device__ __forceinline__ uint32_t desc_of(const uint8_t* flags, uint64_t fb, const uint8_t* descs,
                                            uint64_t nzb, const unsigned long long* wrank,
                                            uint64_t b) {
  const uint64_t w = b / 32;
  uint32_t word = flag_word(flags, fb, w);
  uint32_t lane = (uint32_t)(b & 31);
  if (!((word >> lane) & 1u)) return kDescZero;
  uint64_t rank = wrank[w] + (uint64_t)__popc(word & ((1u << lane) - 1u));
  if (rank >= nzb) return 0xFFFFFFFFu;
  uint16_t d = load_u16le(descs + 2 * rank);
  return d == kDescZero ? 0xFFFFFFFFu : d;
}

__global__ void k_desc_sizes(const uint8_t* flags, uint64_t fb, const uint8_t* descs, uint64_t nzb,
                             uint64_t n, const unsigned long long* wcnt,
                             const unsigned long long* wrank, unsigned long long* sizes,
                             bool all_raw, DevState* st) {
  const uint64_t nb = div_up(n, kBlock), nw = div_up(nb, 32);
  const uint64_t b = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  if (b >= nb) return;
  if (b == 0 && wrank[nw - 1] + wcnt[nw - 1] != nzb) st->error = 1;
  uint32_t d = desc_of(flags, fb, descs, nzb, wrank, b);
  uint32_t s = d > 0xFFFFu ? kBadSize : block_data_size((uint16_t)d, block_len(b, n));
  // all_raw: the bound admits no quantization step, so the encoder stored every block verbatim
  if (s == kBadSize || (all_raw && d != kDescRaw)) { st->error = 1; s = 0; }
  sizes[b] = s;
}

__global__ void k_decode(const uint8_t* flags, uint64_t fb, const uint8_t* descs, uint64_t nzb,
                         const uint8_t* data, uint64_t data_len, uint64_t n, uint64_t W,
                         float two_eb, const unsigned long long* wrank,
                         const unsigned long long* sizes, const unsigned long long* offs,
                         float* y, DevState* st) {
  const uint64_t nb = div_up(n, kBlock);
  const uint64_t b = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  if (b >= nb) return;
  if (b == nb - 1 && offs[b] + sizes[b] != data_len) st->error = 1;
  if (offs[b] > data_len || sizes[b] > data_len - offs[b]) { st->error = 1; return; }
  uint32_t d32 = desc_of(flags, fb, descs, nzb, wrank, b);
  int L = block_len(b, n);
  if (d32 > 0xFFFFu || block_data_size((uint16_t)d32, L) != sizes[b]) { st->error = 1; return; }
  const uint16_t d = (uint16_t)d32;
  float v[kBlock];
  bool ok = L == kBlock ? decode_block(data + offs[b], d, kBlock, (b * kBlock) % W, W, two_eb, v)
                        : decode_block(data + offs[b], d, L, (b * kBlock) % W, W, two_eb, v);
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

int sz_compress_device(const float* d_in, const size_t* dims, int ndims, double eb, int mode,
                       void* d_out, size_t out_capacity, size_t* out_size, void* d_scratch,
                       size_t scratch_size, void* stream_v) {
  if (!dims || ndims < 1 || ndims > 4 || !d_out || !out_size) return SZ_ERR_PARAM;
  if (!(eb > 0.0) || !(eb < INFINITY) || (mode != SZ_EB_ABS && mode != SZ_EB_REL)) return SZ_ERR_PARAM;
  if (cuda_check_pending() != SZ_OK) return SZ_ERR_CUDA;
  Header h;
  h.ndims = (uint8_t)ndims;
  uint64_t n = 1;
  bool zero = false;
  for (int i = 0; i < ndims; ++i) {
    h.dims[i] = dims[i];
    if (dims[i] == 0) zero = true;
    else if (!zero) {
      if (dims[i] > kMaxElems || n * dims[i] > kMaxElems) return SZ_ERR_PARAM;
      n *= dims[i];
    }
  }
  if (zero) n = 0;
  if (n && !d_in) return SZ_ERR_PARAM;
  if (!d_scratch || scratch_size < sz_device_scratch_size(n)) return SZ_ERR_SCRATCH;
  const uint64_t nb = div_up(n, kBlock), nw = div_up(nb, 32), fb = flag_bytes(nb);
  const uint64_t W = n ? h.inner() : 1;
  if (out_capacity < kHeaderSize + fb) return SZ_ERR_BUFFER;
  cudaStream_t s = (cudaStream_t)stream_v;
  Scratch sc;
  scratch_layout(n, d_scratch, &sc);
  h.mode = (uint8_t)mode;
  h.eb_req = eb;
  h.lossless = 0;
  h.chunk = 0;
  uint8_t* out = (uint8_t*)d_out;
  uint8_t* base = out + kHeaderSize;

  k_init<<<1, 1, 0, s>>>(sc.st, mode, eb);
  if (mode == SZ_EB_REL) {
    if (n) k_minmax<<<grid_for(n / 8 + 1, 256) < 2048 ? grid_for(n / 8 + 1, 256) : 2048, 256, 0, s>>>(d_in, n, sc.st);
    k_set_rel<<<1, 1, 0, s>>>(sc.st, eb);
  }
  if (nb) {
    k_encode_sizes<<<grid_for(nb, kThreads), kThreads, 0, s>>>(d_in, n, W, sc.st, base, fb,
                                                               sc.sizes, sc.wcnt);
    size_t tb = sc.cub_bytes;
    SZ_CU(cub::DeviceScan::ExclusiveSum(sc.cub_tmp, tb, sc.sizes, sc.offs, (int64_t)nb, s));
    tb = sc.cub_bytes;
    SZ_CU(cub::DeviceScan::ExclusiveSum(sc.cub_tmp, tb, sc.wcnt, sc.wrank, (int64_t)nw, s));
    k_total<<<1, 1, 0, s>>>(nb, nw, sc.sizes, sc.offs, sc.wcnt, sc.wrank, fb,
                            out_capacity - kHeaderSize, sc.st);
    k_encode_write<<<grid_for(nb, kThreads), kThreads, 0, s>>>(d_in, n, W, sc.st, base, fb,
                                                               sc.offs, sc.wrank);
  }
  k_checksum<<<1024, 256, 0, s>>>(base, 0, true, fb, sc.st);
  k_header<<<1, 1, 0, s>>>(out, h, sc.st, fb);
  SZ_CU(cudaGetLastError());
  struct { int error; unsigned long long data_len, nzb; } res;
  SZ_CU(cudaMemcpyAsync(&res.error, &sc.st->error, sizeof(int), cudaMemcpyDeviceToHost, s));
  SZ_CU(cudaMemcpyAsync(&res.data_len, &sc.st->data_len, 8, cudaMemcpyDeviceToHost, s));
  SZ_CU(cudaMemcpyAsync(&res.nzb, &sc.st->nzb, 8, cudaMemcpyDeviceToHost, s));
  SZ_CU(cudaStreamSynchronize(s));
  if (res.error) return res.error < 0 ? res.error : SZ_ERR_CUDA;
  *out_size = (size_t)(kHeaderSize + fb + 2 * res.nzb + res.data_len);
  return SZ_OK;
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
  int st = parse_header(hb, in_size, &h);  // bound, lengths, dims: as on the host
  if (st) return st;
  if (in_size - kHeaderSize != h.payload_len) return SZ_ERR_TRAILING;
  if (h.lossless != 0) return SZ_ERR_UNSUPPORTED;
  const uint64_t n = h.n(), nb = h.nblocks(), nw = div_up(nb, 32), fb = flag_bytes(nb);
  const uint64_t W = n ? h.inner() : 1;
  if (out_elems < n) return SZ_ERR_BUFFER;
  if (n && !d_out) return SZ_ERR_PARAM;
  if (!d_scratch || scratch_size < sz_device_scratch_size(n)) return SZ_ERR_SCRATCH;
  Scratch sc;
  scratch_layout(n, d_scratch, &sc);
  const uint8_t* payload = (const uint8_t*)d_in + kHeaderSize;
  const uint8_t* flags = payload;
  const uint8_t* descs = payload + fb;
  const uint8_t* data = descs + 2 * h.nzb;  // parse_header checked raw_len >= fb + 2 nzb
  const uint64_t data_len = h.raw_len - fb - 2 * h.nzb;
  k_init<<<1, 1, 0, s>>>(sc.st, SZ_EB_REL, 0.0);
  k_checksum<<<1024, 256, 0, s>>>(payload, h.payload_len, false, 0, sc.st);
  if (nb) {
    k_flag_counts<<<grid_for(nw, 256), 256, 0, s>>>(flags, fb, nb, sc.wcnt, sc.st);
    size_t tb = sc.cub_bytes;
    SZ_CU(cub::DeviceScan::ExclusiveSum(sc.cub_tmp, tb, sc.wcnt, sc.wrank, (int64_t)nw, s));
    k_desc_sizes<<<grid_for(nb, 256), 256, 0, s>>>(flags, fb, descs, h.nzb, n, sc.wcnt, sc.wrank,
                                                   sc.sizes, eb_all_raw(h.eb_abs), sc.st);
    tb = sc.cub_bytes;
    SZ_CU(cub::DeviceScan::ExclusiveSum(sc.cub_tmp, tb, sc.sizes, sc.offs, (int64_t)nb, s));
    float two_eb = make_quant_params(h.eb_abs).two_eb;
    k_decode<<<grid_for(nb, kThreads), kThreads, 0, s>>>(flags, fb, descs, h.nzb, data, data_len,
                                                         n, W, two_eb, sc.wrank, sc.sizes,
                                                         sc.offs, d_out, sc.st);
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
