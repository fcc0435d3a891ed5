// quantizer.h - stage 1: linear-scaling quantization with an exact-bound check.
//
// A value x becomes the integer q = round(x / (2 eb)); it is reconstructed as
// recon(q) = float(q) * (2 eb) in IEEE single precision with no contraction, on host and
// device alike. The quantizer verifies |x - recon(q)| <= eb (in double, exact for two floats
// this close) and corrects q by one step when float rounding put it on the wrong side; when
// that still fails, or x is NaN/Inf, or |q| would exceed 2^29, the value is an outlier and the
// caller stores its block verbatim. Zero maps to q = 0 and back to +0 exactly.
#pragma once
#include "common.h"

namespace szi {

constexpr float kQMax = 536870912.0f;  // 2^29: |q| stays below, so deltas fit 31 bits

struct QuantParams {
  float eb;          // guaranteed absolute bound (float, <= the caller's bound)
  float two_eb;      // quantization step
  float inv_two_eb;  // 1 / two_eb (+inf when eb == 0: everything becomes an outlier)
};

SZ_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;  // built with -ffp-contract=off
#endif
}

SZ_HD float recon(int32_t q, float two_eb) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(__int2float_rn(q), two_eb);
#else
  return (float)q * two_eb;
#endif
}

// Largest float <= eb, capped to 2^120 so 2*eb never overflows. Negative/NaN -> 0.
SZ_HD float eb_to_float(double eb) {
  if (!(eb > 0.0)) return 0.0f;
  if (eb > 1.329227995784916e36) eb = 1.329227995784916e36;  // 2^120
  float f = (float)eb;
  if ((double)f > eb) f = nextafterf(f, 0.0f);
  return f;
}

SZ_HD QuantParams make_quant_params(float eb_f) {
  QuantParams p;
  p.eb = eb_f;
  p.two_eb = 2.0f * eb_f;
  p.inv_two_eb = eb_f > 0.0f ? 1.0f / p.two_eb : INFINITY;
  if (!(p.inv_two_eb < INFINITY)) p.inv_two_eb = INFINITY;  // denormal step: all outliers
  return p;
}

// Relative mode: absolute bound from the finite value range. Constant tensors use the
// magnitude instead; an all-zero tensor gets rel itself (any positive bound keeps zeros exact).
SZ_HD double rel_to_abs(double rel, double vmin, double vmax, bool any_finite) {
  if (!any_finite) return rel;
  double range = vmax - vmin;
  if (range > 0.0) return rel * range;
  double mag = fabs(vmin);
  return mag > 0.0 ? rel * mag : rel;
}

// Returns false for an outlier (caller stores the block verbatim).
SZ_HD bool quantize(float x, const QuantParams& p, int32_t* q) {
  float t = mul_rn(x, p.inv_two_eb);
  if (!(fabsf(t) < kQMax)) return false;  // NaN, Inf, or too large
#ifdef __CUDA_ARCH__
  int32_t qi = __float2int_rn(t);
#else
  // round half to even, like __float2int_rn: |t| + 2^23 has no fraction bits left
  float a = fabsf(t);
  if (a < 8388608.0f) a = (a + 8388608.0f) - 8388608.0f;
  float r = copysignf(a, t);
  int32_t qi = (int32_t)r;
#endif
  double d = (double)x - (double)recon(qi, p.two_eb);
  if (!(fabs(d) <= (double)p.eb)) {
    qi += d > 0 ? 1 : -1;
    d = (double)x - (double)recon(qi, p.two_eb);
    if (!(fabs(d) <= (double)p.eb)) return false;
  }
  *q = qi;
  return true;
}

// Quantizes a block of L values. The first loop is all float and branch-free so compilers
// vectorize it. Its test fl(|x - recon|) < eb is conservative: IEEE subtraction rounds
// monotonically, so a passing value truly has |x - recon| < eb; a value that fails (or
// NaN/Inf/too large) flags the block, which then takes the exact per-value path above.
// Either way the codes equal those of quantize() value by value. quantize_block_fast is the
// first loop alone: false when it flagged a value (q is then not to be used).
SZ_HD bool quantize_block_fast(const float* x, int L, const QuantParams& p, int32_t* q) {
  int flagged = 0;
  for (int i = 0; i < L; ++i) {
    float t = mul_rn(x[i], p.inv_two_eb);
    float a = fabsf(t);
    int valid = a < kQMax;
#ifdef __CUDA_ARCH__
    int32_t qi = valid ? __float2int_rn(t) : 0;
    float d = __fsub_rn(x[i], recon(qi, p.two_eb));
#else
    float ac = a < kQMax ? a : kQMax;  // NaN -> kQMax: the conversion below stays defined
    float rr = ac < 8388608.0f ? (ac + 8388608.0f) - 8388608.0f : ac;
    int32_t qi = (int32_t)copysignf(rr, t) & -valid;
    float d = x[i] - recon(qi, p.two_eb);
#endif
    flagged |= !(fabsf(d) < p.eb) | !valid;
    q[i] = qi;
  }
  return !flagged;
}

// Returns false when the block holds an outlier.
SZ_HD bool quantize_block(const float* x, int L, const QuantParams& p, int32_t* q) {
  if (quantize_block_fast(x, L, p, q)) return true;
  for (int i = 0; i < L; ++i)
    if (!quantize(x[i], p, &q[i])) return false;
  return true;
}

}  // namespace szi
