// PTK_HD: marks the per-element math that both backends share as callable from host and device
// code, so the CPU tests cover the exact functions the CUDA kernels run.
#pragma once

#if defined(__CUDACC__)
#define PTK_HD __host__ __device__ __forceinline__
#else
#define PTK_HD inline
#endif
