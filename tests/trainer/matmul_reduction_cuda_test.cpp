// --disable-bf16-reduced-precision-matmul on the CUDA products (matmul_cuda.cu, gemm_plan.h): bf16
// products of few outputs over a long inner dimension, the shapes for which cuBLASLt's heuristic
// splits K, run with CudaContext::disallow_reduced_precision_reduction; gpu-labelled (exit 77 without
// a device). Part of matmul_attention_cuda_test.
//
// The inputs make a bf16 reduction show: inp and w in [0.5, 1), w negated over the second half of
// the inner dimension k, so each output is a sum of about +0.28 k (the first half) and -0.28 k (the
// second): the partial sums of a split are thousands (18432 at k = 65536) while the result is tens.
// A partial sum rounded to bf16 (8 significant bits) errs by up to 2^-8 of itself: 32 to 64 at these
// sizes. The reference is in double on the same bf16 inputs. Tolerance per element: 2^-8 |ref| (the
// result's own rounding to bf16, with room) + 2e-4 * mag, mag = the product of the absolute values
// (about 0.56 k, so 7.4 at k = 65536): room for the fp32 accumulation in any order, truncating
// tensor-core accumulators included, and under a quarter of what a bf16-rounded partial sum errs by.
// The chosen algorithm's reduction scheme (CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) is never
// OUTPUT_TYPE, nor INPLACE (which accumulates in the output buffer, in its type: cublasLt.h).
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/attention_cuda_test_util.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cuda/gemm_plan.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using cuda_test::Abs;
using cuda_test::DeviceBuffer;
using cuda_test::Gpu;
using cuda_test::Random;
using cuda_test::ToDouble;
using cuda_test::ToT;
using gemm_detail::GemmAlgoChoice;
using gemm_detail::MatmulForwardAlgo;

struct LongProduct {
  int64_t n, ic, oc;  // rows, inner dimension (cuBLAS's k), outputs
};
// Small M = oc and N = n, large K = ic.
const LongProduct kShapes[] = {{16, 65536, 64}, {8, 16384, 128}, {32, 32768, 32}};

std::string SchemeName(uint32_t s) {
  switch (s) {
    case CUBLASLT_REDUCTION_SCHEME_NONE: return "NONE";
    case CUBLASLT_REDUCTION_SCHEME_INPLACE: return "INPLACE";
    case CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE: return "COMPUTE_TYPE";
    case CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE: return "OUTPUT_TYPE";
    default: return "scheme " + std::to_string(s);
  }
}

TEST(MatmulReductionCuda, Bf16ProductsNeverReduceInBf16WithTheFlag) {
  for (const LongProduct& s : kShapes) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " ic=" + std::to_string(s.ic) + " oc=" + std::to_string(s.oc));
    // inp in [0.5, 1); w in [0.5, 1) over the first half of each row's inner dimension, negated over the second.
    std::vector<float> w = Random(s.oc * s.ic, 31, 0.5f, 1.0f);
    for (int64_t o = 0; o < s.oc; ++o)
      for (int64_t j = s.ic / 2; j < s.ic; ++j) w[o * s.ic + j] = -w[o * s.ic + j];
    const auto inp = ToT<__nv_bfloat16>(Random(s.n * s.ic, 32, 0.5f, 1.0f)), wb = ToT<__nv_bfloat16>(w);
    const auto xi = ToDouble(inp), xw = ToDouble(wb), ai = Abs(xi), aw = Abs(xw);
    std::vector<double> ref(s.n * s.oc), mag(s.n * s.oc);
    cpu::MatmulForward<double>(ref.data(), xi.data(), xw.data(), nullptr, s.n, s.ic, s.oc);
    cpu::MatmulForward<double>(mag.data(), ai.data(), aw.data(), nullptr, s.n, s.ic, s.oc);

    DeviceBuffer<__nv_bfloat16> d_inp(inp), d_w(wb), d_out(s.n * s.oc);
    {  // without the flag: what cuBLASLt chooses, for the record
      Gpu gpu;
      auto choice = MatmulForwardAlgo<__nv_bfloat16>(d_inp.get(), d_w.get(), d_out.get(), s.n, s.ic, s.oc, gpu.ctx);
      STATUS_OK(choice.status());
      std::cout << "without the flag: cuBLASLt " << choice->cublaslt << ", " << choice->splitk << " K splits, "
                << SchemeName(choice->reduction_scheme) << "\n";
    }
    Gpu gpu;
    gpu.ctx.disallow_reduced_precision_reduction = true;
    STATUS_OK(MatmulForward<__nv_bfloat16>(d_out.get(), d_inp.get(), d_w.get(), nullptr, s.n, s.ic, s.oc, gpu.ctx));
    const std::vector<__nv_bfloat16> got = d_out.Download();
    auto choice = MatmulForwardAlgo<__nv_bfloat16>(d_inp.get(), d_w.get(), d_out.get(), s.n, s.ic, s.oc, gpu.ctx);
    STATUS_OK(choice.status());
    const GemmAlgoChoice& c = *choice;
    std::cout << "with the flag: cuBLASLt " << c.cublaslt << ", " << c.splitk << " K splits, "
              << SchemeName(c.reduction_scheme) << "\n";
    EXPECT_TRUE(c.cublaslt) << "cuBLASLt found no algorithm: the product ran through cublasGemmEx";
    EXPECT_NE(c.reduction_scheme, static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE));
    EXPECT_NE(c.reduction_scheme, static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_INPLACE));
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double g = static_cast<double>(ToFloat(got[i])), tol = std::ldexp(std::fabs(ref[i]), -8) + 2e-4 * mag[i];
      if (!(std::fabs(g - ref[i]) <= tol) && ++bad <= 5)
        ADD_FAILURE() << "out[" << i << "]: got " << g << ", want " << ref[i] << " (tolerance " << tol << ")";
    }
    EXPECT_EQ(bad, 0) << bad << " of " << got.size() << " outside tolerance";
  }
}

}  // namespace
}  // namespace ptk::cuda
