// The CUDA model's op wrapper: synchronisation, errors that name the op (PTK_CUDA_SYNC_OPS), --ptk-profile-ops.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/core.h>

#include "trainer/cuda/cuda_gpt_model_impl.h"

namespace ptk::cuda::model_detail {

template <typename T>
absl::Status CudaGPTModelImpl<T>::Sync(std::string_view what) const {
  if (cudaError_t e = cudaStreamSynchronize(ctx_.stream); e != cudaSuccess) {
    const absl::Status st = CudaError(e, "cudaStreamSynchronize", fmt::format("{} on cuda:{}", what, ctx_.device));
    if (sync_ops_) return st;
    return absl::Status(st.code(), fmt::format("{} (an asynchronous error of an op enqueued before this point; rerun "
                                               "with PTK_CUDA_SYNC_OPS=1 to synchronise after every op and name the "
                                               "one that failed, its shapes and layer)",
                                               std::string(st.message())));
  }
  CollectProfile();
  return absl::OkStatus();
}

template <typename T>
void CudaGPTModelImpl<T>::Begin() {
  layer_ = -1;
  if (profile_) RecordMark(nullptr);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Op(const char* category, const char* name, absl::Status status) {
  if (!status.ok())
    return absl::Status(status.code(), fmt::format("{}: {}", OpWhere(name), std::string(status.message())));
  if (profile_) RecordMark(category);
  if (sync_ops_) {
    if (cudaError_t e = cudaStreamSynchronize(ctx_.stream); e != cudaSuccess)
      return CudaError(e, "cudaStreamSynchronize after the op (PTK_CUDA_SYNC_OPS=1)", OpWhere(name));
  }
  return status;
}

template <typename T>
std::string CudaGPTModelImpl<T>::OpWhere(const char* name) const {
  const GPTConfig& cf = config();
  // This rank's widths: the fused QKV's (its query heads and groups' key and value heads), the ffn's.
  const int64_t n = n_, c = cf.hidden_size, tn = tensor_size(), qw = cf.qkv_rows() / tn, f = cf.ffn_hidden_size / tn,
                vp = cf.padded_vocab_size / tn;
  const std::string_view op(name);
  auto has = [&](std::string_view w) { return op.find(w) != std::string_view::npos; };
  std::string shapes;
  if (has("qkv") || has("rope"))
    shapes = fmt::format("n={} x c={} -> {}", n, c, qw);
  else if (has("proj"))
    shapes = fmt::format("n={} x {} -> c={}", n, cf.num_attention_heads / tn * cf.head_dim(), c);
  else if (has("fc1"))
    shapes = fmt::format("n={} x c={} -> {}", n, c, (cf.swiglu ? 2 : 1) * f);
  else if (has("fc2"))
    shapes = fmt::format("n={} x {} -> c={}", n, f, c);
  else if (has("gelu") || has("swiglu") || has("squared relu"))
    shapes = fmt::format("n={} x {}", n, f);
  else if (has("lm head") || has("loss"))
    shapes = fmt::format("rows {}..{} of n={} x c={} -> padded vocabulary {}", head_row0_, head_row0_ + head_rows_, n,
                         c, vp);
  else if (has("attention") && !has("dropout"))
    shapes = fmt::format("b={} t={} heads={} query groups={} head dim={}{}", b_, t_, cf.num_attention_heads / tn,
                         cf.query_groups() / tn, cf.head_dim(),
                         kFlash && !cp() ? " (cuDNN fused attention)"
                         : cp()          ? " (fp32 context-parallel rows)"
                                         : "");
  else if (has("grad") || has("adamw") || has("compute copy"))
    shapes = fmt::format("{} parameters", num_params());
  else
    shapes = fmt::format("n={} x c={}", n, c);
  return fmt::format("op {} ({}){}, a {}x{} micro-batch, {}, cuda:{}", name, shapes,
                     layer_ >= 0 ? fmt::format(" of layer {} of {}", layer_, cf.num_layers) : "", b_, t_,
                     PrecisionName(PrecisionOf<T>()), ctx_.device);
}

template <typename T>
void CudaGPTModelImpl<T>::RecordMark(const char* category) {
  cudaEvent_t e = nullptr;
  if (free_events_.empty()) {
    if (cudaEventCreate(&e) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
  } else {
    e = free_events_.back();
    free_events_.pop_back();
  }
  cudaEventRecord(e, ctx_.stream);
  marks_.emplace_back(category, e);
}

template <typename T>
void CudaGPTModelImpl<T>::CollectProfile() const {
  for (size_t i = 0; i < marks_.size(); ++i) {
    if (marks_[i].first && i > 0) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second) == cudaSuccess)
        op_ms_[marks_[i].first] += ms;
      else
        (void)cudaGetLastError();
    }
  }
  for (auto& m : marks_) free_events_.push_back(m.second);
  marks_.clear();
}

template <typename T>
std::string CudaGPTModelImpl<T>::ProfileReport() const {
  if (!profile_ || profiled_steps_ == 0) return "";
  CollectProfile();
  double total = 0;
  for (const auto& [name, ms] : op_ms_) total += ms;
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [name, ms] : op_ms_) rows.emplace_back(ms, name);
  std::sort(rows.rbegin(), rows.rend());
  const double steps = static_cast<double>(profiled_steps_);
  std::string out = fmt::format("ptk op profile: GPU time per iteration over {} iterations, {:.2f} ms in ops\n",
                                profiled_steps_, total / steps);
  for (const auto& [ms, name] : rows)
    out += fmt::format("  {:<12} {:9.3f} ms {:5.1f}%\n", name, ms / steps, 100.0 * ms / std::max(total, 1e-9));
  // Products cuBLASLt had no algorithm for (cublasGemmEx and separate bias/GELU kernels instead):
  // the number of distinct ones, then each with its calls.
  std::lock_guard<std::mutex> lock(fallbacks_.mu);
  out += fmt::format("  cuBLASLt fallbacks: {}\n", fallbacks_.calls.size());
  for (const auto& [what, calls] : fallbacks_.calls) out += fmt::format("    {} ({} calls)\n", what, calls);
  return out;
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Synchronize() {
  if (comm_stream_)
    PTK_CUDA_RETURN_IF_ERROR(
        cudaStreamSynchronize(comm_stream_),
        fmt::format("GPTModel::Synchronize: the gradient buckets' stream on cuda:{}", ctx_.device));
  return Sync("GPTModel::Synchronize");
}

#define PTK_INSTANTIATE(T)                                                                                    \
  template absl::Status CudaGPTModelImpl<T>::Sync(std::string_view what) const;                               \
  template void CudaGPTModelImpl<T>::Begin();                                                                 \
  template absl::Status CudaGPTModelImpl<T>::Op(const char* category, const char* name, absl::Status status); \
  template std::string CudaGPTModelImpl<T>::OpWhere(const char* name) const;                                  \
  template void CudaGPTModelImpl<T>::RecordMark(const char* category);                                        \
  template void CudaGPTModelImpl<T>::CollectProfile() const;                                                  \
  template std::string CudaGPTModelImpl<T>::ProfileReport() const;                                            \
  template absl::Status CudaGPTModelImpl<T>::Synchronize();
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
