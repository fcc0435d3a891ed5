// lossless_zstd.cpp - chunked zstd stage (see lossless.h).
#include "lossless.h"
#include "common.h"
#include "sz/sz.h"
#include "format.h"
#include <stdlib.h>
#include <string.h>
#include <atomic>
#include <vector>
#include "parallel.h"
#ifdef SZ_HAVE_ZSTD
#include <zstd.h>
#endif

namespace szi {

bool zstd_available() {
#ifdef SZ_HAVE_ZSTD
  return true;
#else
  return false;
#endif
}

uint64_t zstd_packed_bound(uint64_t raw_len, uint32_t chunk) {
  return 8 * div_up(raw_len, chunk) + raw_len;
}

#ifdef SZ_HAVE_ZSTD
// Runs body(ctx, i) for the chunks i in [0, nch) on up to nthreads workers, which take the
// next chunk as they finish one; each worker has its own zstd context from make() (freed
// with release()). Stops at the first error a body returns (SZ_ERR_NOMEM: no context).
template <class Make, class Release, class Body>
int chunk_workers(int64_t nch, int nthreads, Make make, Release release, Body body) {
  std::atomic<int> err{SZ_OK};
  std::atomic<int64_t> next{0};
  const int T = nthreads < nch ? nthreads : (int)nch;
  parallel_run(T, [&](int) {
    auto* ctx = make();
    if (!ctx) { err = SZ_ERR_NOMEM; return; }
    for (int64_t i; err == SZ_OK && (i = next++) < nch;) {
      const int st = body(ctx, i);
      if (st != SZ_OK) err = st;
    }
    release(ctx);
  });
  return err;
}

int zstd_pack(const uint8_t* raw, uint64_t raw_len, uint32_t chunk, int level, int nthreads,
              uint8_t* out, uint64_t cap, uint64_t* out_len) {
  const int64_t nch = (int64_t)div_up(raw_len, chunk);
  const uint64_t table = 8 * (uint64_t)nch;
  if (cap < table) return SZ_ERR_BUFFER;
  if (nthreads <= 1 || nch <= 1) {  // one worker: chunks go straight behind the table
    ZSTD_CCtx* cctx = ZSTD_createCCtx();
    if (!cctx) return SZ_ERR_NOMEM;
    uint64_t pos = table;
    int st = SZ_OK;
    for (int64_t i = 0; i < nch && st == SZ_OK; ++i) {
      uint64_t off = (uint64_t)i * chunk;
      uint64_t len = raw_len - off < chunk ? raw_len - off : chunk;
      uint64_t room = cap - pos < len ? cap - pos : len;
      size_t r = ZSTD_compressCCtx(cctx, out + pos, room, raw + off, len, level);
      uint64_t entry = r;
      if (ZSTD_isError(r) || r >= len) {  // did not shrink: store the chunk
        if (cap - pos < len) { st = SZ_ERR_BUFFER; break; }
        memcpy(out + pos, raw + off, len);
        r = len;
        entry = len | kStoredFlag;
      }
      store_u64le(out + 8 * i, entry);
      pos += r;
    }
    ZSTD_freeCCtx(cctx);
    *out_len = pos;
    return st;
  }
  // Each chunk compresses into its own slot of a temporary buffer; a chunk that does not
  // shrink is stored as is. Then the slots are packed behind the table.
  uint8_t* tmp = (uint8_t*)malloc(raw_len ? raw_len : 1);
  if (!tmp) return SZ_ERR_NOMEM;
  std::vector<uint64_t> sizes((size_t)nch);
  const int err = chunk_workers(nch, nthreads, ZSTD_createCCtx, ZSTD_freeCCtx,
                                [&](ZSTD_CCtx* cctx, int64_t i) {
    uint64_t off = (uint64_t)i * chunk;
    uint64_t len = raw_len - off < chunk ? raw_len - off : chunk;
    size_t r = ZSTD_compressCCtx(cctx, tmp + off, len, raw + off, len, level);
    if (ZSTD_isError(r) || r >= len) {
      memcpy(tmp + off, raw + off, len);
      sizes[i] = len | kStoredFlag;
    } else {
      sizes[i] = r;
    }
    return SZ_OK;
  });
  if (err != SZ_OK) { free(tmp); return err; }
  uint64_t pos = table;
  for (int64_t i = 0; i < nch; ++i) {
    uint64_t len = sizes[i] & ~kStoredFlag;
    if (pos + len > cap) { free(tmp); return SZ_ERR_BUFFER; }
    store_u64le(out + 8 * i, sizes[i]);
    memcpy(out + pos, tmp + (uint64_t)i * chunk, len);
    pos += len;
  }
  free(tmp);
  *out_len = pos;
  return SZ_OK;
}

int zstd_unpack(const uint8_t* in, uint64_t in_len, uint64_t raw_len, uint32_t chunk,
                int nthreads, uint8_t* raw) {
  const int64_t nch = (int64_t)div_up(raw_len, chunk);
  const uint64_t table = 8 * (uint64_t)nch;
  if (in_len < table) return SZ_ERR_CORRUPT;
  std::vector<uint64_t> offs((size_t)nch + 1);
  offs[0] = table;
  for (int64_t i = 0; i < nch; ++i) {
    uint64_t len = load_u64le(in + 8 * i) & ~kStoredFlag;
    if (len > in_len - offs[i]) return SZ_ERR_CORRUPT;
    offs[i + 1] = offs[i] + len;
  }
  if (offs[nch] != in_len) return SZ_ERR_CORRUPT;
  return chunk_workers(nch, nthreads, ZSTD_createDCtx, ZSTD_freeDCtx,
                       [&](ZSTD_DCtx* dctx, int64_t i) {
    uint64_t off = (uint64_t)i * chunk;
    uint64_t want = raw_len - off < chunk ? raw_len - off : chunk;
    uint64_t entry = load_u64le(in + 8 * i);
    uint64_t len = offs[i + 1] - offs[i];
    if (entry & kStoredFlag) {
      if (len != want) return (int)SZ_ERR_CORRUPT;
      memcpy(raw + off, in + offs[i], len);
    } else {
      size_t r = ZSTD_decompressDCtx(dctx, raw + off, want, in + offs[i], len);
      if (ZSTD_isError(r) || r != want) return (int)SZ_ERR_CORRUPT;
    }
    return (int)SZ_OK;
  });
}
#else
int zstd_pack(const uint8_t*, uint64_t, uint32_t, int, int, uint8_t*, uint64_t, uint64_t*) {
  return SZ_ERR_UNSUPPORTED;
}
int zstd_unpack(const uint8_t*, uint64_t, uint64_t, uint32_t, int, uint8_t*) {
  return SZ_ERR_UNSUPPORTED;
}
#endif

}  // namespace szi
