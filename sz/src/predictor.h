// predictor.h - stage 2: prediction on quantized codes inside one block.
//
// kPredNone:    c_i = q_i                (best for ReLU-sparse data: zeros stay zero codes)
// kPredLorenzo: c_i = q_i - q_{i-1}      (1-D Lorenzo along the innermost dimension; the
//               first element of a block or of a row is predicted by 0)
// Predicting on quantized codes (not on reconstructed values) keeps every block
// independent, so blocks are encoded and decoded in parallel on CPU threads and GPU threads.
// Arithmetic is modulo 2^32 so corrupt streams cannot trigger signed overflow.
#pragma once
#include "common.h"

namespace szi {

enum Predictor { kPredNone = 0, kPredLorenzo = 1 };

// Bit i set when element i of the block starts an innermost row (has no left neighbour);
// bit 0 is always set. row_pos = index of element 0 within its row (first_index % W), W >= 1.
SZ_HD uint32_t row_start_mask(uint64_t row_pos, uint64_t W) {
  uint32_t m = 1u;
  for (uint64_t i = row_pos == 0 ? W : W - row_pos; i < 32; i += W) m |= 1u << i;
  return m;
}

// The loops below index arrays with loop counters only, so that after unrolling (L == 32
// on the GPU) the arrays stay in registers.
SZ_HD void lorenzo_forward(const int32_t* q, int L, uint64_t row_pos, uint64_t W, int32_t* c) {
  const uint32_t starts = row_start_mask(row_pos, W);
  c[0] = q[0];
  for (int i = 1; i < L; ++i) {
    int32_t d = (int32_t)((uint32_t)q[i] - (uint32_t)q[i - 1]);
    c[i] = (starts >> i) & 1u ? q[i] : d;
  }
}

// in place: codes -> quantized values
SZ_HD void lorenzo_inverse(int32_t* c, int L, uint64_t row_pos, uint64_t W) {
  const uint32_t starts = row_start_mask(row_pos, W);
  for (int i = 1; i < L; ++i)
    if (!((starts >> i) & 1u)) c[i] = (int32_t)((uint32_t)c[i] + (uint32_t)c[i - 1]);
}

}  // namespace szi
