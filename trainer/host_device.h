// PTK_HD: marks the per-element math that both backends share as callable from host and device
// code, so the CPU tests cover the exact functions the CUDA kernels run. Always inlined, on the host
// too: the CPU's vector clones (target_clones) pass them 64-byte vectors, which a call from an avx512f
// clone to a default-target function would pass by another convention (trainer/cpu/cpu_lanes.h).
#pragma once

#if defined(__CUDACC__)
#define PTK_HD __host__ __device__ __forceinline__
#else
#define PTK_HD inline __attribute__((always_inline))
#endif
