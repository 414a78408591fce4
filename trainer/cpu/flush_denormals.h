// Denormal (subnormal) floats, below 1.2e-38 in fp32, are handled by x86's SSE/AVX units through a slow
// microcode path, about 100 times slower per operation. A run whose weights blow up (ptk-train --lr 1e6)
// feeds its matrix products gradients of that size: an iteration took 63 s instead of 0.6 s. The CPU
// trainer's products therefore run with flush-to-zero and denormals-are-zero (their values, which cannot
// change a training step, read and written as 0), on the thread that computes them and only while it
// does: a library sets no process-wide floating-point state.
#pragma once

#if defined(__SSE2__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace ptk::cpu {

// For its lifetime: the calling thread's MXCSR with FTZ (bit 15) and DAZ (bit 6) set; the thread's own
// MXCSR (rounding mode, exception masks, its own FTZ/DAZ) put back when it goes. Elsewhere than x86: nothing.
class ScopedFlushDenormals {
 public:
#if defined(__SSE2__) || defined(__x86_64__)
  static constexpr unsigned kFtzDaz = 0x8040u;
  ScopedFlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtzDaz); }
  ~ScopedFlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#else
  ScopedFlushDenormals() = default;
#endif
 public:
  ScopedFlushDenormals(const ScopedFlushDenormals&) = delete;
  ScopedFlushDenormals& operator=(const ScopedFlushDenormals&) = delete;
};

}  // namespace ptk::cpu
