// The CUDA model's state: parameters, gradients and moments through the host, AdamW, the collectives, ZeRO-1's gather,
// --overlap-grad-reduce's buckets.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cuda/adamw_table.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda::model_detail {

template <typename T>
absl::Status CudaGPTModelImpl<T>::ReadParams(std::span<float> out) const {
  // A sharded master holds every parameter only where one rank's shard covers them all.
  if (plan_.master_sharded && (master_begin_ != 0 || master_size_ != num_params()))
    return absl::FailedPreconditionError(fmt::format(
        "ReadParams: this rank keeps the fp32 master of parameters [{}, {}) only (--use-distributed-optimizer "
        "in {}); read that range with ReadOwnedParams and gather it over the ranks",
        master_begin_, master_begin_ + master_size_, PrecisionName(PrecisionOf<T>())));
  return Download(plan_.master, out, num_params());
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ReadOwnedParams(std::span<float> out) const {
  PTK_RETURN_IF_ERROR(CheckSize("ReadOwnedParams", out.size(), moments_size()));
  return DownloadRange(plan_.master, out.data(), plan_.master_sharded ? 0 : moments_begin(), moments_size());
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::WriteParams(std::span<const float> in) {
  if (plan_.master_sharded) {
    // Every parameter through the gradient buffer (free between steps): the shard's master, the
    // LayerNorms' fp32 copy and the compute copy are taken from it.
    PTK_RETURN_IF_ERROR(Upload(plan_.grads, in, num_params()));
    PTK_RETURN_IF_ERROR(TakeParamsFromGrads("writing the parameters"));
    PTK_RETURN_IF_ERROR(ZeroGrads());  // written outside a step: leave no weights as gradients
    return Sync("writing the parameters");
  }
  PTK_RETURN_IF_ERROR(Upload(plan_.master, in, num_params()));
  if (kFlash) PTK_RETURN_IF_ERROR(CastFromFloat<T>(Compute(0), Master(0), num_params(), ctx_));
  return Sync("writing the parameters");
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ReadMoments(std::span<float> m, std::span<float> v) const {
  PTK_RETURN_IF_ERROR(Download(plan_.exp_avg, m, moments_size()));
  return Download(plan_.exp_avg_sq, v, moments_size());
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::WriteMoments(std::span<const float> m, std::span<const float> v) {
  PTK_RETURN_IF_ERROR(Upload(plan_.exp_avg, m, moments_size()));
  return Upload(plan_.exp_avg_sq, v, moments_size());
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ZeroGrads() {
  PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(Grad(0), 0, plan_[plan_.grads].bytes, ctx_.stream), "zeroing gradients");
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::AllReduceGrads(Communicator* comm) {
  // One rank: nothing to sum, except through NCCL (a world of one runs its collectives, as the
  // gpu-labelled tests check them).
  if (comm->size() == 1 && !comm->device_collectives()) return absl::OkStatus();
  if (comm->device_collectives()) return comm->AllReduceSumDevice(Grad(0), num_params(), ctx_.stream);
  // A host-memory communicator (gloo): the gradients travel through the host.
  host_grads_.resize(static_cast<size_t>(num_params()));
  PTK_RETURN_IF_ERROR(Download(plan_.grads, host_grads_, num_params()));
  PTK_RETURN_IF_ERROR(comm->AllReduceSum(host_grads_.data(), num_params()));
  return Upload(plan_.grads, host_grads_, num_params());
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ReduceScatterGrads(Communicator* comm) {
  if (!shard()) return absl::FailedPreconditionError("ReduceScatterGrads needs a sharded optimizer state");
  if (comm->size() == 1 && !comm->device_collectives()) return absl::OkStatus();
  if (comm->device_collectives()) {
    // The padded buffer in equal pieces (NCCL's reduce-scatter); the padding is zero.
    const std::vector<int64_t> counts(static_cast<size_t>(comm->size()), shard()->shard_size);
    return comm->ReduceScatterSumDevice(Grad(0), counts, ctx_.stream);
  }
  host_grads_.resize(static_cast<size_t>(num_params()));
  PTK_RETURN_IF_ERROR(Download(plan_.grads, host_grads_, num_params()));
  PTK_RETURN_IF_ERROR(comm->ReduceScatterSum(host_grads_.data(), shard()->Counts()));
  return UploadRange(plan_.grads, host_grads_.data() + shard()->begin(), shard()->begin(), shard()->size());
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::GradSumSquaresPartials(int64_t begin, int64_t end, std::vector<double>* out) {
  if (begin < 0 || end > num_params() || begin > end)
    return absl::InvalidArgumentError(
        fmt::format("GradSumSquaresPartials: range [{}, {}) of {} parameters", begin, end, num_params()));
  if (begin == end) return absl::OkStatus();
  // A pipeline stage's embedding copy left out, as GradSumSquares.
  const int64_t counted_end = std::min(end, layout().norm_end());
  if (counted_end <= begin) {
    out->push_back(0.0);
    return absl::OkStatus();
  }
  if (tensor_rank() > 0) {  // another tensor rank: its slices only, as GradSumSquares
    double s = 0;
    for (const ParamPiece& piece : PiecesIn(layout(), begin, counted_end)) {
      if (piece.tensor_split_dim < 0) continue;
      PTK_ASSIGN_OR_RETURN(const double part, SumSquaresOf(piece.offset, piece.size));
      s += part;
    }
    out->push_back(s);
    return absl::OkStatus();
  }
  // One partial: SumSquares over the range (over [0, n), GradSumSquares' own bits).
  end = counted_end;
  Begin();
  double* partials = Buf<double>(plan_.reduce);
  double* result = partials + SumSquaresPartials(end - begin);
  PTK_RETURN_IF_ERROR(Op("grad norm", "grad norm", SumSquares(result, Grad(begin), end - begin, partials, ctx_)));
  double host = 0;
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&host, result, sizeof host, cudaMemcpyDeviceToHost, ctx_.stream),
                           "reading the gradient norm");
  PTK_RETURN_IF_ERROR(Sync("the gradient norm"));
  out->push_back(host);
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::AllGatherParams(Communicator* comm) {
  if (!shard()) return absl::FailedPreconditionError("AllGatherParams needs a sharded optimizer state");
  // A sharded master refreshes the LayerNorms' fp32 copy even for a world of one.
  if (plan_.master_sharded) return GatherShardedMaster(comm);
  if (comm->size() == 1 && !comm->device_collectives()) return absl::OkStatus();
  // The fp32 master is gathered (the LayerNorms read it, checkpoints save it); the compute copy
  // is cast from it again, as AdamW's own cast rounds.
  if (comm->device_collectives()) {
    const std::vector<int64_t> bytes(static_cast<size_t>(comm->size()),
                                     shard()->shard_size * static_cast<int64_t>(sizeof(float)));
    PTK_RETURN_IF_ERROR(comm->AllGatherDevice(Master(0), bytes, ctx_.stream));
  } else {
    host_grads_.resize(static_cast<size_t>(num_params()));
    PTK_RETURN_IF_ERROR(
        DownloadRange(plan_.master, host_grads_.data() + shard()->begin(), shard()->begin(), shard()->size()));
    std::vector<int64_t> bytes = shard()->Counts();
    for (int64_t& b : bytes) b *= static_cast<int64_t>(sizeof(float));
    PTK_RETURN_IF_ERROR(comm->AllGather(host_grads_.data(), bytes));
    PTK_RETURN_IF_ERROR(Upload(plan_.master, host_grads_, num_params()));
  }
  if (kFlash)
    PTK_RETURN_IF_ERROR(Op("adamw", "compute copy", CastFromFloat<T>(Compute(0), Master(0), num_params(), ctx_)));
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<double> CudaGPTModelImpl<T>::GradSumSquares() {
  // A last pipeline stage's copy of the tied embeddings is the first stage's to count.
  const int64_t counted = layout().norm_end();
  if (tensor_rank() > 0) {
    // Another tensor rank: its slices only (tensor rank 0 counts what every rank holds whole).
    double s = 0;
    for (const ParamInfo& p : params_info()) {
      if (p.tensor_split_dim < 0 || p.offset >= counted) continue;
      PTK_ASSIGN_OR_RETURN(const double part, SumSquaresOf(p.offset, p.size));
      s += part;
    }
    return s;
  }
  return SumSquaresOf(0, counted);
}

template <typename T>
absl::StatusOr<double> CudaGPTModelImpl<T>::SumSquaresOf(int64_t offset, int64_t count) {
  Begin();
  double* partials = Buf<double>(plan_.reduce);
  double* result = partials + SumSquaresPartials(count);
  PTK_RETURN_IF_ERROR(Op("grad norm", "grad norm", SumSquares(result, Grad(offset), count, partials, ctx_)));
  double host = 0;
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&host, result, sizeof host, cudaMemcpyDeviceToHost, ctx_.stream),
                           "reading the gradient norm");
  PTK_RETURN_IF_ERROR(Sync("the gradient norm"));
  return host;
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ScaleGrads(double s) {
  Begin();
  return Op("grad scale", "grad scale", Scale(Grad(moments_begin()), moments_size(), static_cast<float>(s), ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ScaledAdamWUpdate(double grad_scale, const AdamWGroups& groups) {
  if (unfused_.adamw_per_tensor) return GPTModel::ScaledAdamWUpdate(grad_scale, groups);
  const int64_t base = moments_begin();
  // The chunks' groups depend on --apply-wd-to-qk-layernorm: a table built for the other rule is rebuilt.
  if (adamw_table_size_ >= 0 && adamw_table_qk_wd_ != groups.apply_wd_to_qk_layernorm) {
    PTK_CUDA_RETURN_IF_ERROR(cudaFree(adamw_table_), "freeing the AdamW table");
    adamw_table_ = nullptr;
    adamw_table_size_ = -1;
  }
  if (adamw_table_size_ < 0) {
    const std::vector<AdamWChunk> table = AdamWTable(layout(), base, base + moments_size(), groups);
    const size_t bytes = std::max<size_t>(1, table.size()) * sizeof(AdamWChunk);
    PTK_CUDA_RETURN_IF_ERROR(cudaMalloc(&adamw_table_, bytes), "allocating the AdamW table");
    adamw_table_qk_wd_ = groups.apply_wd_to_qk_layernorm;
    if (!table.empty())
      PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(adamw_table_, table.data(), table.size() * sizeof(AdamWChunk),
                                               cudaMemcpyHostToDevice, ctx_.stream),
                               "copying the AdamW table to the device");
    PTK_RETURN_IF_ERROR(Sync("copying the AdamW table"));
    adamw_table_size_ = static_cast<int64_t>(table.size());
  }
  Begin();
  ++profiled_steps_;
  T* compute = kFlash ? Compute(0) : nullptr;
  return Op("adamw", "adamw",
            AdamWMulti<T>(adamw_table_, adamw_table_size_, Buf<float>(plan_.master),
                          plan_.master_sharded ? master_begin_ : 0, Grad(0), Buf<float>(plan_.exp_avg),
                          Buf<float>(plan_.exp_avg_sq), base, compute, static_cast<float>(grad_scale), groups, ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::AdamWUpdate(const AdamWGroups& groups) {
  Begin();
  ++profiled_steps_;
  // The moments hold [moments_begin(), ...) only under ZeRO-1.
  const int64_t base = moments_begin();
  for (const ParamPiece& p : PiecesIn(layout(), base, base + moments_size())) {
    T* compute = kFlash ? Compute(p.offset) : nullptr;
    PTK_RETURN_IF_ERROR(
        Op("adamw", "adamw",
           AdamW<T>(MasterOf(p.offset), Grad(p.offset), Buf<float>(plan_.exp_avg) + (p.offset - base),
                    Buf<float>(plan_.exp_avg_sq) + (p.offset - base), p.size, groups.Of(p), compute, ctx_)));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ResizeMoments(const ParamShard& shard) {
  std::vector<float> params(static_cast<size_t>(num_params()));
  PTK_RETURN_IF_ERROR(ReadParams(params));
  PTK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_.stream), "before re-planning device memory");
  cudaFree(arena_);
  arena_ = nullptr;
  padded_params_ = shard.padded_size;
  moment_params_ = shard.size();
  master_begin_ = shard.begin();
  master_size_ = shard.size();
  if (adamw_table_) cudaFree(adamw_table_);
  adamw_table_ = nullptr;
  adamw_table_size_ = -1;  // rebuilt for the shard's range
  PTK_RETURN_IF_ERROR(Plan(plan_.b, plan_.t));
  return WriteParams(params);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::BeginBucketReduction(const std::vector<GradRange>& buckets) {
  if (!comm_stream_)
    PTK_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking),
                             "creating the gradient communication stream");
  if (!comm_done_)
    PTK_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming),
                             "creating a communication event");
  while (bucket_events_.size() < buckets.size()) {
    cudaEvent_t e = nullptr;
    PTK_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating a bucket event");
    bucket_events_.push_back(e);
  }
  buckets_ = buckets;
  launch_error_ = absl::OkStatus();
  if (reduce_comm_->device_collectives()) return absl::OkStatus();
  host_grads_.resize(static_cast<size_t>(num_params()));
  worker_ = std::make_unique<BucketWorker>([this](int bucket) { return HostBucket(bucket); });
  return absl::OkStatus();
}

template <typename T>
void CudaGPTModelImpl<T>::LaunchBucket(int bucket, const GradRange& range) {
  if (!launch_error_.ok()) return;
  cudaEvent_t ready = bucket_events_[static_cast<size_t>(bucket)];
  if (cudaError_t e = cudaEventRecord(ready, ctx_.stream); e != cudaSuccess) {
    launch_error_ = CudaError(e, "cudaEventRecord", "marking a gradient bucket");
    return;
  }
  if (!reduce_comm_->device_collectives()) {
    worker_->Enqueue(bucket);
    return;
  }
  if (cudaError_t e = cudaStreamWaitEvent(comm_stream_, ready, 0); e != cudaSuccess) {
    launch_error_ = CudaError(e, "cudaStreamWaitEvent", "ordering a gradient bucket's reduction");
    return;
  }
  launch_error_ = shard() ? reduce_comm_->ReduceScatterSumDevice(
                                Grad(range.begin), shard()->CountsIn(range.begin, range.end), comm_stream_)
                          : reduce_comm_->AllReduceSumDevice(Grad(range.begin), range.size(), comm_stream_);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::EndBucketReduction() {
  absl::Status st = launch_error_;
  if (worker_) {
    absl::Status w = worker_->Finish();
    worker_.reset();
    if (st.ok()) st = w;
  }
  // The compute stream goes on (norm, update) only after every bucket's collective.
  if (cudaError_t e = cudaEventRecord(comm_done_, comm_stream_); e != cudaSuccess && st.ok())
    st = CudaError(e, "cudaEventRecord", "the end of the gradient reduction");
  if (cudaError_t e = cudaStreamWaitEvent(ctx_.stream, comm_done_, 0); e != cudaSuccess && st.ok())
    st = CudaError(e, "cudaStreamWaitEvent", "waiting for the gradient reduction");
  return st;
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::HostBucket(int bucket) {
  const GradRange r = buckets_[static_cast<size_t>(bucket)];
  const size_t bytes = static_cast<size_t>(r.size()) * sizeof(float);
  float* host = host_grads_.data() + r.begin;
  PTK_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_.device), "selecting the device on the communication thread");
  PTK_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(bucket_events_[static_cast<size_t>(bucket)]),
                           "waiting for a gradient bucket");
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, Grad(r.begin), bytes, cudaMemcpyDeviceToHost, comm_stream_),
                           "copying a gradient bucket to the host");
  PTK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(comm_stream_), "copying a gradient bucket to the host");
  PTK_RETURN_IF_ERROR(ReduceHostBucket(host_grads_.data(), r));
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Grad(r.begin), host, bytes, cudaMemcpyHostToDevice, comm_stream_),
                           "copying a reduced gradient bucket to the device");
  PTK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(comm_stream_), "copying a reduced gradient bucket to the device");
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::CheckSize(std::string_view what, size_t got, int64_t want) const {
  if (static_cast<int64_t>(got) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      fmt::format("{}: {} values for {} (a model of {} parameters)", what, got, want, num_params()));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Download(int index, std::span<float> out, int64_t want) const {
  PTK_RETURN_IF_ERROR(CheckSize(plan_[index].name, out.size(), want));
  return DownloadRange(index, out.data(), 0, want);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Upload(int index, std::span<const float> in, int64_t want) {
  PTK_RETURN_IF_ERROR(CheckSize(plan_[index].name, in.size(), want));
  return UploadRange(index, in.data(), 0, want);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::DownloadRange(int index, float* out, int64_t at, int64_t count) const {
  if (count == 0) return absl::OkStatus();
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, Buf<float>(index) + at, static_cast<size_t>(count) * sizeof(float),
                                           cudaMemcpyDeviceToHost, ctx_.stream),
                           fmt::format("copying {} to the host", plan_[index].name));
  return Sync(plan_[index].name);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::TakeParamsFromGrads(std::string_view what) {
  const size_t f = sizeof(float);
  PTK_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(Buf<float>(plan_.master), Grad(master_begin_), static_cast<size_t>(master_size_) * f,
                      cudaMemcpyDeviceToDevice, ctx_.stream),
      fmt::format("{}: the shard's fp32 master [{}, {})", what, master_begin_, master_begin_ + master_size_));
  for (const LayerNormRun& r : ln_runs_)
    PTK_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(Buf<float>(plan_.ln_master) + r.compact, Grad(r.begin),
                        static_cast<size_t>(r.end - r.begin) * f, cudaMemcpyDeviceToDevice, ctx_.stream),
        fmt::format("{}: LayerNorm parameters [{}, {})", what, r.begin, r.end));
  return CastFromFloat<T>(Compute(0), Grad(0), num_params(), ctx_);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::GatherShardedMaster(Communicator* comm) {
  const size_t f = sizeof(float);
  if (comm->device_collectives() || comm->size() == 1) {
    PTK_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(Grad(master_begin_), Buf<float>(plan_.master), static_cast<size_t>(master_size_) * f,
                        cudaMemcpyDeviceToDevice, ctx_.stream),
        "gathering the fp32 master: this rank's shard");
    if (comm->device_collectives()) {
      const std::vector<int64_t> bytes(static_cast<size_t>(comm->size()),
                                       shard()->shard_size * static_cast<int64_t>(f));
      PTK_RETURN_IF_ERROR(comm->AllGatherDevice(Grad(0), bytes, ctx_.stream));
    }
  } else {
    host_grads_.resize(static_cast<size_t>(num_params()));
    PTK_RETURN_IF_ERROR(DownloadRange(plan_.master, host_grads_.data() + master_begin_, 0, master_size_));
    std::vector<int64_t> bytes = shard()->Counts();
    for (int64_t& b : bytes) b *= static_cast<int64_t>(f);
    PTK_RETURN_IF_ERROR(comm->AllGather(host_grads_.data(), bytes));
    PTK_RETURN_IF_ERROR(Upload(plan_.grads, host_grads_, num_params()));
  }
  return TakeParamsFromGrads("gathering the fp32 master");
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::UploadRange(int index, const float* in, int64_t at, int64_t count) {
  if (count == 0) return absl::OkStatus();
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<float>(index) + at, in, static_cast<size_t>(count) * sizeof(float),
                                           cudaMemcpyHostToDevice, ctx_.stream),
                           fmt::format("copying {} to the device", plan_[index].name));
  return Sync(plan_[index].name);
}

#define PTK_INSTANTIATE(T)                                                                                          \
  template absl::Status CudaGPTModelImpl<T>::ReadParams(std::span<float> out) const;                                \
  template absl::Status CudaGPTModelImpl<T>::ReadOwnedParams(std::span<float> out) const;                           \
  template absl::Status CudaGPTModelImpl<T>::WriteParams(std::span<const float> in);                                \
  template absl::Status CudaGPTModelImpl<T>::ReadMoments(std::span<float> m, std::span<float> v) const;             \
  template absl::Status CudaGPTModelImpl<T>::WriteMoments(std::span<const float> m, std::span<const float> v);      \
  template absl::Status CudaGPTModelImpl<T>::ZeroGrads();                                                           \
  template absl::Status CudaGPTModelImpl<T>::AllReduceGrads(Communicator* comm);                                    \
  template absl::Status CudaGPTModelImpl<T>::ReduceScatterGrads(Communicator* comm);                                \
  template absl::Status CudaGPTModelImpl<T>::GradSumSquaresPartials(int64_t begin, int64_t end,                     \
                                                                    std::vector<double>* out);                      \
  template absl::Status CudaGPTModelImpl<T>::AllGatherParams(Communicator* comm);                                   \
  template absl::StatusOr<double> CudaGPTModelImpl<T>::GradSumSquares();                                            \
  template absl::StatusOr<double> CudaGPTModelImpl<T>::SumSquaresOf(int64_t offset, int64_t count);                 \
  template absl::Status CudaGPTModelImpl<T>::ScaleGrads(double s);                                                  \
  template absl::Status CudaGPTModelImpl<T>::ScaledAdamWUpdate(double grad_scale, const AdamWGroups& groups);       \
  template absl::Status CudaGPTModelImpl<T>::AdamWUpdate(const AdamWGroups& groups);                                \
  template absl::Status CudaGPTModelImpl<T>::ResizeMoments(const ParamShard& shard);                                \
  template absl::Status CudaGPTModelImpl<T>::BeginBucketReduction(const std::vector<GradRange>& buckets);           \
  template void CudaGPTModelImpl<T>::LaunchBucket(int bucket, const GradRange& range);                              \
  template absl::Status CudaGPTModelImpl<T>::EndBucketReduction();                                                  \
  template absl::Status CudaGPTModelImpl<T>::HostBucket(int bucket);                                                \
  template absl::Status CudaGPTModelImpl<T>::CheckSize(std::string_view what, size_t got, int64_t want) const;      \
  template absl::Status CudaGPTModelImpl<T>::Download(int index, std::span<float> out, int64_t want) const;         \
  template absl::Status CudaGPTModelImpl<T>::Upload(int index, std::span<const float> in, int64_t want);            \
  template absl::Status CudaGPTModelImpl<T>::DownloadRange(int index, float* out, int64_t at, int64_t count) const; \
  template absl::Status CudaGPTModelImpl<T>::TakeParamsFromGrads(std::string_view what);                            \
  template absl::Status CudaGPTModelImpl<T>::GatherShardedMaster(Communicator* comm);                               \
  template absl::Status CudaGPTModelImpl<T>::UploadRange(int index, const float* in, int64_t at, int64_t count);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
