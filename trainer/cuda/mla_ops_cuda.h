// Multi-latent attention's device ops (mla_cuda.cu), the CUDA twins of the pieces of trainer/cpu/mla_cpu.cpp that
// are not products or norms: the fused buffer the core attention reads assembled from the projections' outputs with
// MLA's rotary embedding, its gradient split back, and the latent's columns copied out of the down projection's rows.
// The rotations round every product and sum apart (__fmul_rn, __fadd_rn): the CPU op's fp32 arithmetic, bit for bit.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "trainer/cuda/cuda_common.h"

namespace ptk::cuda {

// One pass's shape: n = b * t token rows (row i at position i % t), this rank's heads, cpu::MlaSettings' widths.
struct MlaDims {
  int64_t n = 0, t = 0, heads = 0, qk = 0, pe = 0, v = 0, kv_lora = 0;
  int64_t dq() const { return qk + pe; }
  int64_t head() const { return 2 * dq() + v; }  // a head's channels in the fused buffer: query, key, value
  int64_t width() const { return heads * head(); }
  int64_t kv_down_rows() const { return kv_lora + pe; }
  int64_t kv_up_rows() const { return heads * (qk + v); }
};

// qkv (n, width) from q (n, heads x dq), kvu (n, kv_up_rows: per head its key's qk and value's v channels) and kvd
// (n, kv_down_rows: the rotary key's pe channels last), cos/sin (t, pe / 2): per head its query (the last pe
// channels rotated), its key (kvu's qk channels, then the token's shared rotary key) and its value (cpu's
// MlaQkvForward's loop).
template <typename T>
absl::Status MlaAssembleQkv(T* qkv, const T* q, const T* kvu, const T* kvd, const float* cos, const float* sin,
                            const MlaDims& d, const CudaContext& ctx);
// The transpose: dq (n, heads x dq) and dkvu (n, kv_up_rows) assigned from dqkv; the rotary key's pe columns of dkvd
// (n, kv_down_rows) assigned the heads' rotated-back gradients summed in head order (the first kv_lora columns are
// not written).
template <typename T>
absl::Status MlaSplitQkvGrad(T* dq, T* dkvu, T* dkvd, const T* dqkv, const float* cos, const float* sin,
                             const MlaDims& d, const CudaContext& ctx);
// out(n, cols) with row stride out_stride = in(n, cols) with row stride in_stride (the latent's columns of kvd out,
// or its gradient's back in).
template <typename T>
absl::Status CopyColumns(T* out, int64_t out_stride, const T* in, int64_t in_stride, int64_t n, int64_t cols,
                         const CudaContext& ctx);

}  // namespace ptk::cuda
