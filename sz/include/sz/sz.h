/* sz.h - C API of COMET's error-bounded lossy compressor for float32 activations.
 *
 * A stream is self-describing (see docs/sz.md, "Stream format"). Every finite value x
 * comes back as x' with |x - x'| <= eb (absolute mode) or <= rel * (max - min) (relative
 * mode); NaN, +Inf, -Inf and exact zeros come back exactly. Streams made by the CPU and the
 * CUDA backend decode to the same values, bit for bit.
 *
 * All functions return SZ_OK (0) or a negative sz_status; sz_strerror() names it.
 * Nothing here needs CUDA headers: CUDA streams are passed as void*.
 */
#ifndef SZ_SZ_H
#define SZ_SZ_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define SZ_API
#else
#define SZ_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define SZ_MAX_DIMS 4
#define SZ_HEADER_SIZE 104 /* bytes of the fixed stream header */

typedef enum sz_status {
  SZ_OK = 0,
  SZ_ERR_PARAM = -1,       /* bad argument: NULL pointer, ndims, eb <= 0 or not finite, ... */
  SZ_ERR_BUFFER = -2,      /* output buffer too small */
  SZ_ERR_TRUNCATED = -3,   /* input shorter than the header says */
  SZ_ERR_FORMAT = -4,      /* not an sz stream (bad magic) or unknown version */
  SZ_ERR_CORRUPT = -5,     /* checksum mismatch or inconsistent lengths/offsets */
  SZ_ERR_UNSUPPORTED = -6, /* valid stream, but this build cannot decode it (e.g. zstd) */
  SZ_ERR_NOMEM = -7,       /* host allocation failed */
  SZ_ERR_CUDA = -8,        /* CUDA runtime error, or library built without CUDA */
  SZ_ERR_SCRATCH = -9,     /* device scratch buffer too small */
  SZ_ERR_TRAILING = -10,   /* bytes after the end of the stream (see sz_decompress_host_prefix) */
  SZ_ERR_EMPTY = -11       /* the input has 0 bytes */
} sz_status;

typedef enum sz_eb_mode {
  SZ_EB_ABS = 0, /* eb is an absolute bound */
  SZ_EB_REL = 1  /* eb is a fraction of (max - min) over the finite values */
} sz_eb_mode;

typedef enum sz_lossless {
  SZ_LOSSLESS_NONE = 0,
  SZ_LOSSLESS_ZSTD = 1 /* host only; default for sz_compress_host when built with zstd */
} sz_lossless;

typedef struct sz_params {
  double eb;        /* error bound (> 0, finite); meaning given by mode */
  int mode;         /* sz_eb_mode */
  int lossless;     /* sz_lossless; SZ_LOSSLESS_ZSTD silently becomes NONE without zstd */
  int zstd_level;   /* 0 = default (1); negative = zstd fast levels */
  int nthreads;     /* worker threads; 0 = all hardware threads */
} sz_params;

typedef struct sz_header_info {
  uint32_t version;
  uint32_t ndims;
  uint64_t dims[SZ_MAX_DIMS]; /* N, C, H, W order, innermost last; unused are 1 */
  uint64_t n_elems;
  int mode;                   /* sz_eb_mode the stream was made with */
  double eb_requested;        /* eb as given by the caller */
  double eb_abs;              /* absolute bound actually guaranteed */
  int lossless;               /* sz_lossless */
  uint64_t stream_size;       /* total bytes of the stream, header included */
  uint64_t raw_payload_size;  /* payload bytes before the lossless stage */
} sz_header_info;

SZ_API const char* sz_strerror(int status);
SZ_API const char* sz_version(void);
SZ_API int sz_has_cuda(void); /* 1 when the library was built with the CUDA backend */
/* After SZ_ERR_CUDA: what failed in this thread, e.g. "cudaErrorMemoryAllocation (out of memory)
   in cudaMemcpyAsync", or an error pending from before the call (reported, not lost), or that
   the library was built without CUDA. "" when the thread's last device call succeeded. */
SZ_API const char* sz_cuda_error(void);

/* Fills *p with defaults: eb, mode as given, zstd on if available, all threads. */
SZ_API void sz_params_default(sz_params* p, double eb, int mode);

/* Worst-case stream size for n_elems float32 values (any dims, any eb, any backend). */
SZ_API size_t sz_compress_bound(size_t n_elems);

/* Host compression. dims[0..ndims) in N,C,H,W order (ndims 1..4; a dim may be 0).
 * Writes at most out_capacity bytes to out; *out_size gets the stream size. */
SZ_API int sz_compress_host(const float* in, const size_t* dims, int ndims, double eb, int mode,
                            void* out, size_t out_capacity, size_t* out_size);
SZ_API int sz_compress_host_ex(const float* in, const size_t* dims, int ndims,
                               const sz_params* params, void* out, size_t out_capacity,
                               size_t* out_size);

/* The value each of in[0..n) comes back as from a stream at absolute bound eb, on its own: the
 * quantizer's x' (nearest multiple of 2 eb, ties to even, exact-bound check), or the value
 * itself where the quantizer refuses it (NaN, Inf, too large for eb; every value when eb has
 * no usable step). In a stream a 32-value block holding such a value is stored verbatim whole,
 * so its other values come back exactly; that is the only difference. For error models that
 * need x' - x without encoding. out may equal in. */
SZ_API int sz_restore_host(const float* in, size_t n, double eb, float* out);

/* Where the host backend's threads come from. With nthreads > 1 a call splits its work into n
 * tasks and hands them to the executor, which runs task(arg, t) for every t in [0, n) (t = 0
 * may run on the calling thread) and returns when all have run; tasks never throw. NULL (the
 * default) runs them on a new std::thread each, per call. A host application with a thread
 * pool of its own (COMET-Caffe's store) installs it here, so that no call creates threads.
 * Process-wide: set it before compressing, not while calls are running. */
typedef void (*sz_task)(void* arg, int t);
typedef void (*sz_executor)(void* ctx, int n, sz_task task, void* arg);
SZ_API void sz_set_executor(sz_executor executor, void* ctx);

/* Host decompression into out[0..n) where n = product of the stream's dims <= out_elems.
 * in_size must be the stream's exact size: SZ_ERR_EMPTY for 0 bytes, SZ_ERR_TRUNCATED when
 * shorter than the header states, SZ_ERR_TRAILING when longer. Besides the checksums, the
 * header's absolute bound must be the one its mode and requested bound give (absolute mode:
 * exactly; relative mode: within what any float value range gives), else SZ_ERR_CORRUPT. */
SZ_API int sz_decompress_host(const void* in, size_t in_size, float* out, size_t out_elems);
SZ_API int sz_decompress_host_ex(const void* in, size_t in_size, float* out, size_t out_elems,
                                 int nthreads);

/* Prefix read: decodes the stream at the start of in[0..in_size), which may be followed by
 * other bytes (e.g. the next stream of a concatenation); *consumed gets the stream's size
 * (header + payload) on SZ_OK, 0 otherwise. nthreads as in sz_decompress_host_ex. */
SZ_API int sz_decompress_host_prefix(const void* in, size_t in_size, float* out,
                                     size_t out_elems, int nthreads, size_t* consumed);

/* Parses and validates the header (not the payload) of a stream of exactly in_size bytes:
 * SZ_ERR_TRUNCATED when in_size is less than the stream size the header states,
 * SZ_ERR_TRAILING when more (sz_peek_header reads the header at the start of a larger buffer). */
SZ_API int sz_read_header(const void* in, size_t in_size, sz_header_info* info);

/* Same checks on the SZ_HEADER_SIZE bytes of a header alone (e.g. copied back from a device
 * stream, or the start of a larger buffer); the stream length is reported in
 * info->stream_size but cannot be checked here. */
SZ_API int sz_peek_header(const void* header, size_t header_size, sz_header_info* info);

/* ---- CUDA backend (SZ_ERR_CUDA when built without it) ----------------------------------
 * Buffers are device pointers; stream is a cudaStream_t (NULL = legacy default stream).
 * scratch is caller-provided device memory of at least sz_device_scratch_size(n) bytes
 * (about n / 6 bytes); the hot path allocates nothing. The functions enqueue their work on
 * the stream and synchronise it once at the end to report the size / status to the host.
 * Device streams use no lossless stage (SZ_LOSSLESS_NONE); the host decoder reads them,
 * and the device decoder reads host streams made with SZ_LOSSLESS_NONE.
 * sz_decompress_device checks the header on the host like sz_decompress_host, in_size
 * included (exact: SZ_ERR_TRAILING when longer); for a stream at the start of a larger
 * buffer, pass the stream_size that sz_peek_header reports. */
SZ_API size_t sz_device_scratch_size(size_t n_elems);

/* One call: d_out has out_capacity bytes (sz_compress_bound(n) always suffices; a smaller
 * buffer that the stream does not fit gives SZ_ERR_BUFFER). */
SZ_API int sz_compress_device(const float* d_in, const size_t* dims, int ndims, double eb,
                              int mode, void* d_out, size_t out_capacity, size_t* out_size,
                              void* d_scratch, size_t scratch_size, void* stream);

/* Two calls, for an output allocated at its exact size: sz_compress_device_plan chooses the
 * encoding of every block into d_scratch and reports the stream's size in *stream_size;
 * sz_compress_device_write then writes that stream into d_out (out_capacity >= that size),
 * given the same d_in contents, dims, ndims, eb, mode and scratch. The plan stays valid
 * until the scratch is reused, so one plan may be written more than once. A write whose
 * request differs from the plan's, or without a plan, returns SZ_ERR_PARAM. The stream is
 * the one sz_compress_device writes, byte for byte. */
SZ_API int sz_compress_device_plan(const float* d_in, const size_t* dims, int ndims, double eb,
                                   int mode, void* d_scratch, size_t scratch_size,
                                   size_t* stream_size, void* stream);
SZ_API int sz_compress_device_write(const float* d_in, const size_t* dims, int ndims, double eb,
                                    int mode, void* d_out, size_t out_capacity,
                                    size_t* out_size, void* d_scratch, size_t scratch_size,
                                    void* stream);
SZ_API int sz_decompress_device(const void* d_in, size_t in_size, float* d_out,
                                size_t out_elems, void* d_scratch, size_t scratch_size,
                                void* stream);

#ifdef __cplusplus
}
#endif
#endif /* SZ_SZ_H */
