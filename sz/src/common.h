// common.h - shared definitions for the host and the CUDA backends.
// Every per-element / per-block function used by both backends lives in a header and is
// marked SZ_HD so that the CPU tests exercise exactly the code the GPU runs.
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef __CUDACC__
#define SZ_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define SZ_HD inline __attribute__((always_inline))
#else
#define SZ_HD inline
#endif

// Full unrolling of a per-block loop on the device, so that the block's arrays stay in
// registers (without it nvcc kept the decoder's codes in local memory).
#ifdef __CUDA_ARCH__
#define SZ_UNROLL _Pragma("unroll")
#else
#define SZ_UNROLL
#endif

// Full unrolling of a host loop with a compile-time count (GCC; nvcc's front end rejects it).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define SZ_HOST_UNROLL32 _Pragma("GCC unroll 32")
#define SZ_HOST_UNROLL8 _Pragma("GCC unroll 8")
#else
#define SZ_HOST_UNROLL32
#define SZ_HOST_UNROLL8
#endif

namespace szi {

constexpr int kBlock = 32;           // elements per block (one bitmap word)
constexpr uint16_t kDescZero = 0;    // block of all-zero codes
constexpr uint16_t kDescRaw = 0xFFFF; // block stored verbatim (NaN/Inf/unquantizable)

SZ_HD uint64_t div_up(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

SZ_HD int popc32(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

// index of the lowest set bit (v != 0)
SZ_HD int ctz32(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __ffs(v) - 1;
#else
  return __builtin_ctz(v);
#endif
}

// number of bits needed to hold v (0 for v == 0)
SZ_HD int bit_width32(uint32_t v) {
#ifdef __CUDA_ARCH__
  return 32 - __clz(v);
#else
  return v ? 32 - __builtin_clz(v) : 0;
#endif
}

SZ_HD uint32_t load_u32le(const uint8_t* p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
SZ_HD void store_u32le(uint8_t* p, uint32_t v) {
  p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
// On a little-endian machine the 8 bytes are the value as stored: one unaligned load or store
// (the byte-wise form is not merged by GCC and cost the host decoder 8%).
SZ_HD uint64_t load_u64le(const uint8_t* p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
#else
  return (uint64_t)load_u32le(p) | ((uint64_t)load_u32le(p + 4) << 32);
#endif
}
SZ_HD void store_u64le(uint8_t* p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  memcpy(p, &v, 8);
#else
  store_u32le(p, (uint32_t)v); store_u32le(p + 4, (uint32_t)(v >> 32));
#endif
}
SZ_HD uint16_t load_u16le(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
SZ_HD void store_u16le(uint8_t* p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

SZ_HD uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
SZ_HD float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
SZ_HD uint64_t d2u(double f) { uint64_t u; memcpy(&u, &f, 8); return u; }
SZ_HD double u2d(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }

}  // namespace szi
