// device_twin.h - the CUDA backend run as CPU loops: cuda.cu's kernels in launch order, one
// loop iteration per GPU thread calling the same device_steps.h functions, and a serial
// exclusive scan in place of CUB's. The tests and the fuzz target compare it with the host
// backend byte for byte; `sz_bench --twin` times it. Not part of the library.
#pragma once
#include "device_steps.h"
#include <float.h>
#include <vector>

namespace szi {

// cub::DeviceScan::ExclusiveScan(..., TallySum(), Tally{0, 0}, ...)
inline std::vector<Tally> twin_scan(const std::vector<Tally>& in) {
  std::vector<Tally> out(in.size());
  Tally acc = {0, 0};
  for (size_t i = 0; i < in.size(); ++i) { out[i] = acc; acc = acc + in[i]; }
  return out;
}

// What sz_compress_device_plan leaves in the scratch.
struct TwinPlan {
  Header h;
  QuantParams qp;
  std::vector<uint8_t> plan;    // u16 descriptor per block
  std::vector<uint16_t> offs;   // data offset of each block inside its tile
  std::vector<uint32_t> words;  // flag word per tile
  std::vector<Tally> base;      // scanned tile tallies
  Tally total = {0, 0};
  uint64_t stream_size() const {
    return kHeaderSize + flag_bytes(h.nblocks()) + 2 * total.count + total.bytes;
  }
};

inline int twin_plan(const float* x, const size_t* dims, int ndims, double eb, int mode,
                     TwinPlan* p) {
  int st = set_request(&p->h, dims, ndims, eb, mode);
  if (st) return st;
  const uint64_t n = p->h.n(), nb = p->h.nblocks(), nw = div_up(nb, 32);
  const uint64_t W = n ? p->h.inner() : 1;
  double eb_abs = eb;
  if (mode == SZ_EB_REL) {  // k_minmax, k_set_rel
    float lo = INFINITY, hi = -INFINITY;
    for (uint64_t i = 0; i < n; ++i)
      if (fabsf(x[i]) <= FLT_MAX) { lo = x[i] < lo ? x[i] : lo; hi = x[i] > hi ? x[i] : hi; }
    const bool any = lo <= hi;
    eb_abs = rel_to_abs(eb, any ? lo : 0.0, any ? hi : 0.0, any);
  }
  p->h.eb_abs = eb_to_float(eb_abs);
  p->qp = make_quant_params(p->h.eb_abs);
  p->plan.assign(2 * nb, 0);
  for (uint64_t b = 0; b < nb; ++b)  // k_plan
    plan_step(x + b * kBlock, block_len(b, n), b, W, p->qp, p->plan.data());
  p->offs.assign(32 * nw, 0);
  p->words.assign(nw, 0);
  std::vector<Tally> tiles(nw);
  for (uint64_t w = 0; w < nw; ++w)  // k_plan_tiles
    tiles[w] = plan_tile(p->plan.data(), w, nb, n, p->offs.data(), p->words.data());
  p->base = twin_scan(tiles);
  p->total = nw ? p->base[nw - 1] + tiles[nw - 1] : Tally{0, 0};  // k_plan_done
  return SZ_OK;
}

// out: p.stream_size() bytes.
inline void twin_write(const float* x, const TwinPlan& p, uint8_t* out) {
  const uint64_t n = p.h.n(), nb = p.h.nblocks(), W = n ? p.h.inner() : 1;
  uint8_t* payload = out + kHeaderSize;
  for (uint64_t b = 0; b < nb; ++b) {  // k_write
    uint8_t* data = nullptr;
    const uint16_t d = write_place(p.plan.data(), p.offs.data(), p.words.data(), p.base.data(), b,
                                   nb, p.total.count, payload, &data);
    if (d != kDescZero)
      pack_block<false>(x + b * kBlock, block_len(b, n), (b * kBlock) % W, W, p.qp, d, data);
  }
  Header h = p.h;  // k_checksum, k_header
  h.nzb = p.total.count;
  h.raw_len = h.payload_len = p.stream_size() - kHeaderSize;
  h.payload_sum = checksum_serial(payload, h.payload_len);
  write_header(out, h);
}

inline int twin_compress(const float* x, const size_t* dims, int ndims, double eb, int mode,
                         std::vector<uint8_t>* out) {
  TwinPlan p;
  int st = twin_plan(x, dims, ndims, eb, mode, &p);
  if (st) return st;
  out->assign(p.stream_size(), 0);
  twin_write(x, p, out->data());
  return SZ_OK;
}

// sz_decompress_device's checks and kernels.
inline int twin_decompress(const uint8_t* in, size_t in_size, float* y, size_t out_elems) {
  if (in_size == 0) return SZ_ERR_EMPTY;
  Header h;
  int st = device_read_header(in, in_size, out_elems, &h);
  if (st) return st;
  const uint64_t n = h.n(), nb = h.nblocks(), nw = div_up(nb, 32), fb = flag_bytes(nb);
  const uint64_t W = n ? h.inner() : 1;
  const uint8_t* flags = in + kHeaderSize;
  const uint8_t* descs = flags + fb;
  const uint8_t* data = descs + 2 * h.nzb;
  const uint64_t data_len = h.raw_len - fb - 2 * h.nzb;
  bool ok = checksum_serial(flags, h.payload_len) == h.payload_sum;  // k_checksum
  std::vector<Tally> tiles(nw);
  std::vector<uint16_t> offs(32 * nw);
  for (uint64_t i = 0; i < nw; ++i)  // k_dec_tiles
    ok &= decode_tile(flags, nb, n, descs, h.nzb, eb_all_raw(h.eb_abs), i, offs.data(), &tiles[i]);
  const std::vector<Tally> base = twin_scan(tiles);
  if (nw) ok &= decode_totals(base[nw - 1], tiles[nw - 1], h.nzb, data_len);  // k_dec_total
  else ok &= totals_ok(Tally{0, 0}, h.nzb, data_len);
  if (!ok) return SZ_ERR_CORRUPT;
  const float two_eb = make_quant_params(h.eb_abs).two_eb;
  for (uint64_t b = 0; b < nb; ++b) {  // k_decode
    uint64_t off;
    const uint16_t d = decode_place(flags, nb, descs, offs.data(), base.data(), b, &off);
    if (!decode_block<false>(data + off, d, block_len(b, n), (b * kBlock) % W, W, two_eb,
                             y + b * kBlock))
      return SZ_ERR_CORRUPT;
  }
  return SZ_OK;
}

}  // namespace szi
