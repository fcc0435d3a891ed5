// nocuda.cpp - device entry points of a build without the CUDA backend.
#include "sz/sz.h"
extern "C" {
int sz_has_cuda(void) { return 0; }
const char* sz_cuda_error(void) { return "library built without CUDA"; }
size_t sz_device_scratch_size(size_t) { return 0; }
int sz_compress_device(const float*, const size_t*, int, double, int, void*, size_t, size_t*,
                       void*, size_t, void*) {
  return SZ_ERR_CUDA;
}
int sz_compress_device_plan(const float*, const size_t*, int, double, int, void*, size_t, size_t*,
                            void*) {
  return SZ_ERR_CUDA;
}
int sz_compress_device_write(const float*, const size_t*, int, double, int, void*, size_t,
                             size_t*, void*, size_t, void*) {
  return SZ_ERR_CUDA;
}
int sz_decompress_device(const void*, size_t, float*, size_t, void*, size_t, void*) {
  return SZ_ERR_CUDA;
}
}
