// device_steps.h - what one CUDA thread does in each kernel of the device backend, as host and
// device functions: cuda.cu's kernels only compute their index, load and store, and call these;
// device_twin.h runs the same functions in plain loops on the CPU, so the tests check the
// device logic byte for byte against the host backend where no GPU is.
//
// Encoder (one encode, one offset scan):
//   plan   thread per block: quantize, choose the descriptor (encode_block, no output); the
//          descriptor goes to the plan in scratch (u16 per block).
//   tiles  thread per tile of 32 blocks: the tile's flag word, each block's data offset inside
//          the tile (u16), and the tile's tally (flagged blocks, data bytes).
//   scan   exclusive prefix sum of the tile tallies (one CUB scan of pairs) -> each tile's
//          rank and data offset; the stream size is known here, before any output exists.
//   write  thread per block: the tile's flag word (first thread), the descriptor at its
//          rank, the data at its offset (pack_block: the codes again, no second choice).
// Decoder (one offset scan):
//   tiles  thread per index i: flag word i (count, no flag past the end) and compact
//          descriptors [32i, 32i+32) (validated, data bytes, offset of each inside the run).
//   scan   exclusive prefix sum of those pairs -> rank before flag word i, data offset before
//          descriptor 32i. Then one thread checks the totals against the header.
//   decode thread per block: its descriptor and data offset, then decode_block.
// Every step is O(1) or O(32) per thread; no thread waits for another inside a kernel.
#pragma once
#include "format.h"
#include "blockpack.h"

namespace szi {

// ---- encoder --------------------------------------------------------------------------

// Plan, block b (values v[0..L)): its descriptor into plan[b].
SZ_HD void plan_step(const float* v, int L, uint64_t b, uint64_t W, const QuantParams& qp,
                     uint8_t* plan) {
  uint16_t d;
  encode_block(v, L, (b * kBlock) % W, W, qp, &d, nullptr);
  store_u16le(plan + 2 * b, d);
}

// Tiles, tile w (after the plan): in-tile data offsets of its blocks into offs[32w..],
// its flag word into words[w]; returns its flagged blocks and data bytes.
SZ_HD Tally plan_tile(const uint8_t* plan, uint64_t w, uint64_t nb, uint64_t n, uint16_t* offs,
                      uint32_t* words) {
  const uint64_t end = 32 * w + 32 < nb ? 32 * w + 32 : nb;
  uint32_t word = 0;
  for (uint64_t b = 32 * w; b < end; ++b)
    word |= (uint32_t)(load_u16le(plan + 2 * b) != kDescZero) << (b & 31);
  words[w] = word;
  bool ok = true;
  return desc_run(plan, 32 * w, end, Tail{nb - 1, block_len(nb - 1, n)}, false, false, &ok,
                  offs + 32 * w);
}

// Write, block b, with base[] the scanned tile tallies and nzb their total count: writes the
// tile's flag word (from the tile's first block) and, for a flagged block, its descriptor
// into payload; returns the descriptor and sets *data to where the block's bytes go.
SZ_HD uint16_t write_place(const uint8_t* plan, const uint16_t* offs, const uint32_t* words,
                           const Tally* base, uint64_t b, uint64_t nb, uint64_t nzb,
                           uint8_t* payload, uint8_t** data) {
  const uint64_t w = b / 32, fb = flag_bytes(nb);
  const uint32_t lane = (uint32_t)(b & 31);
  if (lane == 0) store_flag_word(payload, fb, w, words[w]);
  const uint16_t d = load_u16le(plan + 2 * b);
  if (d == kDescZero) return d;
  const uint64_t rank = base[w].count + (uint64_t)popc32(words[w] & ((1u << lane) - 1u));
  store_u16le(payload + fb + 2 * rank, d);
  *data = payload + fb + 2 * nzb + base[w].bytes + offs[b];
  return d;
}

// ---- decoder --------------------------------------------------------------------------

// The header checks of sz_decompress_device (on the host, from the header's bytes hb): a
// valid header, a stream of exactly in_size bytes, no lossless stage, room for its values.
inline int device_read_header(const uint8_t* hb, uint64_t in_size, uint64_t out_elems, Header* h) {
  int st = parse_header(hb, in_size, h);  // bound, lengths, dims: as on the host
  if (st) return st;
  if (in_size - kHeaderSize != h->payload_len) return SZ_ERR_TRAILING;
  if (h->lossless != 0) return SZ_ERR_UNSUPPORTED;
  return out_elems < h->n() ? SZ_ERR_BUFFER : SZ_OK;
}

// Tiles, index i < ceil(nb / 32): flag word i's count and the bytes of compact descriptors
// [32i, 32i + 32), with the offset of each inside that run into offs[32i..]. Returns false
// when the word flags a block past the end or a descriptor is invalid.
SZ_HD bool decode_tile(const uint8_t* flags, uint64_t nb, uint64_t n, const uint8_t* descs,
                       uint64_t nzb, bool all_raw, uint64_t i, uint16_t* offs, Tally* out) {
  const uint32_t word = flag_word(flags, flag_bytes(nb), i);
  bool ok = flag_word_ok(word, i, nb);
  uint64_t bytes = 0;
  if (32 * i < nzb) {
    const uint64_t end = 32 * i + 32 < nzb ? 32 * i + 32 : nzb;
    bytes = desc_run(descs, 32 * i, end, compact_tail(flags, nb, n, nzb), true, all_raw, &ok,
                     offs + 32 * i).bytes;
  }
  *out = Tally{(uint64_t)popc32(word), bytes};
  return ok;
}

// Totals, after the scan (base = scanned tiles, last = tile nw - 1 before the scan).
SZ_HD bool decode_totals(const Tally& base_last, const Tally& last, uint64_t nzb,
                         uint64_t data_len) {
  return totals_ok(base_last + last, nzb, data_len);
}

// Decode, block b of a stream whose tiles and totals passed: its descriptor, and in *off
// the offset of its data. base[w].count is the rank before flag word w, base[c].bytes the
// offset before compact descriptor 32c.
SZ_HD uint16_t decode_place(const uint8_t* flags, uint64_t nb, const uint8_t* descs,
                            const uint16_t* offs, const Tally* base, uint64_t b, uint64_t* off) {
  const uint64_t w = b / 32;
  const uint32_t word = flag_word(flags, flag_bytes(nb), w), lane = (uint32_t)(b & 31);
  *off = 0;
  if (!((word >> lane) & 1u)) return kDescZero;
  const uint64_t rank = base[w].count + (uint64_t)popc32(word & ((1u << lane) - 1u));
  *off = base[rank / 32].bytes + offs[rank];
  return load_u16le(descs + 2 * rank);
}

}  // namespace szi
