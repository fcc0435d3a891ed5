// format.h - the stream header: layout, writer and validating reader (host and device).
//
// Offset Size Field (all little-endian)
//   0     4   magic "SZAC"
//   4     2   format version (1)
//   6     2   header size (104)
//   8     1   dtype (1 = float32)
//   9     1   ndims (1..4)
//  10     1   error-bound mode (0 abs, 1 rel)
//  11     1   predictor (1 = per-block choice of none / 1-D Lorenzo on codes)
//  12     1   encoder (1 = blockpack32)
//  13     1   lossless stage (0 none, 1 zstd chunks)
//  14     2   block size (32)
//  16    32   dims[4] u64, N C H W order, unused trailing dims are 1
//  48     8   eb as requested (f64)
//  56     4   absolute bound guaranteed (f32)
//  60     4   lossless chunk size (raw bytes per zstd chunk; 0 when none)
//  64     8   raw payload length (descriptors + block data, before lossless)
//  72     8   stored payload length (bytes following the header)
//  80     8   number of nonzero blocks (blocks whose descriptor is not the zero block)
//  88     8   checksum of the stored payload
//  96     8   checksum of header bytes 0..95
// parse_header also checks the stored bound against the stored mode and requested bound
// (eb_abs_consistent), and that a bound with no usable step goes with all-verbatim blocks.
// Payload (lossless none): block flags (1 bit per block, LSB first, set = not a zero block,
// ceil(nblocks/8) bytes), a u16 descriptor per flagged block, then the flagged blocks' data in
// block order. A zero block costs one bit.
// Payload (zstd): u64 per chunk (compressed size; bit 63 set = stored uncompressed), then
// the chunks; chunk i decompresses to min(chunk, raw - i*chunk) bytes of the raw payload.
#pragma once
#include "common.h"
#include "checksum.h"
#include "quantizer.h"
#include "blockpack.h"
#include "sz/sz.h"

namespace szi {

constexpr uint32_t kHeaderSize = 104;
constexpr uint16_t kVersion = 2;  // 2: checksum terms as products (checksum.h); 1 is refused
constexpr uint64_t kMaxElems = 1ULL << 40;
constexpr uint64_t kStoredFlag = 1ULL << 63;
constexpr uint32_t kMinChunk = 4096, kMaxChunk = 1u << 30;

struct Header {
  uint8_t ndims = 1, mode = 0, predictor = 1, encoder = 1, lossless = 0;
  uint64_t dims[4] = {1, 1, 1, 1};
  double eb_req = 0;
  float eb_abs = 0;
  uint32_t chunk = 0;
  uint64_t raw_len = 0, payload_len = 0, payload_sum = 0;
  uint64_t nzb = 0;  // nonzero blocks

  SZ_HD uint64_t n() const { return dims[0] * dims[1] * dims[2] * dims[3]; }
  SZ_HD uint64_t nblocks() const { return div_up(n(), kBlock); }
  SZ_HD uint64_t inner() const { return dims[ndims - 1]; }
};

SZ_HD uint64_t flag_bytes(uint64_t nb) { return div_up(nb, 8); }
// 32 block flags starting at block 32*w (bytes past fb read as 0)
SZ_HD uint32_t flag_word(const uint8_t* flags, uint64_t fb, uint64_t w) {
  uint32_t v = 0;
  for (uint64_t i = 0; i < 4; ++i)
    if (4 * w + i < fb) v |= (uint32_t)flags[4 * w + i] << (8 * i);
  return v;
}

// ---- checks shared by both encoders and the header reader ----------------------------

// An error bound request: eb > 0 and finite, a known mode.
SZ_HD bool request_ok(double eb, int mode) {
  return eb > 0.0 && eb < INFINITY && (mode == SZ_EB_ABS || mode == SZ_EB_REL);
}

// ndims 1..4, unused trailing dims 1, at most kMaxElems values. Dims after a 0 are not
// multiplied (the tensor is empty whatever they are).
SZ_HD bool dims_ok(const uint64_t* d, int ndims) {
  if (ndims < 1 || ndims > 4) return false;
  uint64_t n = 1;
  bool zero = false;
  for (int i = 0; i < 4; ++i) {
    if (i >= ndims && d[i] != 1) return false;
    if (d[i] == 0) zero = true;
    else if (!zero) {
      if (d[i] > kMaxElems / n) return false;  // n * d[i] > kMaxElems, without overflow
      n *= d[i];
    }
  }
  return true;
}

// An encode call's shape and bound into h (host side of both backends); SZ_ERR_PARAM when
// they are not a valid request.
inline int set_request(Header* h, const size_t* dims, int ndims, double eb, int mode) {
  if (!dims || ndims < 1 || ndims > 4 || !request_ok(eb, mode)) return SZ_ERR_PARAM;
  for (int i = 0; i < 4; ++i) h->dims[i] = i < ndims ? (uint64_t)dims[i] : 1;
  h->ndims = (uint8_t)ndims;
  h->mode = (uint8_t)mode;
  h->eb_req = eb;
  return dims_ok(h->dims, ndims) ? SZ_OK : SZ_ERR_PARAM;
}

// Values in block b of an n-value tensor: 32, fewer in the last block.
SZ_HD int block_len(uint64_t b, uint64_t n) {
  const uint64_t first = b * kBlock;
  return (int)(n - first < (uint64_t)kBlock ? n - first : kBlock);
}

SZ_HD uint64_t raw_len_bound(uint64_t n) {
  uint64_t nb = div_up(n, kBlock);
  return flag_bytes(nb) + 2 * nb + 4 * n;
}

// The stored absolute bound against what the encoder derives from the stored mode and
// requested bound (eb_req > 0 and finite, eb_abs >= 0 and finite, checked by the caller).
// Absolute mode: exactly eb_to_float(eb_req), on both backends. Relative mode: the header
// does not hold the value range, so only the interval any float tensor can give is checked:
// eb_to_float(eb_req * r) with r the finite range (vmax - vmin), the magnitude of a constant
// tensor, or 1 (no finite nonzero value), and every such r lies in [2^-149, 2^129).
SZ_HD bool eb_abs_consistent(uint8_t mode, double eb_req, float eb_abs) {
  if (mode == SZ_EB_ABS) return eb_abs == eb_to_float(eb_req);
  return eb_abs >= eb_to_float(eb_req * 0x1p-149) && eb_abs <= eb_to_float(eb_req * 0x1p129);
}

// True when the bound admits no quantization step (0, or so small that 1/(2 eb) overflows):
// then the encoder stores every block verbatim, and the decoder accepts nothing else.
SZ_HD bool eb_all_raw(float eb_abs) { return !(make_quant_params(eb_abs).inv_two_eb < INFINITY); }

SZ_HD void write_header(uint8_t* p, const Header& h) {
  for (uint32_t i = 0; i < kHeaderSize; ++i) p[i] = 0;
  p[0] = 'S'; p[1] = 'Z'; p[2] = 'A'; p[3] = 'C';
  store_u16le(p + 4, kVersion);
  store_u16le(p + 6, (uint16_t)kHeaderSize);
  p[8] = 1; p[9] = h.ndims; p[10] = h.mode; p[11] = h.predictor; p[12] = h.encoder;
  p[13] = h.lossless;
  store_u16le(p + 14, (uint16_t)kBlock);
  for (int i = 0; i < 4; ++i) store_u64le(p + 16 + 8 * i, h.dims[i]);
  store_u64le(p + 48, d2u(h.eb_req));
  store_u32le(p + 56, f2u(h.eb_abs));
  store_u32le(p + 60, h.chunk);
  store_u64le(p + 64, h.raw_len);
  store_u64le(p + 72, h.payload_len);
  store_u64le(p + 80, h.nzb);
  store_u64le(p + 88, h.payload_sum);
  uint64_t s = 0;
  for (uint64_t i = 0; i < 24; ++i) s += checksum_term(i, load_u32le(p + 4 * i));
  store_u64le(p + 96, s);
}

// Validates everything the header alone can tell. avail = bytes available at p.
// Does not verify the payload checksum.
SZ_HD int parse_header(const uint8_t* p, uint64_t avail, Header* h) {
  const char magic[4] = {'S', 'Z', 'A', 'C'};
  for (uint64_t i = 0; i < 4 && i < avail; ++i)
    if (p[i] != (uint8_t)magic[i]) return SZ_ERR_FORMAT;
  if (avail < kHeaderSize) return SZ_ERR_TRUNCATED;
  if (load_u16le(p + 4) != kVersion || load_u16le(p + 6) != kHeaderSize) return SZ_ERR_FORMAT;
  uint64_t s = 0;
  for (uint64_t i = 0; i < 24; ++i) s += checksum_term(i, load_u32le(p + 4 * i));
  if (s != load_u64le(p + 96)) return SZ_ERR_CORRUPT;
  if (p[8] != 1) return SZ_ERR_UNSUPPORTED;  // dtype
  h->ndims = p[9]; h->mode = p[10]; h->predictor = p[11]; h->encoder = p[12];
  h->lossless = p[13];
  for (int i = 0; i < 4; ++i) h->dims[i] = load_u64le(p + 16 + 8 * i);
  h->eb_req = u2d(load_u64le(p + 48));
  // shape and request as an encoder accepts them
  if (!dims_ok(h->dims, h->ndims) || !request_ok(h->eb_req, h->mode)) return SZ_ERR_CORRUPT;
  if (h->predictor != 1 || h->encoder != 1 || h->lossless > 1) return SZ_ERR_UNSUPPORTED;
  if (load_u16le(p + 14) != kBlock) return SZ_ERR_UNSUPPORTED;
  const uint64_t n = h->n();
  h->eb_abs = u2f(load_u32le(p + 56));
  h->chunk = load_u32le(p + 60);
  h->raw_len = load_u64le(p + 64);
  h->payload_len = load_u64le(p + 72);
  h->payload_sum = load_u64le(p + 88);
  h->nzb = load_u64le(p + 80);
  if (!(h->eb_abs >= 0.0f) || !(h->eb_abs < INFINITY)) return SZ_ERR_CORRUPT;
  if (!eb_abs_consistent(h->mode, h->eb_req, h->eb_abs)) return SZ_ERR_CORRUPT;
  uint64_t nb = div_up(n, kBlock);
  if (h->nzb > nb) return SZ_ERR_CORRUPT;
  if (h->raw_len < flag_bytes(nb) + 2 * h->nzb || h->raw_len > raw_len_bound(n)) return SZ_ERR_CORRUPT;
  // no usable step: every block verbatim (the decoders also check each descriptor)
  if (eb_all_raw(h->eb_abs) && (h->nzb != nb || h->raw_len != raw_len_bound(n)))
    return SZ_ERR_CORRUPT;
  if (h->lossless == 0) {
    if (h->payload_len != h->raw_len || h->chunk != 0) return SZ_ERR_CORRUPT;
  } else {
    if (h->chunk < kMinChunk || h->chunk > kMaxChunk) return SZ_ERR_CORRUPT;
    uint64_t nch = div_up(h->raw_len, h->chunk);
    if (h->payload_len < 8 * nch || h->payload_len > 8 * nch + h->raw_len) return SZ_ERR_CORRUPT;
  }
  if (h->payload_len > avail - kHeaderSize) return SZ_ERR_TRUNCATED;
  return SZ_OK;
}

// ---- the payload's flags and descriptors: layout and checks of both decoders ----------
// Every descriptor is validated, in the compact order, before any block is decoded: then a
// decoder needs no further check to stay inside the payload.

SZ_HD bool flag_bit(const uint8_t* flags, uint64_t b) { return (flags[b >> 3] >> (b & 7)) & 1u; }

// Flag word w (flag_word) sets no flag past the last block.
SZ_HD bool flag_word_ok(uint32_t word, uint64_t w, uint64_t nb) {
  const uint64_t valid = nb - 32 * w;
  return valid >= 32 || (word >> valid) == 0;
}

// Inverse of flag_word: the bytes of word w that lie below fb.
SZ_HD void store_flag_word(uint8_t* flags, uint64_t fb, uint64_t w, uint32_t word) {
  for (uint64_t i = 0; i < 4; ++i)
    if (4 * w + i < fb) flags[4 * w + i] = (uint8_t)(word >> (8 * i));
}

// Blocks (or descriptors) and their data bytes: what the prefix sums add up.
struct Tally {
  uint64_t count, bytes;
};
SZ_HD Tally operator+(const Tally& a, const Tally& b) { return Tally{a.count + b.count, a.bytes + b.bytes}; }
struct TallySum {
  SZ_HD Tally operator()(const Tally& a, const Tally& b) const { return a + b; }
};

// In an array of descriptors, the entry j that belongs to the tensor's last block, whose
// length L may be under 32 (every other entry is a full block); j = ~0 when none does.
struct Tail {
  uint64_t j;
  int L;
};
SZ_HD Tail no_tail() { return Tail{~(uint64_t)0, kBlock}; }

// The stream's compact descriptors: the last one is the last block's when that block is flagged.
SZ_HD Tail compact_tail(const uint8_t* flags, uint64_t nb, uint64_t n, uint64_t nzb) {
  if (nb == 0 || nzb == 0 || !flag_bit(flags, nb - 1)) return no_tail();
  return Tail{nzb - 1, block_len(nb - 1, n)};
}

// Descriptors [j0, j1) of a u16 LE array: how many are nonzero and their data bytes. In a
// stream's compact array (compact) a zero descriptor is invalid, and with all_raw (a bound
// with no step) every entry must be raw; an invalid entry sets *ok = false and counts 0 bytes.
// prefix (may be null) gets, for each entry, the bytes of the entries before it in the run
// (runs of at most 32 entries: at most 31 * 128 bytes).
SZ_HD Tally desc_run(const uint8_t* descs, uint64_t j0, uint64_t j1, Tail tail, bool compact,
                     bool all_raw, bool* ok, uint16_t* prefix) {
  Tally t = {0, 0};
  for (uint64_t j = j0; j < j1; ++j) {
    const uint16_t d = load_u16le(descs + 2 * j);
    uint32_t s = block_data_size(d, j == tail.j ? tail.L : kBlock);
    if (s == kBadSize || (compact && d == kDescZero) || (all_raw && d != kDescRaw)) {
      *ok = false;
      s = 0;
    }
    if (prefix) prefix[j - j0] = (uint16_t)t.bytes;
    t.count += d != kDescZero;
    t.bytes += s;
  }
  return t;
}

// After all descriptors passed desc_run: the totals of the flag counts and descriptor bytes
// agree with the header.
SZ_HD bool totals_ok(const Tally& total, uint64_t nzb, uint64_t data_len) {
  return total.count == nzb && total.bytes == data_len;
}

}  // namespace szi
