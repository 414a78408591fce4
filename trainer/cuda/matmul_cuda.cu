// Matrix products through cuBLASLt, forward and backward, beside trainer/cpu/matmul_cpu.cpp.
//
// ptk's matrices are row-major, cuBLAS's column-major: a row-major X(r, c) is, byte for byte, the
// column-major X^T(c, r) with leading dimension c. Each product is therefore written for the
// transposes (cuBLAS sizes m x n x k, "stored" = the column-major matrix the bytes are):
//   forward  out^T(oc, n)  = w(oc, ic) inp^T(ic, n)     A = w   stored (ic, oc), op T   B = inp  stored (ic, n), op N
//   dinp     dinp^T(ic, n) = w^T(ic, oc) dout^T(oc, n)  A = w   stored (ic, oc), op N   B = dout stored (oc, n), op N
//   dw       dw^T(ic, oc)  = inp^T(ic, n) dout(n, oc)   A = inp stored (ic, n),  op N   B = dout stored (oc, n), op T
// The bias of the forward is one value per row of out^T (cuBLASLt's BIAS epilogue: a vector as long
// as D has rows); GELU_AUX(_BIAS) writes GELU(out) to D and the pre-activation to the aux matrix.
//
// Precision: CUBLAS_COMPUTE_32F with fp32 scale for every type. fp32 mode is plain fp32 (never
// TF32: the compute type alone decides in cuBLASLt, and the cuBLAS fallback asks for
// CUBLAS_COMPUTE_32F_PEDANTIC). bf16/fp16: inputs in T, fp32 accumulation, out/dinp rounded to T,
// dw accumulated (beta = 1) straight into the fp32 gradient (A/B in T with C/D in CUDA_R_32F).
//
// Algorithms come from cublasLtMatmulAlgoGetHeuristic with the context's workspace and the
// pointers' real alignment, once per shape (a small cache, negative answers included); a shape
// cuBLASLt has no algorithm for falls back to cublasGemmEx (the same types) and, for the
// epilogues, to the separate bias and GELU kernels below. The split-K reduction schemes the search
// may choose are gemm_plan.h's ReductionSchemeMask: none with ctx.deterministic; with
// ctx.disallow_reduced_precision_reduction (--disable-bf16-reduced-precision-matmul) a bf16/fp16
// output's partial sums in fp32 only, as the cuBLAS handle's CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
// (the model sets it) asks of the cublasGemmEx fallback.
// dbias is a column-sum kernel (fp32, a fixed order) rather than the BGRADB epilogue, which
// assigns instead of accumulating and rounds to the output type.
//
// GELU: fp32 mode always runs the separate kernel (GeluValue of trainer/op_math.h, the CPU's own
// formula), so fp32 stays within rounding of the CPU. bf16/fp16 use cuBLASLt's GELU_AUX(_BIAS)
// epilogue where it applies (the tanh approximation, as Megatron's bias-GELU): GELU is computed from
// the fp32 accumulator, whereas the separate kernel (the fallback) computes it from the
// pre-activation already rounded to T; the two differ by about one rounding of T.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <fmt/core.h>

#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include "common/logging.h"
#include "common/status.h"
#include "trainer/cuda/gemm_plan.h"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/op_math.h"

namespace ptk::cuda {
namespace {

using gemm_detail::AlignmentOf;
using gemm_detail::GemmSpec;
using gemm_detail::MakePlanKey;
using gemm_detail::PlanKey;
using gemm_detail::ReductionSchemeMask;

template <typename T>
constexpr const char* TypeLabel() {
  if constexpr (std::is_same_v<T, float>)
    return "fp32";
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return "bf16";
  else
    return "fp16";
}

// ---- kernels -----------------------------------------------------------------------------------

// gelu_out[i] = GeluValue(out[i]) in fp32, rounded to T.
template <typename T>
__global__ void GeluKernel(T* __restrict__ gelu_out, const T* __restrict__ pre, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    gelu_out[i] = FromFloat<T>(GeluValue<float>(ToFloat(pre[i])));
}

// out(n, oc) = bias broadcast over the rows (the CPU's order: bias first, then C += A B).
template <typename T>
__global__ void BroadcastRowsKernel(T* __restrict__ out, const T* __restrict__ bias, int64_t n, int64_t oc) {
  const int64_t total = n * oc, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride)
    out[i] = bias[i % oc];
}

// dbias[j] += sum over the n rows of dout[i, j], in a fixed order: blocks of 32 columns x a chunk of
// kChunkRows rows, 32 row lanes each summing every 32nd row of the chunk in double, lane sums added
// in lane order; then the chunks' sums added in chunk order (a second kernel, the partial sums in
// the context's workspace, which no library call is using between calls on the stream). The order
// depends only on n and on whether the workspace holds the partials, so the same inputs give the
// same bits. As the CPU: the sum in double, rounded once to fp32 and added.
constexpr int kColTile = 32, kRowLanes = 32;
constexpr int64_t kChunkRows = 512;
template <typename T>
__global__ void ColumnSumKernel(double* __restrict__ partial, float* __restrict__ dbias, const T* __restrict__ dout,
                                int64_t n, int64_t oc, int64_t chunk_rows) {
  __shared__ double lanes[kRowLanes][kColTile + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < n ? r0 + chunk_rows : n;
  double acc = 0.0;
  if (col < oc)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) acc += static_cast<double>(ToFloat(dout[r * oc + col]));
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < oc) {
    double sum = 0.0;
    for (int y = 0; y < kRowLanes; ++y) sum += lanes[y][threadIdx.x];
    if (partial)
      partial[static_cast<int64_t>(blockIdx.y) * oc + col] = sum;
    else
      dbias[col] = dbias[col] + static_cast<float>(sum);
  }
}
__global__ void ColumnSumFinishKernel(float* __restrict__ dbias, const double* __restrict__ partial, int64_t chunks,
                                      int64_t oc) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= oc) return;
  double sum = 0.0;
  for (int64_t k = 0; k < chunks; ++k) sum += partial[k * oc + col];
  dbias[col] = dbias[col] + static_cast<float>(sum);
}

unsigned Blocks(int64_t work, int threads) {
  int64_t b = CeilDiv(work, threads);
  if (b < 1) b = 1;
  if (b > 65535 * 8) b = 65535 * 8;
  return static_cast<unsigned>(b);
}

// ---- cuBLASLt plans ----------------------------------------------------------------------------

struct Plan {
  bool supported = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// Plans live for the process (descriptors are host objects; never destroyed at exit, so no
// static-destruction order matters). One mutex covers the cache and each call's use of a plan's
// descriptor (its bias/aux pointers are set per call).
std::mutex& PlanMutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<PlanKey, Plan>& PlanCache() {
  static auto* cache = new std::map<PlanKey, Plan>;
  return *cache;
}

// Builds the descriptors and asks the heuristic for the best algorithm; plan->supported stays
// false when cuBLASLt has none for this combination (not an error: the caller falls back).
absl::Status BuildPlan(const GemmSpec& g, const void* A, const void* B, const void* C, const CudaContext& ctx,
                       const std::string& where, Plan* plan) {
  cublasLtMatmulDesc_t desc = nullptr;
  PTK_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), where);
  plan->desc = desc;
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.trans_a, sizeof(g.trans_a)), where);
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.trans_b, sizeof(g.trans_b)), where);
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epilogue, sizeof(g.epilogue)), where);
  if (g.bias)
    PTK_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)), where);
  if (g.aux) {
    const int64_t aux_ld = g.m;
    PTK_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)), where);
    PTK_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)), where);
  }
  // Stored shapes: op(A) is m x k, so A is (m, k) for N and (k, m) for T; likewise B is (k, n) or (n, k).
  const bool ta = g.trans_a == CUBLAS_OP_T, tb = g.trans_b == CUBLAS_OP_T;
  PTK_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->a, g.ab_type, static_cast<uint64_t>(ta ? g.k : g.m),
                                                        static_cast<uint64_t>(ta ? g.m : g.k), g.lda),
                             where);
  PTK_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, g.ab_type, static_cast<uint64_t>(tb ? g.n : g.k),
                                                        static_cast<uint64_t>(tb ? g.k : g.n), g.ldb),
                             where);
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(&plan->c, g.c_type, static_cast<uint64_t>(g.m), static_cast<uint64_t>(g.n), g.ldc),
      where);

  cublasLtMatmulPreference_t pref = nullptr;
  PTK_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref), where);
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
  } guard{pref};
  const uint64_t ws = ctx.workspace ? static_cast<uint64_t>(ctx.workspace_bytes) : 0;
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), where);
  const uint32_t align_a = AlignmentOf(A), align_b = AlignmentOf(B), align_c = AlignmentOf(C);
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)),
      where);
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)),
      where);
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)),
      where);
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)),
      where);
  const uint32_t schemes = ReductionSchemeMask(ctx.deterministic, ctx.disallow_reduced_precision_reduction, g.c_type);
  if (schemes != CUBLASLT_REDUCTION_SCHEME_MASK) {
    PTK_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                                    &schemes, sizeof(schemes)),
                               where);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt, desc, plan->a, plan->b, plan->c, plan->c, pref, 1, &result, &found);
  // No algorithm (NOT_SUPPORTED, or an epilogue/type combination this cuBLASLt rejects as
  // INVALID_VALUE): unsupported, plan->supported stays false and the caller falls back to
  // cublasGemmEx and the separate kernels, which fail loudly if the product itself is invalid.
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE ||
      (st == CUBLAS_STATUS_SUCCESS && (found == 0 || result.state != CUBLAS_STATUS_SUCCESS)))
    return absl::OkStatus();
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError(st, "cublasLtMatmulAlgoGetHeuristic", where);
  plan->algo = result.algo;
  plan->supported = true;
  return absl::OkStatus();
}

const char* EpilogueName(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_BIAS: return "bias";
    case CUBLASLT_EPILOGUE_GELU_AUX: return "GELU_AUX";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "GELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DGELU: return "DGELU";
    default: return "none";
  }
}
const char* TypeName(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return "fp32";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_16F: return "fp16";
    default: return "?";
  }
}

// A product cuBLASLt found no algorithm for: counted in the model's GemmFallbacks, warned about
// the first time this (op, shape, types, epilogue) falls back.
void NoteFallback(const GemmSpec& g, const CudaContext& ctx, const std::string& where) {
  const std::string what =
      fmt::format("{}: cuBLAS m={} n={} k={} op(A)={} op(B)={}, A/B {}, C/D {}, epilogue {}", where, g.m, g.n, g.k,
                  g.trans_a == CUBLAS_OP_T ? "T" : "N", g.trans_b == CUBLAS_OP_T ? "T" : "N", TypeName(g.ab_type),
                  TypeName(g.c_type), EpilogueName(g.epilogue));
  if (ctx.fallbacks && !ctx.fallbacks->Note(what)) return;
  if (!ctx.fallbacks) {  // no model to count it: warn once per process
    static std::mutex mu;
    static auto* seen = new std::map<std::string, int>;
    std::lock_guard<std::mutex> lock(mu);
    if ((*seen)[what]++ > 0) return;
  }
  log::Warning("cuBLASLt has no algorithm for {} on cuda:{}: falling back to cublasGemmEx{} (slower)", what, ctx.device,
               g.epilogue == CUBLASLT_EPILOGUE_DEFAULT ? "" : " and a separate kernel for the epilogue");
}

// The cached plan of this product (built on first use). The caller holds PlanMutex().
absl::StatusOr<Plan*> CachedPlan(const GemmSpec& g, const void* A, const void* B, const void* C, const CudaContext& ctx,
                                 const std::string& where) {
  if (!ctx.cublaslt) return absl::FailedPreconditionError(fmt::format("{}: the context has no cuBLASLt handle", where));
  const PlanKey key = MakePlanKey(g, A, B, C, ctx);
  auto& cache = PlanCache();
  auto it = cache.find(key);
  if (it == cache.end()) {
    Plan plan;
    absl::Status s = BuildPlan(g, A, B, C, ctx, where, &plan);
    if (!s.ok()) {
      if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
      if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
      if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
      if (plan.desc) cublasLtMatmulDescDestroy(plan.desc);
      return s;
    }
    it = cache.emplace(key, plan).first;
  }
  return &it->second;
}

// D = alpha op(A) op(B) + beta C (C = D), through a cached cuBLASLt plan. *ran is false when
// cuBLASLt has no algorithm for it (nothing was launched; the fallback is counted and warned).
absl::Status LtGemm(const GemmSpec& g, const void* A, const void* B, void* C, float alpha, float beta,
                    const CudaContext& ctx, const std::string& where, bool* ran) {
  *ran = false;
  std::lock_guard<std::mutex> lock(PlanMutex());
  PTK_ASSIGN_OR_RETURN(Plan * found, CachedPlan(g, A, B, C, ctx, where));
  Plan& plan = *found;
  if (!plan.supported) {
    NoteFallback(g, ctx, where);
    return absl::OkStatus();
  }
  if (g.bias)
    PTK_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)), where);
  if (g.aux)
    PTK_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)),
        where);
  const cublasStatus_t st =
      cublasLtMatmul(ctx.cublaslt, plan.desc, &alpha, A, plan.a, B, plan.b, &beta, C, plan.c, C, plan.c, &plan.algo,
                     ctx.workspace, ctx.workspace ? ctx.workspace_bytes : 0, ctx.stream);
  // A refusal at launch (the heuristic accepted the plan, but cublasLtMatmul's own checks reject
  // it, e.g. a bias or aux pointer less aligned than the algorithm needs: nothing was launched)
  // falls back as a heuristic refusal does, and the plan remembers it for this (shape, alignments).
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
    plan.supported = false;
    NoteFallback(g, ctx, where);
    return absl::OkStatus();
  }
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError(st, "cublasLtMatmul", where);
  *ran = true;
  return absl::OkStatus();
}

// The same product through cublasGemmEx (no epilogue): for shapes or type combinations cuBLASLt
// has no algorithm for.
absl::Status LegacyGemm(const GemmSpec& g, const void* A, const void* B, void* C, float alpha, float beta,
                        const CudaContext& ctx, const std::string& where) {
  if (!ctx.cublas)
    return absl::FailedPreconditionError(
        fmt::format("{}: cuBLASLt has no algorithm for this product and the context has no cuBLAS handle", where));
  for (int64_t v : {g.m, g.n, g.k, g.lda, g.ldb, g.ldc})
    if (v > INT_MAX)
      return absl::InvalidArgumentError(
          fmt::format("{}: cuBLASLt has no algorithm for this product and it is too large for cublasGemmEx", where));
  cudaStream_t current = nullptr;
  PTK_CUBLAS_RETURN_IF_ERROR(cublasGetStream(ctx.cublas, &current), where);
  if (current != ctx.stream) PTK_CUBLAS_RETURN_IF_ERROR(cublasSetStream(ctx.cublas, ctx.stream), where);
  const cublasComputeType_t compute =
      (g.ab_type == CUDA_R_32F && g.c_type == CUDA_R_32F) ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasGemmEx(ctx.cublas, g.trans_a, g.trans_b, static_cast<int>(g.m), static_cast<int>(g.n),
                   static_cast<int>(g.k), &alpha, A, g.ab_type, static_cast<int>(g.lda), B, g.ab_type,
                   static_cast<int>(g.ldb), &beta, C, g.c_type, static_cast<int>(g.ldc), compute, CUBLAS_GEMM_DEFAULT),
      where);
  return absl::OkStatus();
}

absl::Status Gemm(const GemmSpec& g, const void* A, const void* B, void* C, float alpha, float beta,
                  const CudaContext& ctx, const std::string& where) {
  bool ran = false;
  absl::Status s = LtGemm(g, A, B, C, alpha, beta, ctx, where, &ran);
  if (!s.ok() || ran) return s;
  GemmSpec plain = g;
  plain.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  plain.bias = nullptr;
  plain.aux = nullptr;
  return LegacyGemm(plain, A, B, C, alpha, beta, ctx, where);
}

// MatmulForward's product: out^T(oc, n) = w(oc, ic) inp^T(ic, n) (the opening comment's first line).
template <typename T>
GemmSpec ForwardSpec(int64_t n, int64_t ic, int64_t oc) {
  constexpr cudaDataType_t kType = CudaDataType<T>();
  return GemmSpec{CUBLAS_OP_T, CUBLAS_OP_N, oc, n, ic, ic, ic, oc, kType, kType};
}

}  // namespace

template <typename T>
absl::Status MatmulForward(T* out, const T* inp, const T* w, const T* bias, int64_t n, int64_t ic, int64_t oc,
                           const CudaContext& ctx, T* gelu_out) {
  const std::string where = fmt::format("MatmulForward<{}>(n={}, ic={}, oc={}{}{})", TypeLabel<T>(), n, ic, oc,
                                        bias ? ", bias" : "", gelu_out ? ", gelu" : "");
  if (n < 0 || ic <= 0 || oc <= 0)
    return absl::InvalidArgumentError(fmt::format("{}: sizes must be positive (n may be 0)", where));
  if (!out || !inp || !w) return absl::InvalidArgumentError(fmt::format("{}: out, inp and w must be set", where));
  if (n == 0) return absl::OkStatus();
  const GemmSpec g = ForwardSpec<T>(n, ic, oc);

  // bf16/fp16 with GELU: the fused epilogue first (D = gelu_out, aux = out, the pre-activation).
  if (gelu_out && !std::is_same_v<T, float> && oc % 8 == 0) {
    GemmSpec fused = g;
    fused.epilogue = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    fused.bias = bias;
    fused.aux = out;
    bool ran = false;
    if (absl::Status s = LtGemm(fused, w, inp, gelu_out, 1.0f, 0.0f, ctx, where, &ran); !s.ok()) return s;
    if (ran) return absl::OkStatus();
  }
  // out = inp w^T + bias: the BIAS epilogue, or (no algorithm for it) bias broadcast then beta = 1.
  bool done = false;
  if (bias) {
    GemmSpec with_bias = g;
    with_bias.epilogue = CUBLASLT_EPILOGUE_BIAS;
    with_bias.bias = bias;
    if (absl::Status s = LtGemm(with_bias, w, inp, out, 1.0f, 0.0f, ctx, where, &done); !s.ok()) return s;
    if (!done) {
      BroadcastRowsKernel<T><<<Blocks(n * oc, 256), 256, 0, ctx.stream>>>(out, bias, n, oc);
      PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
    }
  }
  if (!done)
    if (absl::Status s = Gemm(g, w, inp, out, 1.0f, bias ? 1.0f : 0.0f, ctx, where); !s.ok()) return s;
  if (gelu_out) {
    GeluKernel<T><<<Blocks(n * oc, 256), 256, 0, ctx.stream>>>(gelu_out, out, n * oc);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  }
  return absl::OkStatus();
}

// dbias += the column sums of dout (n > 0 rows), ColumnSumKernel's order.
template <typename T>
absl::Status ColumnSums(float* dbias, const T* dout, int64_t n, int64_t oc, const CudaContext& ctx,
                        const std::string& where) {
  // chunks of kChunkRows rows when the workspace holds their partial sums (chunks x oc doubles),
  // else one chunk of all the rows
  int64_t chunks = CeilDiv(n, kChunkRows);
  if (chunks > 65535 || !ctx.workspace || static_cast<size_t>(chunks * oc) * sizeof(double) > ctx.workspace_bytes)
    chunks = 1;
  double* partial = chunks > 1 ? static_cast<double*>(ctx.workspace) : nullptr;
  const dim3 grid(static_cast<unsigned>(CeilDiv(oc, kColTile)), static_cast<unsigned>(chunks));
  const dim3 block(kColTile, kRowLanes);
  ColumnSumKernel<T><<<grid, block, 0, ctx.stream>>>(partial, dbias, dout, n, oc, chunks > 1 ? kChunkRows : n);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  if (partial) {
    ColumnSumFinishKernel<<<Blocks(oc, 256), 256, 0, ctx.stream>>>(dbias, partial, chunks, oc);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status MatmulBackward(T* dinp, float* dw, float* dbias, const T* dout, const T* inp, const T* w, int64_t n,
                            int64_t ic, int64_t oc, const CudaContext& ctx, bool accumulate_dinp, const T* gelu_pre) {
  const std::string where = fmt::format("MatmulBackward<{}>(n={}, ic={}, oc={}{}{})", TypeLabel<T>(), n, ic, oc,
                                        dinp ? (accumulate_dinp ? ", dinp +=" : ", dinp") : "", dbias ? ", dbias" : "");
  if (n < 0 || ic <= 0 || oc <= 0)
    return absl::InvalidArgumentError(fmt::format("{}: sizes must be positive (n may be 0)", where));
  if (!dw || !dout || !inp || (dinp && !w))
    return absl::InvalidArgumentError(fmt::format("{}: dw, dout, inp (and w with dinp) must be set", where));
  if (n == 0) {
    // no rows: dw and dbias get nothing added; dinp (0 x ic) has no elements
    return absl::OkStatus();
  }
  constexpr cudaDataType_t kType = CudaDataType<T>();
  if (gelu_pre && (!dinp || accumulate_dinp))
    return absl::InvalidArgumentError(fmt::format("{}: gelu_pre needs dinp, assigned", where));
  if (dinp) {
    GemmSpec g{CUBLAS_OP_N, CUBLAS_OP_N, ic, n, oc, ic, oc, ic, kType, kType};
    bool fused = false;
    if (gelu_pre && !std::is_same_v<T, float> && ic % 8 == 0) {
      // dinp^T = DGELU(w^T dout^T, aux = the pre-activation, stored like D: ld = ic).
      GemmSpec dgelu = g;
      dgelu.epilogue = CUBLASLT_EPILOGUE_DGELU;
      dgelu.aux = const_cast<T*>(gelu_pre);
      if (absl::Status s = LtGemm(dgelu, w, dout, dinp, 1.0f, 0.0f, ctx, where, &fused); !s.ok()) return s;
    }
    if (!fused) {
      if (absl::Status s = Gemm(g, w, dout, dinp, 1.0f, accumulate_dinp ? 1.0f : 0.0f, ctx, where); !s.ok()) return s;
      if (gelu_pre)
        if (absl::Status s = GeluBackward<T>(dinp, gelu_pre, dinp, n * ic, ctx); !s.ok()) return s;
    }
  }
  {
    GemmSpec g{CUBLAS_OP_N, CUBLAS_OP_T, ic, oc, n, ic, oc, ic, kType, CUDA_R_32F};
    if (absl::Status s = Gemm(g, inp, dout, dw, 1.0f, 1.0f, ctx, where); !s.ok()) return s;
  }
  if (dbias) return ColumnSums(dbias, dout, n, oc, ctx, where);
  return absl::OkStatus();
}

template <typename T>
absl::Status BiasBackward(float* dbias, const T* dout, int64_t n, int64_t oc, const CudaContext& ctx) {
  const std::string where = fmt::format("BiasBackward<{}>(n={}, oc={})", TypeLabel<T>(), n, oc);
  if (n < 0 || oc <= 0 || !dbias || !dout)
    return absl::InvalidArgumentError(fmt::format("{}: dbias and dout must be set, oc positive", where));
  if (n == 0) return absl::OkStatus();
  return ColumnSums(dbias, dout, n, oc, ctx, where);
}

namespace gemm_detail {

template <typename T>
absl::StatusOr<GemmAlgoChoice> MatmulForwardAlgo(const T* inp, const T* w, T* out, int64_t n, int64_t ic, int64_t oc,
                                                 const CudaContext& ctx) {
  const std::string where = fmt::format("MatmulForwardAlgo<{}>(n={}, ic={}, oc={})", TypeLabel<T>(), n, ic, oc);
  if (n <= 0 || ic <= 0 || oc <= 0) return absl::InvalidArgumentError(fmt::format("{}: sizes must be positive", where));
  std::lock_guard<std::mutex> lock(PlanMutex());
  PTK_ASSIGN_OR_RETURN(const Plan* plan, CachedPlan(ForwardSpec<T>(n, ic, oc), w, inp, out, ctx, where));
  GemmAlgoChoice choice;
  if (!plan->supported) return choice;
  choice.cublaslt = true;
  size_t written = 0;
  PTK_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoConfigGetAttribute(&plan->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                                  &choice.splitk, sizeof(choice.splitk), &written),
                             where);
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulAlgoConfigGetAttribute(&plan->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &choice.reduction_scheme,
                                           sizeof(choice.reduction_scheme), &written),
      where);
  return choice;
}

}  // namespace gemm_detail

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::Status MatmulForward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t,                  \
                                         const CudaContext&, T*);                                                      \
  template absl::Status MatmulBackward<T>(T*, float*, float*, const T*, const T*, const T*, int64_t, int64_t, int64_t, \
                                          const CudaContext&, bool, const T*);                                         \
  template absl::Status BiasBackward<T>(float*, const T*, int64_t, int64_t, const CudaContext&);                       \
  template absl::StatusOr<gemm_detail::GemmAlgoChoice> gemm_detail::MatmulForwardAlgo<T>(                              \
      const T*, const T*, T*, int64_t, int64_t, int64_t, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
