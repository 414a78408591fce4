// The host side of matmul_cuda.cu's cuBLASLt plans: a product's description, the key its cached
// plan is found by, and the reduction schemes its algorithm search may choose. Host code only,
// checked on the CPU (tests/trainer/cuda_gemm_plan_test.cpp) wherever the CUDA backend is built: a
// key that left out a setting would hand one setting's algorithm to another without a sign.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <tuple>

#include "absl/status/statusor.h"
#include "trainer/cuda/cuda_common.h"

namespace ptk::cuda::gemm_detail {

// D = alpha op(A) op(B) + beta C in cuBLAS's column-major terms (matmul_cuda.cu's opening comment
// maps ptk's row-major products onto them).
struct GemmSpec {
  cublasOperation_t trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  cudaDataType_t ab_type, c_type;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // BIAS epilogues
  void* aux = nullptr;         // GELU_AUX epilogues (ld = m)
};

// Largest power of two (at most 256) that divides the address: what cuBLASLt's MIN_ALIGNMENT
// preferences ask for (their default, 256, would exclude every algorithm for a sub-view).
inline uint32_t AlignmentOf(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  if (v == 0) return 256;
  uint32_t a = 1;
  while (a < 256 && v % (2 * static_cast<uintptr_t>(a)) == 0) a *= 2;
  return a;
}

// The split-K reduction schemes (CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK) a product's algorithm
// may use; a scheme of 0 (CUBLASLT_REDUCTION_SCHEME_NONE, no split-K reduction) is always allowed.
//   deterministic (--deterministic-mode): none (cuBLASLt orders split-K sums anyway; the
//     conservative choice).
//   disallow_reduced_precision_reduction (--disable-bf16-reduced-precision-matmul with --bf16,
//     torch's allow_bf16_reduced_precision_reduction = False) and an output narrower than the fp32
//     compute type (bf16, fp16): the partial sums in the compute type only (COMPUTE_TYPE), never in
//     the output type: not OUTPUT_TYPE, and not INPLACE either, which (cublasLt.h) accumulates in
//     the output buffer and so in the output type. An fp32 output (the weight gradients) reduces in
//     fp32 whatever the scheme.
//   otherwise every scheme (cuBLASLt's default).
inline uint32_t ReductionSchemeMask(bool deterministic, bool disallow_reduced_precision_reduction,
                                    cudaDataType_t c_type) {
  if (deterministic) return CUBLASLT_REDUCTION_SCHEME_NONE;
  if (disallow_reduced_precision_reduction && c_type != CUDA_R_32F) return CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  return CUBLASLT_REDUCTION_SCHEME_MASK;
}

// What a cached plan was built for: the product, the pointers' alignments, and every setting of the
// context that steers the algorithm search (workspace, reduction schemes).
struct PlanKey {
  int device;
  const void* handle;
  int trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  int ab_type, c_type, epilogue;
  uint32_t align_a, align_b, align_c, align_bias, align_aux;
  size_t workspace_bytes;
  uint32_t reduction_schemes;  // ReductionSchemeMask's: --deterministic-mode and the bf16 reduction flag
  auto Tie() const {
    return std::tie(device, handle, trans_a, trans_b, m, n, k, lda, ldb, ldc, ab_type, c_type, epilogue, align_a,
                    align_b, align_c, align_bias, align_aux, workspace_bytes, reduction_schemes);
  }
  bool operator<(const PlanKey& o) const { return Tie() < o.Tie(); }
  bool operator==(const PlanKey& o) const { return Tie() == o.Tie(); }
};

inline PlanKey MakePlanKey(const GemmSpec& g, const void* A, const void* B, const void* C, const CudaContext& ctx) {
  return PlanKey{ctx.device,
                 ctx.cublaslt,
                 static_cast<int>(g.trans_a),
                 static_cast<int>(g.trans_b),
                 g.m,
                 g.n,
                 g.k,
                 g.lda,
                 g.ldb,
                 g.ldc,
                 static_cast<int>(g.ab_type),
                 static_cast<int>(g.c_type),
                 static_cast<int>(g.epilogue),
                 AlignmentOf(A),
                 AlignmentOf(B),
                 AlignmentOf(C),
                 g.bias ? AlignmentOf(g.bias) : 0u,
                 g.aux ? AlignmentOf(g.aux) : 0u,
                 ctx.workspace ? ctx.workspace_bytes : 0,
                 ReductionSchemeMask(ctx.deterministic, ctx.disallow_reduced_precision_reduction, g.c_type)};
}

// The algorithm MatmulForward's plain product (no bias, no GELU) of these pointers and sizes runs,
// from the plan cache (planned now if new): whether cuBLASLt has one (else cublasGemmEx runs), its
// number of K splits and their reduction scheme (CUBLASLT_ALGO_CONFIG_SPLITK_NUM and
// CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME). For the gpu tests (matmul_reduction_cuda_test.cpp).
struct GemmAlgoChoice {
  bool cublaslt = false;
  int32_t splitk = 1;
  uint32_t reduction_scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
};
template <typename T>
absl::StatusOr<GemmAlgoChoice> MatmulForwardAlgo(const T* inp, const T* w, T* out, int64_t n, int64_t ic, int64_t oc,
                                                 const CudaContext& ctx);

}  // namespace ptk::cuda::gemm_detail
