#ifndef CAFFE_COMET_PAYLOAD_GPU_HPP_
#define CAFFE_COMET_PAYLOAD_GPU_HPP_

// COMET-Caffe: the device halves of payload.cpp's codecs, in Caffe's .cpp/.cu shape: masks and
// codes in mask.cu, sz streams in payload.cu. CPU_ONLY builds get stubs (end of payload.cpp)
// that stop with NO_GPU, so payload.cpp calls them without #ifdefs; it never does in a CPU run,
// since no payload is made on a device there.

#include <stdint.h>

#include <cstddef>

#include "caffe/comet/codes.hpp"

namespace caffe {

class CometPayload;

// mask.cu
void CometMaskPackGpu(const float* x, size_t count, uint32_t* words, uint32_t* popcount,
                      bool* nonfinite);
void CometMaskDecodeGpu(const uint32_t* words, size_t count, float* x, bool apply_signs,
                        uint32_t* popcount);
void CometCodesPackGpu(const int32_t* v, size_t count, int bits, bool argmax,
                       const comet_codes::PoolGeometry& g, const comet_codes::BinaryRule& r,
                       uint32_t* words, uint32_t* popcount, bool* bad);
void CometCodesUnpackGpu(const uint32_t* words, size_t count, int bits, bool argmax,
                         const comet_codes::PoolGeometry& g, const comet_codes::BinaryRule& r,
                         int32_t* v, uint32_t* popcount, bool* bad);
void CometReluBackwardGpu(const uint32_t* words, size_t count, const float* top_diff,
                          float* bottom_diff, float negative_slope, uint32_t* popcount);

// Max pooling straight into codes (CometPoolToCodes, CometPoolBackwardFromCodes); `count`: the
// pooled elements. The backward writes every bottom diff, gathering as upstream's kernel does.
// Argmax decodes and the backward set *bad for a code that names no element of its window.
void CometPoolToCodesGpu(const float* bottom, float* top, size_t count, int bits,
                         const comet_codes::PoolGeometry& g, uint32_t* words, uint32_t* popcount,
                         bool* bad);
void CometPoolBackwardGpu(const uint32_t* words, size_t count, int bits,
                          const comet_codes::PoolGeometry& g, const float* top_diff,
                          float* bottom_diff, uint32_t* popcount, bool* bad);

// payload.cu. Encode: plans the stream (sz's scratch, ~0.16 bytes per value, is the whole
// transient), allocates the payload at its exact size and writes it; an sz status.
int CometLossyEncodeGpu(const float* data, const size_t* dims, int ndims, double eb,
                        CometPayload* p);
int CometLossyDecodeGpu(const CometPayload& p, float* out);
void CometCopyToHost(void* host, const void* device, size_t bytes);

// payload.cpp: a device transient of `bytes` held for a moment (CometTakeTransientPeak).
void CometNoteTransient(size_t bytes);

}  // namespace caffe

#endif  // CAFFE_COMET_PAYLOAD_GPU_HPP_
