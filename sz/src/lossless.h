// lossless.h - stage 4 (host only): optional zstd over the raw payload, in independent
// chunks so that threads compress and decompress them in parallel.
#pragma once
#include <stdint.h>
#include <stddef.h>

namespace szi {

constexpr uint32_t kDefaultChunk = 1u << 20;

bool zstd_available();
uint64_t zstd_packed_bound(uint64_t raw_len, uint32_t chunk);
// Packs raw into out (chunk table + chunks). Returns an sz_status.
int zstd_pack(const uint8_t* raw, uint64_t raw_len, uint32_t chunk, int level, int nthreads,
              uint8_t* out, uint64_t cap, uint64_t* out_len);
// Unpacks in[0..in_len) (chunk table + chunks) into raw[0..raw_len). Validates every size.
int zstd_unpack(const uint8_t* in, uint64_t in_len, uint64_t raw_len, uint32_t chunk,
                int nthreads, uint8_t* raw);

}  // namespace szi
