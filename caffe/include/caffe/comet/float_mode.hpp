#ifndef CAFFE_COMET_FLOAT_MODE_HPP_
#define CAFFE_COMET_FLOAT_MODE_HPP_

// COMET-Caffe: a thread's floating-point mode (x86's MXCSR), so that a CPU training step with a
// store runs with denormals flushed to zero. Measured (docs/comet.md, "A quieter machine"): with
// the adaptive bounds, weight gradients of GoogLeNet's inception layers came out denormal (up to
// 18% of a blob's values), and OpenBLAS's products with denormal results ran at half speed
// (GoogLeNet 6.8 s a step against 5.0 with every thread flushed, ResNet-18 4.7 against 4.3).
// Elsewhere (no SSE) these do nothing.

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define COMET_HAVE_MXCSR 1
#endif

namespace caffe {

// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6); its low six bits are sticky
// exception flags, not part of the mode a thread is set to.
const unsigned kCometFlushBits = 0x8040u;
const unsigned kCometFloatFlags = 0x3Fu;

// The calling thread's mode, to be given back with CometSetFloatMode (0 where there is none).
inline unsigned CometFloatMode() {
#ifdef COMET_HAVE_MXCSR
  return _mm_getcsr();
#else
  return 0;
#endif
}

inline void CometSetFloatMode(unsigned mode) {
#ifdef COMET_HAVE_MXCSR
  if (_mm_getcsr() != mode) _mm_setcsr(mode);
#else
  (void)mode;
#endif
}

// Flush-to-zero (results) and denormals-are-zero (inputs) on the calling thread; returns the
// mode it had.
inline unsigned CometFlushDenormals() {
  const unsigned before = CometFloatMode();
#ifdef COMET_HAVE_MXCSR
  _mm_setcsr(before | kCometFlushBits);
#endif
  return before;
}

}  // namespace caffe

#endif  // CAFFE_COMET_FLOAT_MODE_HPP_
