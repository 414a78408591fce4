// The host side of the CUDA products' cuBLASLt plans (trainer/cuda/gemm_plan.h), checked on the CPU
// wherever the CUDA backend is built: the reduction schemes each setting allows, the plan cache's key
// holding every setting that steers the algorithm search, and --disable-bf16-reduced-precision-matmul
// carried from the run's backend options to the CUDA model's (a setting dropped on the way would
// show on a GPU only as a product summed in bf16).
#include "trainer/cuda/gemm_plan.h"

#include <gtest/gtest.h>

#include "trainer/backend.h"
#include "trainer/cuda/backend_module.h"
#include "trainer/cuda/cuda_gpt_model.h"

namespace ptk::cuda {
namespace {

using gemm_detail::GemmSpec;
using gemm_detail::MakePlanKey;
using gemm_detail::PlanKey;
using gemm_detail::ReductionSchemeMask;

constexpr uint32_t kOutputTypeSchemes = CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE | CUBLASLT_REDUCTION_SCHEME_INPLACE;

TEST(CudaGemmPlan, ReductionSchemesByDefaultAreCublasLtsOwn) {
  for (cudaDataType_t t : {CUDA_R_32F, CUDA_R_16BF, CUDA_R_16F})
    EXPECT_EQ(ReductionSchemeMask(false, false, t), static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_MASK));
}

// --disable-bf16-reduced-precision-matmul: a bf16 (or fp16) output's partial sums in the compute type
// only; OUTPUT_TYPE sums them in bf16, and so does INPLACE (in the output buffer, cublasLt.h).
TEST(CudaGemmPlan, DisallowedReducedPrecisionLeavesOnlyComputeTypeSumsForA16BitOutput) {
  for (cudaDataType_t t : {CUDA_R_16BF, CUDA_R_16F}) {
    const uint32_t mask = ReductionSchemeMask(false, true, t);
    EXPECT_EQ(mask, static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
    EXPECT_EQ(mask & kOutputTypeSchemes, 0u);
  }
  // An fp32 output (the weight gradients' products) sums in fp32 whatever the scheme.
  EXPECT_EQ(ReductionSchemeMask(false, true, CUDA_R_32F), static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_MASK));
}

TEST(CudaGemmPlan, DeterministicModeAllowsNoSplitKReduction) {
  for (bool disallow : {false, true})
    for (cudaDataType_t t : {CUDA_R_32F, CUDA_R_16BF})
      EXPECT_EQ(ReductionSchemeMask(true, disallow, t), static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE));
}

// A bf16 forward product with small outputs and a long inner dimension (where split-K pays), its
// pointers 256-byte aligned.
struct Product {
  GemmSpec spec{CUBLAS_OP_T, CUBLAS_OP_N, 64, 16, 65536, 65536, 65536, 64, CUDA_R_16BF, CUDA_R_16BF};
  const void* a = reinterpret_cast<const void*>(uintptr_t{1} << 20);
  const void* b = reinterpret_cast<const void*>(uintptr_t{2} << 20);
  const void* c = reinterpret_cast<const void*>(uintptr_t{3} << 20);
  PlanKey Key(const CudaContext& ctx) const { return MakePlanKey(spec, a, b, c, ctx); }
};

// The plan cache is keyed by the setting: a plan searched without the restriction (which may sum in
// bf16) is never handed to a run with the flag, nor the other way round.
TEST(CudaGemmPlan, TheBf16ReductionFlagIsPartOfThePlanKey) {
  const Product p;
  CudaContext plain, exact;
  exact.disallow_reduced_precision_reduction = true;
  const PlanKey a = p.Key(plain), b = p.Key(exact);
  EXPECT_FALSE(a == b);
  EXPECT_TRUE(a < b || b < a);
  EXPECT_EQ(b.reduction_schemes, static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
  CudaContext exact_again;
  exact_again.disallow_reduced_precision_reduction = true;
  EXPECT_TRUE(p.Key(exact_again) == b);  // the same setting finds the same plan
}

TEST(CudaGemmPlan, DeterministicModeIsPartOfThePlanKey) {
  const Product p;
  CudaContext plain, deterministic;
  deterministic.deterministic = true;
  EXPECT_FALSE(p.Key(plain) == p.Key(deterministic));
}

// An fp32 output's search is the same with or without the flag: one plan serves both.
TEST(CudaGemmPlan, AnFp32OutputSharesItsPlanAcrossTheFlag) {
  Product p;
  p.spec.c_type = CUDA_R_32F;
  CudaContext plain, exact;
  exact.disallow_reduced_precision_reduction = true;
  EXPECT_TRUE(p.Key(plain) == p.Key(exact));
}

// --disable-bf16-reduced-precision-matmul from the run's backend options (ptk-train sets it with
// --bf16 only) to what the module is asked for, and from there to the CUDA model's options.
TEST(CudaGemmPlan, TheFlagReachesTheCudaModelOptions) {
  BackendOptions backend;
  backend.device = Device::kCuda;
  backend.precision = Precision::kBf16;
  EXPECT_FALSE(CudaModelOptionsOf(CudaModuleOptions(backend)).disable_bf16_reduced_precision_matmul);
  backend.disable_bf16_reduced_precision_matmul = true;
  const ModelOptions module = CudaModuleOptions(backend);
  EXPECT_TRUE(module.disable_bf16_reduced_precision_matmul);
  EXPECT_EQ(module.precision, Precision::kBf16);
  EXPECT_TRUE(CudaModelOptionsOf(module).disable_bf16_reduced_precision_matmul);
}

}  // namespace
}  // namespace ptk::cuda
