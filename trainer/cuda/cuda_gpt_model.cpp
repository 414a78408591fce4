// Megatron's GPT on one GPU: the CPU model's pass (trainer/cpu/cpu_gpt_model.cpp) over the CUDA ops,
// with the residual adds fused into the LayerNorms, the GELU into fc1's epilogue, and the loss over
// the vocabulary computed in chunks of rows (the LM head's backward runs chunk by chunk right after
// its loss, so no (tokens x vocabulary) matrix is ever kept).
#include "trainer/cuda/cuda_gpt_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <vector>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cuda/adamw_table.h"
#include "trainer/cuda/cuda_common.h"
#include "trainer/cuda/cuda_versions.h"
#include "trainer/cuda/layernorm_oracle.h"
#include "trainer/cuda/memory_plan.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {

int VisibleDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not sticky, clear it
    return 0;
  }
  return n;
}

namespace {

// The first CUDA model of the process logs the versions it runs with (driver, runtime, cuBLASLt,
// cuDNN, NCCL, the GPU) and warns about each runtime library older than the build's headers.
void LogVersionsOnce(int device) {
  static std::once_flag once;
  std::call_once(once, [device] {
    std::vector<std::string> warnings;
    log::Info("{}", DescribeCudaVersions(QueryCudaVersions(device), &warnings));
    for (const std::string& w : warnings) log::Warning("{}", w);
  });
}

// Page-locked host memory: the micro-batch inputs and the losses travel through it, so the copies
// are asynchronous and run at full PCIe speed.
class Pinned {
 public:
  Pinned() = default;
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  ~Pinned() {
    if (p_) cudaFreeHost(p_);
  }
  absl::Status Reserve(size_t bytes) {
    if (bytes <= bytes_) return absl::OkStatus();
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    bytes_ = 0;
    PTK_CUDA_RETURN_IF_ERROR(cudaMallocHost(&p_, bytes), fmt::format("pinned host buffer of {}", FormatBytes(bytes)));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  template <typename U>
  U* at(size_t offset) {
    return reinterpret_cast<U*>(static_cast<char*>(p_) + offset);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

int64_t AlignUp(int64_t x) {
  return (x + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment;
}

template <typename T>
constexpr Precision PrecisionOf() {
  if constexpr (std::is_same_v<T, float>)
    return Precision::kFp32;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return Precision::kBf16;
  else
    return Precision::kFp16;
}

template <typename T>
class CudaGPTModelImpl final : public GPTModel {
 public:
  static constexpr bool kFlash = !std::is_same_v<T, float>;

  CudaGPTModelImpl(ParamLayout layout) : GPTModel(std::move(layout)) {}
  ~CudaGPTModelImpl() override {
    worker_.reset();
    if (comm_stream_) cudaStreamSynchronize(comm_stream_);
    if (ctx_.stream) cudaStreamSynchronize(ctx_.stream);
    for (cudaEvent_t e : bucket_events_) cudaEventDestroy(e);
    if (comm_done_) cudaEventDestroy(comm_done_);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    for (auto& m : marks_) cudaEventDestroy(m.second);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    for (cudaEvent_t e : inputs_copied_)
      if (e) cudaEventDestroy(e);
    if (arena_) cudaFree(arena_);
    if (adamw_table_) cudaFree(adamw_table_);
    if (ctx_.cudnn) DestroyCudnnHandle(&ctx_);
    if (ctx_.cublaslt) cublasLtDestroy(ctx_.cublaslt);
    if (ctx_.cublas) cublasDestroy(ctx_.cublas);
    if (ctx_.stream) cudaStreamDestroy(ctx_.stream);
  }

  absl::Status Init(int device, bool deterministic, int64_t micro_batch_size, bool profile,
                    const CudaModelOptions& options) {
    profile_ = profile;
    sync_ops_ = options.sync_ops;
    logits_budget_bytes_ = options.logits_budget_bytes;
    unfused_ = options.unfused;
    if (logits_budget_bytes_ < 0)
      return absl::InvalidArgumentError(fmt::format("logits budget of {} bytes", logits_budget_bytes_));
    const int visible = VisibleDeviceCount();
    if (visible == 0)
      return absl::FailedPreconditionError(
          "--device cuda: no CUDA device is visible (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them all); "
          "train with --device cpu, or run on a GPU node");
    if (device < 0 || device >= visible)
      return UsageError(
          fmt::format("CUDA device {} (the local rank) does not exist: {} device(s) visible; start one process per GPU",
                      device, visible));
    PTK_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), fmt::format("selecting CUDA device {}", device));
    cudaDeviceProp prop{};
    PTK_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device), fmt::format("properties of device {}", device));
    ctx_.device = device;
    ctx_.sm_major = prop.major;
    ctx_.sm_minor = prop.minor;
    ctx_.num_sms = prop.multiProcessorCount;
    ctx_.deterministic = deterministic;
    device_name_ = prop.name;
    LogVersionsOnce(device);
    if (kFlash && prop.major < 8)
      return absl::FailedPreconditionError(fmt::format(
          "--{}: cuda:{} ({}) is sm_{}{}; bf16/fp16 training (cuDNN's fused attention) needs sm_80 or newer "
          "(A100, H100); train in fp32 (no precision flag) on this GPU",
          PrecisionName(PrecisionOf<T>()), device, prop.name, prop.major, prop.minor));
    PTK_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking), "creating the stream");
    PTK_CUBLAS_RETURN_IF_ERROR(cublasCreate(&ctx_.cublas), "creating the cuBLAS handle");
    PTK_CUBLAS_RETURN_IF_ERROR(cublasSetStream(ctx_.cublas, ctx_.stream), "cuBLAS stream");
    // fp32 mode is IEEE fp32: no TF32 (it is the mode compared tightly with the CPU). bf16/fp16 keep
    // cuBLAS's default math mode, which lets their products (cublasGemmEx, the strided-batched
    // fallbacks) use the tensor cores.
    if constexpr (!kFlash)
      PTK_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(ctx_.cublas, CUBLAS_PEDANTIC_MATH), "cuBLAS math mode");
    ctx_.fallbacks = &fallbacks_;
    PTK_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&ctx_.cublaslt), "creating the cuBLASLt handle");
    if (kFlash) PTK_RETURN_IF_ERROR(CreateCudnnHandle(&ctx_));
    return Plan(micro_batch_size, config().seq_length);
  }

  Device device() const override { return Device::kCuda; }
  Precision precision() const override { return PrecisionOf<T>(); }
  std::string Describe() const override {
    return fmt::format("cuda:{} ({}, sm_{}{}) {}{}", ctx_.device, device_name_, ctx_.sm_major, ctx_.sm_minor,
                       PrecisionName(PrecisionOf<T>()), ctx_.deterministic ? ", deterministic" : "");
  }

  absl::Status ReadParams(std::span<float> out) const override {
    // A sharded master holds every parameter only where one rank's shard covers them all.
    if (plan_.master_sharded && (master_begin_ != 0 || master_size_ != num_params()))
      return absl::FailedPreconditionError(fmt::format(
          "ReadParams: this rank keeps the fp32 master of parameters [{}, {}) only (--use-distributed-optimizer "
          "in {}); read that range with ReadOwnedParams and gather it over the ranks",
          master_begin_, master_begin_ + master_size_, PrecisionName(PrecisionOf<T>())));
    return Download(plan_.master, out, num_params());
  }
  absl::Status ReadOwnedParams(std::span<float> out) const override {
    PTK_RETURN_IF_ERROR(CheckSize("ReadOwnedParams", out.size(), moments_size()));
    return DownloadRange(plan_.master, out.data(), plan_.master_sharded ? 0 : moments_begin(), moments_size());
  }
  absl::Status WriteParams(std::span<const float> in) override {
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
  absl::Status ReadGrads(std::span<float> out) const override { return Download(plan_.grads, out, num_params()); }
  absl::Status ReadMoments(std::span<float> m, std::span<float> v) const override {
    PTK_RETURN_IF_ERROR(Download(plan_.exp_avg, m, moments_size()));
    return Download(plan_.exp_avg_sq, v, moments_size());
  }
  absl::Status WriteMoments(std::span<const float> m, std::span<const float> v) override {
    PTK_RETURN_IF_ERROR(Upload(plan_.exp_avg, m, moments_size()));
    return Upload(plan_.exp_avg_sq, v, moments_size());
  }

  absl::Status ZeroGrads() override {
    PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(Grad(0), 0, plan_[plan_.grads].bytes, ctx_.stream), "zeroing gradients");
    return absl::OkStatus();
  }

  absl::StatusOr<LossSum> ForwardBackward(const ModelBatch& batch, double loss_scale, bool train,
                                          uint64_t seed) override {
    const bool dropout = train && (config().hidden_dropout > 0 || config().attention_dropout > 0);
    if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
    PTK_RETURN_IF_ERROR(Prepare(batch, loss_scale, dropout));
    Begin();
    PTK_RETURN_IF_ERROR(RunForward(train, seed));
    PTK_RETURN_IF_ERROR(RunHead(/*backward=*/true, nullptr));
    PTK_RETURN_IF_ERROR(RunBackward(train, seed));
    return Losses(batch);
  }

  // The pass stays enqueued: its per-token losses go to a pinned slot of their own (an
  // asynchronous copy), and TakeLosses synchronises once for all the step's micro-batches.
  absl::Status ForwardBackwardDeferred(const ModelBatch& batch, double loss_scale, bool train,
                                       uint64_t seed) override {
    const bool dropout = train && (config().hidden_dropout > 0 || config().attention_dropout > 0);
    if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
    PTK_RETURN_IF_ERROR(Prepare(batch, loss_scale, dropout));
    Begin();
    PTK_RETURN_IF_ERROR(RunForward(train, seed));
    PTK_RETURN_IF_ERROR(RunHead(/*backward=*/true, nullptr));
    PTK_RETURN_IF_ERROR(RunBackward(train, seed));
    const size_t k = pending_losses_, n = static_cast<size_t>(n_);
    if (loss_slots_.size() <= k) loss_slots_.push_back(std::make_unique<Pinned>());
    if (pending_masks_.size() <= k) pending_masks_.resize(k + 1);
    PTK_RETURN_IF_ERROR(loss_slots_[k]->Reserve(n * sizeof(float)));  // slot k holds no pending copy
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(loss_slots_[k]->template at<float>(0), Buf<float>(plan_.losses),
                                             n * sizeof(float), cudaMemcpyDeviceToHost, ctx_.stream),
                             "copying the losses to the host");
    PTK_RETURN_IF_ERROR(Op("copies", "loss copy", absl::OkStatus()));
    pending_masks_[k].assign(batch.loss_mask, batch.loss_mask + n);
    pending_losses_ = k + 1;
    return absl::OkStatus();
  }

  absl::StatusOr<LossSum> TakeLosses() override {
    const size_t k = pending_losses_;
    pending_losses_ = 0;
    if (k == 0) return LossSum{};
    PTK_RETURN_IF_ERROR(Sync(fmt::format("the passes over {} micro-batches of {}x{}", k, b_, t_)));
    LossSum total;
    for (size_t i = 0; i < k; ++i) {
      const LossSum s = SumLosses(loss_slots_[i]->template at<float>(0), pending_masks_[i]);
      total.loss_sum += s.loss_sum;
      total.tokens += s.tokens;
    }
    return total;
  }

  absl::StatusOr<LossSum> Forward(const ModelBatch& batch, std::vector<float>* logits) override {
    PTK_RETURN_IF_ERROR(Prepare(batch, 0.0, /*dropout=*/false));
    PTK_RETURN_IF_ERROR(RunForward(/*train=*/false, 0));
    PTK_RETURN_IF_ERROR(RunHead(/*backward=*/false, logits));
    return Losses(batch);
  }

  absl::Status AllReduceGrads(Communicator* comm) override {
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

  absl::Status ReduceScatterGrads(Communicator* comm) override {
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

  absl::Status GradSumSquaresPartials(int64_t begin, int64_t end, std::vector<double>* out) override {
    if (begin < 0 || end > num_params() || begin > end)
      return absl::InvalidArgumentError(
          fmt::format("GradSumSquaresPartials: range [{}, {}) of {} parameters", begin, end, num_params()));
    if (begin == end) return absl::OkStatus();
    // One partial: SumSquares over the range (over [0, n), GradSumSquares' own bits).
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

  absl::Status AllGatherParams(Communicator* comm) override {
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

  absl::StatusOr<double> GradSumSquares() override {
    Begin();
    double* partials = Buf<double>(plan_.reduce);
    double* result = partials + SumSquaresPartials(num_params());
    PTK_RETURN_IF_ERROR(Op("grad norm", "grad norm", SumSquares(result, Grad(0), num_params(), partials, ctx_)));
    double host = 0;
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&host, result, sizeof host, cudaMemcpyDeviceToHost, ctx_.stream),
                             "reading the gradient norm");
    PTK_RETURN_IF_ERROR(Sync("the gradient norm"));
    return host;
  }

  absl::Status ScaleGrads(double s) override {
    Begin();
    return Op("grad scale", "grad scale", Scale(Grad(moments_begin()), moments_size(), static_cast<float>(s), ctx_));
  }

  // One launch over the table of the pieces this rank updates, the gradient scale folded in.
  absl::Status ScaledAdamWUpdate(double grad_scale, const AdamWParams& decay, const AdamWParams& no_decay) override {
    if (unfused_.adamw_per_tensor) return GPTModel::ScaledAdamWUpdate(grad_scale, decay, no_decay);
    const int64_t base = moments_begin();
    if (adamw_table_size_ < 0) {
      const std::vector<AdamWChunk> table = AdamWTable(layout(), base, base + moments_size());
      const size_t bytes = std::max<size_t>(1, table.size()) * sizeof(AdamWChunk);
      PTK_CUDA_RETURN_IF_ERROR(cudaMalloc(&adamw_table_, bytes), "allocating the AdamW table");
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
                            Buf<float>(plan_.exp_avg_sq), base, compute, static_cast<float>(grad_scale), decay,
                            no_decay, ctx_));
  }

  absl::Status AdamWUpdate(const AdamWParams& decay, const AdamWParams& no_decay) override {
    Begin();
    ++profiled_steps_;
    // The moments hold [moments_begin(), ...) only under ZeRO-1.
    const int64_t base = moments_begin();
    for (const ParamPiece& p : PiecesIn(layout(), base, base + moments_size())) {
      T* compute = kFlash ? Compute(p.offset) : nullptr;
      PTK_RETURN_IF_ERROR(Op("adamw", "adamw",
                             AdamW<T>(MasterOf(p.offset), Grad(p.offset), Buf<float>(plan_.exp_avg) + (p.offset - base),
                                      Buf<float>(plan_.exp_avg_sq) + (p.offset - base), p.size,
                                      p.no_weight_decay ? no_decay : decay, compute, ctx_)));
    }
    return absl::OkStatus();
  }

 protected:
  // Re-planned with the padded parameter buffers and the shard's moments (zero); the parameters
  // come back through the host.
  absl::Status ResizeMoments(const ParamShard& shard) override {
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

  // --overlap-grad-reduce. Each bucket, once the compute stream has enqueued its last gradient
  // op, is marked by an event; with NCCL the communication stream waits for the event and runs the
  // collective on the device buffer, with a host communicator (gloo) a thread waits for it, copies
  // the bucket out, reduces it and copies it back. Finishing makes the compute stream wait for all.
  absl::Status BeginBucketReduction(const std::vector<GradRange>& buckets) override {
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

  void LaunchBucket(int bucket, const GradRange& range) override {
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

  absl::Status EndBucketReduction() override {
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

  // On the worker thread: one bucket through the host.
  absl::Status HostBucket(int bucket) {
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

 private:
  template <typename U>
  U* Buf(int index) const {
    return reinterpret_cast<U*>(arena_ + plan_[index].offset);
  }
  float* Master(int64_t offset) const { return Buf<float>(plan_.master) + offset; }
  // The fp32 master of the parameter at `offset` of the flat layout, which AdamW updates: under a
  // sharded master (bf16/fp16 with ZeRO-1) inside this rank's shard only.
  float* MasterOf(int64_t offset) const {
    return plan_.master_sharded ? Buf<float>(plan_.master) + (offset - master_begin_) : Master(offset);
  }
  // A LayerNorm's fp32 weight or bias (`offset` is the tensor's start in the flat layout).
  const float* Ln(int64_t offset) const {
    if (!plan_.master_sharded) return Master(offset);
    return Buf<float>(plan_.ln_master) + LnCompactOffset(offset);
  }
  int64_t LnCompactOffset(int64_t offset) const {
    for (const LayerNormRun& r : ln_runs_)
      if (offset >= r.begin && offset < r.end) return r.compact + (offset - r.begin);
    PTK_CHECK_MSG(false, fmt::format("parameter offset {} is no LayerNorm's", offset));
    return 0;
  }
  float* Grad(int64_t offset) const { return Buf<float>(plan_.grads) + offset; }
  // The weights the products read: the master itself in fp32 mode, its rounded copy otherwise.
  T* Compute(int64_t offset) const {
    if constexpr (kFlash)
      return Buf<T>(plan_.compute) + offset;
    else
      return Master(offset);
  }
  T* Act(int index, int64_t layer, int64_t per_layer) const { return Buf<T>(index) + layer * per_layer; }
  float* Stats(int index, int64_t layer) const { return Buf<float>(index) + layer * 2 * plan_.n; }

  // An error here may come from any op enqueued since the last synchronisation (kernels fault
  // asynchronously): without PTK_CUDA_SYNC_OPS the message says how to find the op.
  absl::Status Sync(std::string_view what) const {
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

  // --ptk-profile-ops: an event after each op; at each synchronisation the time between
  // consecutive events is added to the op's category. Begin() starts a sequence (the time before it,
  // the host's, is nobody's). With PTK_CUDA_SYNC_OPS=1 (CudaModelOptions::sync_ops) every op is
  // followed by a synchronisation, and the first error names the op (`name`), its shapes and layer.
  void Begin() {
    layer_ = -1;
    if (profile_) RecordMark(nullptr);
  }
  absl::Status Op(const char* category, const char* name, absl::Status status) {
    if (!status.ok())
      return absl::Status(status.code(), fmt::format("{}: {}", OpWhere(name), std::string(status.message())));
    if (profile_) RecordMark(category);
    if (sync_ops_) {
      if (cudaError_t e = cudaStreamSynchronize(ctx_.stream); e != cudaSuccess)
        return CudaError(e, "cudaStreamSynchronize after the op (PTK_CUDA_SYNC_OPS=1)", OpWhere(name));
    }
    return status;
  }
  // "op fc1+gelu (n=4096 x c=768 -> 3072) of layer 3 of 12, a 4x1024 micro-batch, bf16, cuda:0".
  std::string OpWhere(const char* name) const {
    const GPTConfig& cf = config();
    const int64_t n = n_, c = cf.hidden_size, f = cf.ffn_hidden_size, vp = cf.padded_vocab_size;
    const std::string_view op(name);
    auto has = [&](std::string_view w) { return op.find(w) != std::string_view::npos; };
    std::string shapes;
    if (has("qkv"))
      shapes = fmt::format("n={} x c={} -> {}", n, c, 3 * c);
    else if (has("proj"))
      shapes = fmt::format("n={} x c={} -> {}", n, c, c);
    else if (has("fc1"))
      shapes = fmt::format("n={} x c={} -> {}", n, c, f);
    else if (has("fc2"))
      shapes = fmt::format("n={} x {} -> c={}", n, f, c);
    else if (has("gelu"))
      shapes = fmt::format("n={} x {}", n, f);
    else if (has("lm head") || has("loss"))
      shapes = fmt::format("rows {}..{} of n={} x c={} -> padded vocabulary {}", head_row0_, head_row0_ + head_rows_, n,
                           c, vp);
    else if (has("attention") && !has("dropout"))
      shapes = fmt::format("b={} t={} heads={} head dim={}{}", b_, t_, cf.num_attention_heads, cf.head_dim(),
                           kFlash ? " (cuDNN fused attention)" : "");
    else if (has("grad") || has("adamw") || has("compute copy"))
      shapes = fmt::format("{} parameters", num_params());
    else
      shapes = fmt::format("n={} x c={}", n, c);
    return fmt::format("op {} ({}){}, a {}x{} micro-batch, {}, cuda:{}", name, shapes,
                       layer_ >= 0 ? fmt::format(" of layer {} of {}", layer_, cf.num_layers) : "", b_, t_,
                       PrecisionName(PrecisionOf<T>()), ctx_.device);
  }
  void RecordMark(const char* category) {
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
  void CollectProfile() const {
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

 public:
  std::string ProfileReport() const override {
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

 private:
  absl::Status CheckSize(std::string_view what, size_t got, int64_t want) const {
    if (static_cast<int64_t>(got) == want) return absl::OkStatus();
    return absl::InvalidArgumentError(
        fmt::format("{}: {} values for {} (a model of {} parameters)", what, got, want, num_params()));
  }
  absl::Status Download(int index, std::span<float> out, int64_t want) const {
    PTK_RETURN_IF_ERROR(CheckSize(plan_[index].name, out.size(), want));
    return DownloadRange(index, out.data(), 0, want);
  }
  absl::Status Upload(int index, std::span<const float> in, int64_t want) {
    PTK_RETURN_IF_ERROR(CheckSize(plan_[index].name, in.size(), want));
    return UploadRange(index, in.data(), 0, want);
  }
  // `count` floats of buffer `index` from element `at`.
  absl::Status DownloadRange(int index, float* out, int64_t at, int64_t count) const {
    if (count == 0) return absl::OkStatus();
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, Buf<float>(index) + at, static_cast<size_t>(count) * sizeof(float),
                                             cudaMemcpyDeviceToHost, ctx_.stream),
                             fmt::format("copying {} to the host", plan_[index].name));
    return Sync(plan_[index].name);
  }
  // Under a sharded master: the gradient buffer holds every fp32 parameter (gathered, or written);
  // this rank's shard of the master, the LayerNorms' fp32 copy and the compute copy are taken from
  // it. The buffer keeps the weights until the next step's ZeroGrads (TrainStep zeroes it before
  // every accumulation): no second pass over it per step. On the stream; the caller synchronises.
  absl::Status TakeParamsFromGrads(std::string_view what) {
    const size_t f = sizeof(float);
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<float>(plan_.master), Grad(master_begin_),
                                             static_cast<size_t>(master_size_) * f, cudaMemcpyDeviceToDevice,
                                             ctx_.stream),
                             fmt::format("{}: the shard's fp32 master [{}, {})", what, master_begin_,
                                         master_begin_ + master_size_));
    for (const LayerNormRun& r : ln_runs_)
      PTK_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(Buf<float>(plan_.ln_master) + r.compact, Grad(r.begin), static_cast<size_t>(r.end - r.begin) * f,
                          cudaMemcpyDeviceToDevice, ctx_.stream),
          fmt::format("{}: LayerNorm parameters [{}, {})", what, r.begin, r.end));
    return CastFromFloat<T>(Compute(0), Grad(0), num_params(), ctx_);
  }

  // AllGatherParams under a sharded master: every rank's updated shard of the fp32 master is
  // gathered into the gradient buffer (the step no longer needs the gradients), from which the
  // compute copy is cast and the LayerNorms' fp32 copy taken, as with a whole master.
  absl::Status GatherShardedMaster(Communicator* comm) {
    const size_t f = sizeof(float);
    if (comm->device_collectives() || comm->size() == 1) {
      PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Grad(master_begin_), Buf<float>(plan_.master),
                                               static_cast<size_t>(master_size_) * f, cudaMemcpyDeviceToDevice,
                                               ctx_.stream),
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

  absl::Status UploadRange(int index, const float* in, int64_t at, int64_t count) {
    if (count == 0) return absl::OkStatus();
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<float>(index) + at, in, static_cast<size_t>(count) * sizeof(float),
                                             cudaMemcpyHostToDevice, ctx_.stream),
                             fmt::format("copying {} to the device", plan_[index].name));
    return Sync(plan_[index].name);
  }

  // (Re)plans the device memory for (b, t) and allocates it in one piece; the parameters, gradients
  // and moments (the plan's first buffers, whose offsets do not depend on the shape) move along.
  absl::Status Plan(int64_t b, int64_t t) {
    PlanOptions o;
    o.precision = PrecisionOf<T>();
    o.micro_batch_size = b;
    o.seq_length = t;
    o.attention_scratch_floats =
        kFlash ? 0 : AttentionBackwardScratch(AttentionShape{b, t, config().num_attention_heads, config().head_dim()});
    o.reduce_doubles = SumSquaresPartials(num_params());
    o.padded_params = padded_params_;
    o.moment_params = moment_params_;
    o.layernorm_scratch_floats = LayerNormBackwardScratch(b * t, config().hidden_size);
    o.logits_budget_bytes = logits_budget_bytes_;  // 0: from the free memory (PlanMemoryWithin)
    if constexpr (kFlash) {
      // cuDNN's fused attention asks for its own workspace (the backward's fp32 dQ accumulator, more
      // in deterministic mode): the plan makes room for the larger of it and the products'. Without
      // attention dropout (and in evaluation) attention runs over the whole micro-batch; with it,
      // training runs one sample per call (AttentionFwd).
      const AttentionShape shape{b, t, config().num_attention_heads, config().head_dim()};
      PTK_ASSIGN_OR_RETURN(const int64_t flash, FlashAttentionWorkspaceBytes<T>(shape, 0.0, ctx_));
      o.workspace_bytes = std::max<int64_t>(o.workspace_bytes, flash);
      if (config().attention_dropout > 0) {
        PTK_ASSIGN_OR_RETURN(const int64_t one,
                             FlashAttentionWorkspaceBytes<T>(AttentionShape{1, t, shape.nh, shape.hd},
                                                             config().attention_dropout, ctx_));
        o.workspace_bytes = std::max<int64_t>(o.workspace_bytes, one);
      }
    }
    size_t free_bytes = 0, total_bytes = 0;
    PTK_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes), "querying free device memory");
    // The LM head in one chunk when the device has room for all its logits (the old allocation,
    // about to be freed, counts as free).
    PTK_ASSIGN_OR_RETURN(
        MemoryPlan plan,
        PlanMemoryWithin(config(), num_params(), o,
                         static_cast<int64_t>(free_bytes) + (arena_ ? plan_.total_bytes : int64_t{0})));
    const int64_t kept = arena_ ? plan_[plan_.exp_avg_sq].offset + plan_[plan_.exp_avg_sq].bytes : 0;
    auto oom = [&](std::string_view why) {
      return absl::ResourceExhaustedError(fmt::format(
          "CUDA out of memory on cuda:{} ({}): the model needs {} for micro-batches of {}x{} ({}), {} free of {}: {}. "
          "Largest buffers: {}",
          ctx_.device, device_name_, FormatBytes(plan.total_bytes), b, t, PrecisionName(PrecisionOf<T>()),
          FormatBytes(static_cast<int64_t>(free_bytes)), FormatBytes(static_cast<int64_t>(total_bytes)), why,
          plan.Largest(4)));
    };
    if (plan.total_bytes > static_cast<int64_t>(free_bytes) + (arena_ ? plan_.total_bytes : 0))
      return oom("lower what the largest buffers name");
    char* arena = nullptr;
    if (cudaMalloc(&arena, static_cast<size_t>(plan.total_bytes)) != cudaSuccess) {
      (void)cudaGetLastError();
      return oom("cudaMalloc refused the allocation (fragmentation or another process)");
    }
    if (arena_) {
      cudaError_t e = cudaMemcpyAsync(arena, arena_, static_cast<size_t>(kept), cudaMemcpyDeviceToDevice, ctx_.stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize(ctx_.stream);
      if (e != cudaSuccess) {
        cudaFree(arena);
        return CudaError(e, "cudaMemcpyAsync", "moving the parameters to a re-planned allocation");
      }
      cudaFree(arena_);
    }
    arena_ = arena;
    plan_ = std::move(plan);
    ctx_.workspace = Buf<void>(plan_.workspace);
    ctx_.workspace_bytes = static_cast<size_t>(plan_[plan_.workspace].bytes);
    if (kept == 0) {
      // A fresh model: zero everything persistent (moments start at zero; parameters are written).
      PTK_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(arena_, 0, static_cast<size_t>(plan_[plan_.workspace].offset), ctx_.stream),
          "zeroing the model's memory");
    }
    for (int i = 0; i < 2; ++i) {
      PTK_RETURN_IF_ERROR(pinned_[i].Reserve(
          static_cast<size_t>(InputBytes(plan_.n) + StreamTableSize(config().num_layers, plan_.b) * 8)));
      if (!inputs_copied_[i])
        PTK_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&inputs_copied_[i], cudaEventDisableTiming),
                                 "creating an input-copy event");
    }
    PTK_RETURN_IF_ERROR(losses_.Reserve(static_cast<size_t>(plan_.n) * sizeof(float)));
    PTK_RETURN_IF_ERROR(embedding_plan_.Reserve(plan_.n));
    return Sync("planning device memory");
  }

  // Checks the batch, re-plans when it is larger than planned, and copies its inputs (tokens,
  // labels, positions, the per-token loss weights, the dropout streams) through pinned memory.
  absl::Status Prepare(const ModelBatch& batch, double loss_scale, bool dropout) {
    PTK_RETURN_IF_ERROR(ValidateBatch(config(), batch));
    if (batch.b > plan_.b || batch.t > plan_.t)
      PTK_RETURN_IF_ERROR(Plan(std::max(batch.b, plan_.b), std::max(batch.t, plan_.t)));
    b_ = batch.b;
    t_ = batch.t;
    n_ = batch.b * batch.t;
    const size_t n = static_cast<size_t>(n_);
    const int64_t stride = AlignUp(static_cast<int64_t>(n) * 4);
    // This slot's previous copy to the device (two micro-batches ago) must have run before the
    // slot is refilled; the stream may still be busy with the previous pass.
    Pinned& pinned = pinned_[input_slot_];
    if (profile_) RecordMark(nullptr);  // the copies below are timed from here ("copies")
    PTK_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(inputs_copied_[input_slot_]), "waiting for an input slot");
    std::memcpy(pinned.at<int32_t>(0), batch.tokens, n * 4);
    std::memcpy(pinned.at<int32_t>(stride), batch.labels, n * 4);
    std::memcpy(pinned.at<int32_t>(2 * stride), batch.position_ids, n * 4);
    float* w = pinned.at<float>(3 * stride);
    for (size_t i = 0; i < n; ++i) w[i] = static_cast<float>(batch.loss_mask[i] * loss_scale);
    const int64_t in_bytes = InputBytes(n_);
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<char>(plan_.inputs), pinned.at<char>(0),
                                             static_cast<size_t>(in_bytes), cudaMemcpyHostToDevice, ctx_.stream),
                             fmt::format("copying a {}x{} micro-batch to the device", b_, t_));
    if (dropout) {
      const int64_t L = config().num_layers;
      uint64_t* table = pinned.at<uint64_t>(static_cast<size_t>(in_bytes));
      for (int64_t l = 0; l <= L; ++l)
        for (int64_t site = 0; site < 4; ++site)
          for (int64_t r = 0; r < b_; ++r)
            table[StreamIndex(l, site, b_) + r] = DropoutStream(static_cast<uint64_t>(batch.sample_keys[r]),
                                                                static_cast<uint64_t>(l), static_cast<uint64_t>(site));
      PTK_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(Buf<uint64_t>(plan_.streams), table, static_cast<size_t>(StreamTableSize(L, b_)) * 8,
                          cudaMemcpyHostToDevice, ctx_.stream),
          "copying the dropout streams to the device");
      // cuDNN's attention dropout (bf16/fp16) takes one seed per call, and its mask depends on a
      // sample's place in the call's batch: with dropout, attention runs one sample per call, seeded
      // with the sample's key for the layer, so that the mask depends on (seed, sample, layer)
      // alone (not on the micro-batch size or the data-parallel layout), and backward sees it again.
      flash_keys_.assign(static_cast<size_t>(L * b_), 0);
      for (int64_t l = 0; l < L; ++l)
        for (int64_t r = 0; r < b_; ++r)
          flash_keys_[static_cast<size_t>(l * b_ + r)] = table[StreamIndex(l, kAttentionProbs, b_) + r];
    }
    PTK_RETURN_IF_ERROR(Op("copies", "input copy", absl::OkStatus()));
    PTK_CUDA_RETURN_IF_ERROR(cudaEventRecord(inputs_copied_[input_slot_], ctx_.stream), "marking an input slot");
    input_slot_ ^= 1;
    tokens_host_ = batch.tokens;
    positions_host_ = batch.position_ids;
    return absl::OkStatus();
  }
  const int32_t* Tokens() const { return Buf<int32_t>(plan_.inputs); }
  const int32_t* Labels() const { return Buf<int32_t>(plan_.inputs) + AlignUp(n_ * 4) / 4; }
  const int32_t* Positions() const { return Buf<int32_t>(plan_.inputs) + 2 * AlignUp(n_ * 4) / 4; }
  const float* LossWeights() const {
    return reinterpret_cast<const float*>(Buf<int32_t>(plan_.inputs) + 3 * AlignUp(n_ * 4) / 4);
  }
  const uint64_t* Streams(int64_t layer, int64_t site) const {
    return Buf<uint64_t>(plan_.streams) + StreamIndex(layer, site, b_);
  }

  absl::Status Dropout(T* x, int64_t layer, int64_t site, double p, uint64_t seed) {
    if (p <= 0.0) return absl::OkStatus();
    return DropoutRows<T>(x, b_, t_ * config().hidden_size, Streams(layer, site), p, seed, ctx_);
  }

  // Up to the final LayerNorm's output.
  absl::Status RunForward(bool train, uint64_t seed) {
    const GPTConfig& cf = config();
    const ParamLayout& pl = layout();
    const int64_t n = n_, c = cf.hidden_size, f = cf.ffn_hidden_size, L = cf.num_layers;
    const double hp = train ? cf.hidden_dropout : 0.0, ap = train ? cf.attention_dropout : 0.0;
    const double eps = cf.layernorm_epsilon;
    const AttentionShape shape{b_, t_, cf.num_attention_heads, cf.head_dim()};
    T* tmp = Buf<T>(plan_.tmp);

    layer_ = -1;
    PTK_RETURN_IF_ERROR(Op("embedding", "embedding",
                           EmbeddingForward<T>(Act(plan_.resid, 0, n * c), Tokens(), Positions(), Compute(pl.wte),
                                               Compute(pl.wpe), n, c, ctx_)));
    PTK_RETURN_IF_ERROR(
        Op("dropout", "embedding dropout", Dropout(Act(plan_.resid, 0, n * c), L, kEmbeddingDropout, hp, seed)));
    const LayerParams& first = pl.layers[0];
    PTK_RETURN_IF_ERROR(
        Op("layernorm", "ln1",
           LayerNormForward<T>(Act(plan_.ln1, 0, n * c), Stats(plan_.ln1_stats, 0), Stats(plan_.ln1_stats, 0) + n,
                               Act(plan_.resid, 0, n * c), Ln(first.ln1_w), Ln(first.ln1_b), n, c, eps, ctx_)));
    for (int64_t l = 0; l < L; ++l) {
      layer_ = l;
      const LayerParams& lp = pl.layers[static_cast<size_t>(l)];
      T* qkv = Act(plan_.qkv, l, n * 3 * c);
      T* atty = Act(plan_.atty, l, n * c);
      PTK_RETURN_IF_ERROR(
          Op("matmul", "qkv",
             MatmulForward<T>(qkv, Act(plan_.ln1, l, n * c), Compute(lp.qkv_w), Compute(lp.qkv_b), n, c, 3 * c, ctx_)));
      PTK_RETURN_IF_ERROR(Op("attention", "attention", AttentionFwd(atty, qkv, l, shape, ap, seed)));
      PTK_RETURN_IF_ERROR(
          Op("matmul", "proj", MatmulForward<T>(tmp, atty, Compute(lp.proj_w), Compute(lp.proj_b), n, c, c, ctx_)));
      PTK_RETURN_IF_ERROR(Op("dropout", "attention-out dropout", Dropout(tmp, l, kAttentionOutDropout, hp, seed)));
      PTK_RETURN_IF_ERROR(Op(
          "layernorm", "residual+ln2",
          ResidualLayerNormForward<T>(Act(plan_.resid_mid, l, n * c), Act(plan_.ln2, l, n * c),
                                      Stats(plan_.ln2_stats, l), Stats(plan_.ln2_stats, l) + n,
                                      Act(plan_.resid, l, n * c), tmp, Ln(lp.ln2_w), Ln(lp.ln2_b), n, c, eps, ctx_)));
      PTK_RETURN_IF_ERROR(Op("matmul", "fc1+gelu",
                             MatmulForward<T>(Act(plan_.fc1, l, n * f), Act(plan_.ln2, l, n * c), Compute(lp.fc1_w),
                                              Compute(lp.fc1_b), n, c, f, ctx_, Act(plan_.gelu, l, n * f))));
      PTK_RETURN_IF_ERROR(
          Op("matmul", "fc2",
             MatmulForward<T>(tmp, Act(plan_.gelu, l, n * f), Compute(lp.fc2_w), Compute(lp.fc2_b), n, f, c, ctx_)));
      PTK_RETURN_IF_ERROR(Op("dropout", "mlp-out dropout", Dropout(tmp, l, kMlpOutDropout, hp, seed)));
      // resid[l+1] = resid_mid[l] + tmp, then the next LayerNorm (the next layer's or the final one).
      const bool last = l + 1 == L;
      const LayerParams* next = last ? nullptr : &pl.layers[static_cast<size_t>(l + 1)];
      T* ln_out = last ? Buf<T>(plan_.lnf) : Act(plan_.ln1, l + 1, n * c);
      float* stats = last ? Buf<float>(plan_.lnf_stats) : Stats(plan_.ln1_stats, l + 1);
      PTK_RETURN_IF_ERROR(
          Op("layernorm", "residual+ln",
             ResidualLayerNormForward<T>(Act(plan_.resid, l + 1, n * c), ln_out, stats, stats + n,
                                         Act(plan_.resid_mid, l, n * c), tmp, Ln(last ? pl.lnf_w : next->ln1_w),
                                         Ln(last ? pl.lnf_b : next->ln1_b), n, c, eps, ctx_)));
    }
    layer_ = -1;
    return absl::OkStatus();
  }

  absl::Status AttentionFwd(T* atty, const T* qkv, int64_t l, const AttentionShape& shape, double ap, uint64_t seed) {
    if constexpr (kFlash) {
      const int64_t nh = config().num_attention_heads, c = config().hidden_size;
      float* stats = Buf<float>(plan_.attn_saved) + l * b_ * nh * t_;
      if (ap <= 0) return FlashAttentionForward<T>(atty, stats, qkv, shape, 0.0, 0, 0, ctx_);
      // Dropout: one sample per call, its own key (Prepare).
      const AttentionShape one{1, t_, nh, config().head_dim()};
      for (int64_t r = 0; r < b_; ++r)
        PTK_RETURN_IF_ERROR(FlashAttentionForward<T>(atty + r * t_ * c, stats + r * nh * t_, qkv + r * t_ * 3 * c, one,
                                                     ap, seed ^ flash_keys_[static_cast<size_t>(l * b_ + r)], 0, ctx_));
      return absl::OkStatus();
    } else {
      float* probs = Buf<float>(plan_.attn_saved) +
                     (config().recompute_activations ? 0 : l) * b_ * config().num_attention_heads * t_ * t_;
      return AttentionForward(atty, probs, qkv, shape, ap, seed, ap > 0 ? Streams(l, kAttentionProbs) : nullptr, ctx_);
    }
  }

  // The LM head and the loss, chunk by chunk of rows. With backward, each chunk's logits become
  // their gradient at once and flow back into the final LayerNorm's gradient (dln) and the output
  // weight's gradient; without, the losses (and, when asked, the logits) are all that is kept.
  absl::Status RunHead(bool backward, std::vector<float>* logits_out) {
    const GPTConfig& cf = config();
    const int64_t n = n_, c = cf.hidden_size, vp = cf.padded_vocab_size, out_w = layout().out_w;
    T* logits = Buf<T>(plan_.logits);
    const T* lnf = Buf<T>(plan_.lnf);
    float* losses = Buf<float>(plan_.losses);
    if (logits_out) logits_out->assign(static_cast<size_t>(n * vp), 0.0f);
    std::vector<T> chunk_host;
    layer_ = -1;
    // Balanced chunks of whole tiles (one when the plan had room for every row): each chunk's
    // output-weight gradient is accumulated once, by its dW product.
    int64_t next_row = 0;
    for (const int64_t rows : LogitChunks(n, plan_.logit_chunk_rows)) {
      const int64_t r0 = next_row;
      next_row += rows;
      head_row0_ = r0;
      head_rows_ = rows;
      PTK_RETURN_IF_ERROR(Op(
          "matmul", "lm head",
          MatmulForward<T>(logits, lnf + r0 * c, Compute(out_w), static_cast<const T*>(nullptr), rows, c, vp, ctx_)));
      if (backward) {
        PTK_RETURN_IF_ERROR(
            Op("loss", "loss+dlogits",
               SoftmaxCrossEntropyFused<T>(logits, losses + r0, Labels() + r0, LossWeights() + r0, rows, vp, ctx_)));
        PTK_RETURN_IF_ERROR(Op("matmul", "lm head backward",
                               MatmulBackward<T>(Buf<T>(plan_.dln) + r0 * c, Grad(out_w), nullptr, logits, lnf + r0 * c,
                                                 Compute(out_w), rows, c, vp, ctx_)));
        continue;
      }
      PTK_RETURN_IF_ERROR(
          Op("loss", "loss", SoftmaxCrossEntropyForward<T>(losses + r0, logits, Labels() + r0, rows, vp, ctx_)));
      if (logits_out) {
        chunk_host.resize(static_cast<size_t>(rows * vp));
        PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(chunk_host.data(), logits, chunk_host.size() * sizeof(T),
                                                 cudaMemcpyDeviceToHost, ctx_.stream),
                                 "copying logits to the host");
        PTK_RETURN_IF_ERROR(Sync("copying logits"));
        float* dst = logits_out->data() + r0 * vp;
        for (size_t i = 0; i < chunk_host.size(); ++i) dst[i] = ToFloat(chunk_host[i]);
      }
    }
    return absl::OkStatus();
  }

  // From the final LayerNorm's output gradient (dln, left by RunHead) down to the embeddings.
  absl::Status RunBackward(bool train, uint64_t seed) {
    const GPTConfig& cf = config();
    const ParamLayout& pl = layout();
    const int64_t n = n_, c = cf.hidden_size, f = cf.ffn_hidden_size, L = cf.num_layers;
    const double hp = train ? cf.hidden_dropout : 0.0, ap = train ? cf.attention_dropout : 0.0;
    const AttentionShape shape{b_, t_, cf.num_attention_heads, cf.head_dim()};
    const size_t act_bytes = static_cast<size_t>(n * c) * sizeof(T);
    T *dresid = Buf<T>(plan_.dresid), *dtmp = Buf<T>(plan_.dtmp), *dln = Buf<T>(plan_.dln), *dff = Buf<T>(plan_.dff),
      *dqkv = Buf<T>(plan_.dqkv), *datt = Buf<T>(plan_.datt);

    layer_ = -1;
    PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dresid, 0, act_bytes, ctx_.stream), "zeroing the residual gradient");
    PTK_RETURN_IF_ERROR(
        Op("layernorm", "final ln backward",
           LnBackward(dresid, Grad(pl.lnf_w), Grad(pl.lnf_b), dln, Act(plan_.resid, L, n * c), Ln(pl.lnf_w),
                                Buf<float>(plan_.lnf_stats), Buf<float>(plan_.lnf_stats) + n, n, c,
                                Buf<float>(plan_.ln_scratch), ctx_)));
    GradsReady(0);  // the final LayerNorm (and an untied output layer): --overlap-grad-reduce's buckets
    for (int64_t l = L - 1; l >= 0; --l) {
      layer_ = l;
      const LayerParams& lp = pl.layers[static_cast<size_t>(l)];
      // MLP: resid[l+1] = resid_mid + dropout(fc2(gelu(fc1(ln2(resid_mid)))))
      PTK_ASSIGN_OR_RETURN(const T* dmlp, BranchGrad(dresid, dtmp, act_bytes, l, kMlpOutDropout, hp, seed));
      PTK_RETURN_IF_ERROR(Op("matmul", "fc2 backward",
                             MatmulBackward<T>(dff, Grad(lp.fc2_w), Grad(lp.fc2_b), dmlp, Act(plan_.gelu, l, n * f),
                                               Compute(lp.fc2_w), n, f, c, ctx_, false,
                                               unfused_.gelu_backward ? nullptr : Act(plan_.fc1, l, n * f))));
      if (unfused_.gelu_backward)
        PTK_RETURN_IF_ERROR(
            Op("gelu", "gelu backward", GeluBackward<T>(dff, Act(plan_.fc1, l, n * f), dff, n * f, ctx_)));
      PTK_RETURN_IF_ERROR(Op("matmul", "fc1 backward",
                             MatmulBackward<T>(dln, Grad(lp.fc1_w), Grad(lp.fc1_b), dff, Act(plan_.ln2, l, n * c),
                                               Compute(lp.fc1_w), n, c, f, ctx_)));
      PTK_RETURN_IF_ERROR(
          Op("layernorm", "ln2 backward",
             LnBackward(dresid, Grad(lp.ln2_w), Grad(lp.ln2_b), dln, Act(plan_.resid_mid, l, n * c),
                                  Ln(lp.ln2_w), Stats(plan_.ln2_stats, l), Stats(plan_.ln2_stats, l) + n, n, c,
                                  Buf<float>(plan_.ln_scratch), ctx_)));
      // Attention: resid_mid = resid[l] + dropout(proj(attention(qkv(ln1(resid[l])))))
      PTK_ASSIGN_OR_RETURN(const T* dproj,
                           BranchGrad(dresid, dtmp, act_bytes, l, kAttentionOutDropout, hp, seed));
      PTK_RETURN_IF_ERROR(Op("matmul", "proj backward",
                             MatmulBackward<T>(datt, Grad(lp.proj_w), Grad(lp.proj_b), dproj, Act(plan_.atty, l, n * c),
                                               Compute(lp.proj_w), n, c, c, ctx_)));
      PTK_RETURN_IF_ERROR(Op("attention", "attention backward", AttentionBwd(dqkv, datt, l, shape, ap, seed)));
      PTK_RETURN_IF_ERROR(Op("matmul", "qkv backward",
                             MatmulBackward<T>(dln, Grad(lp.qkv_w), Grad(lp.qkv_b), dqkv, Act(plan_.ln1, l, n * c),
                                               Compute(lp.qkv_w), n, c, 3 * c, ctx_)));
      PTK_RETURN_IF_ERROR(
          Op("layernorm", "ln1 backward",
             LnBackward(dresid, Grad(lp.ln1_w), Grad(lp.ln1_b), dln, Act(plan_.resid, l, n * c), Ln(lp.ln1_w),
                                  Stats(plan_.ln1_stats, l), Stats(plan_.ln1_stats, l) + n, n, c,
                                  Buf<float>(plan_.ln_scratch), ctx_)));
      GradsReady(static_cast<size_t>(L - l));  // layer l
    }
    layer_ = -1;
    PTK_RETURN_IF_ERROR(Op("dropout", "embedding dropout backward", Dropout(dresid, L, kEmbeddingDropout, hp, seed)));
    PTK_RETURN_IF_ERROR(Op(
        "embedding", "embedding backward",
        EmbeddingBackward<T>(Grad(pl.wte), Grad(pl.wpe), dresid, Tokens(), Positions(), tokens_host_, positions_host_,
                             n, c, cf.padded_vocab_size, cf.max_position_embeddings, &embedding_plan_, ctx_)));
    GradsReady(static_cast<size_t>(L) + 1);  // the embeddings
    return absl::OkStatus();
  }

  // The gradient a residual branch's backward starts from: the residual gradient itself where no
  // dropout runs on the branch's output (its product reads it before the LayerNorm's backward adds
  // to it), else a copy with the dropout mask applied. CudaModelOptions::unfused.residual_grad_copy
  // copies in every case (the oracle).
  absl::StatusOr<const T*> BranchGrad(const T* dresid, T* dtmp, size_t bytes, int64_t l, int64_t site, double p,
                                      uint64_t seed) {
    if (p <= 0.0 && !unfused_.residual_grad_copy) return dresid;
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dtmp, dresid, bytes, cudaMemcpyDeviceToDevice, ctx_.stream),
                             "copying the residual gradient");
    PTK_RETURN_IF_ERROR(Op("copies", "residual gradient copy", absl::OkStatus()));
    PTK_RETURN_IF_ERROR(Op("dropout", site == kMlpOutDropout ? "mlp-out dropout backward" : "attention-out dropout backward",
                           Dropout(dtmp, l, site, p, seed)));
    return dtmp;
  }

  // LayerNormBackward, or its rows-in-series oracle (CudaModelOptions::unfused).
  absl::Status LnBackward(T* dinp, float* dw, float* db, const T* dout, const T* inp, const float* w, const float* mean,
                          const float* rstd, int64_t n, int64_t c, float* scratch, const CudaContext& ctx) {
    if (unfused_.layernorm_rows_in_series)
      return LayerNormBackwardRowsInSeries<T>(dinp, dw, db, dout, inp, w, mean, rstd, n, c, scratch, ctx);
    return LayerNormBackward<T>(dinp, dw, db, dout, inp, w, mean, rstd, n, c, scratch, ctx);
  }

  absl::Status AttentionBwd(T* dqkv, const T* datt, int64_t l, const AttentionShape& shape, double ap, uint64_t seed) {
    const int64_t n = n_, c = config().hidden_size;
    const T* qkv = Act(plan_.qkv, l, n * 3 * c);
    if constexpr (kFlash) {
      const int64_t nh = config().num_attention_heads;
      const T* out = Act(plan_.atty, l, n * c);
      const float* stats = Buf<float>(plan_.attn_saved) + l * b_ * nh * t_;
      if (ap <= 0) return FlashAttentionBackward<T>(dqkv, datt, out, stats, qkv, shape, 0.0, 0, 0, ctx_);
      // Dropout: one sample per call with the forward's key, so the same mask.
      const AttentionShape one{1, t_, nh, config().head_dim()};
      for (int64_t r = 0; r < b_; ++r) {
        const int64_t row = r * t_;
        PTK_RETURN_IF_ERROR(FlashAttentionBackward<T>(dqkv + row * 3 * c, datt + row * c, out + row * c,
                                                      stats + r * nh * t_, qkv + row * 3 * c, one, ap,
                                                      seed ^ flash_keys_[static_cast<size_t>(l * b_ + r)], 0, ctx_));
      }
      return absl::OkStatus();
    } else {
      const bool recompute = config().recompute_activations;
      float* probs = Buf<float>(plan_.attn_saved) + (recompute ? 0 : l) * b_ * config().num_attention_heads * t_ * t_;
      const uint64_t* streams = ap > 0 ? Streams(l, kAttentionProbs) : nullptr;
      if (recompute)  // the probabilities again; the output lands in a scratch buffer
        PTK_RETURN_IF_ERROR(AttentionForward(Buf<float>(plan_.tmp), probs, qkv, shape, ap, seed, streams, ctx_));
      return AttentionBackward(dqkv, datt, qkv, probs, shape, ap, seed, streams, Buf<float>(plan_.attn_scratch), ctx_);
    }
  }

  // The masked loss sum and token count, summed on the host exactly as the CPU model does.
  absl::StatusOr<LossSum> Losses(const ModelBatch& batch) {
    const size_t n = static_cast<size_t>(n_);
    float* host = losses_.at<float>(0);
    PTK_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host, Buf<float>(plan_.losses), n * sizeof(float), cudaMemcpyDeviceToHost, ctx_.stream),
        "copying the losses to the host");
    PTK_RETURN_IF_ERROR(Op("copies", "loss copy", absl::OkStatus()));
    PTK_RETURN_IF_ERROR(Sync(fmt::format("the pass over a {}x{} micro-batch", b_, t_)));
    return SumLosses(host, std::span<const float>(batch.loss_mask, n));
  }
  static LossSum SumLosses(const float* host, std::span<const float> mask) {
    LossSum s;
    for (size_t i = 0; i < mask.size(); ++i) {
      if (mask[i] == 0.0f) continue;
      s.loss_sum += static_cast<double>(host[i]) * mask[i];
      s.tokens += mask[i];
    }
    return s;
  }

  CudaContext ctx_;
  mutable GemmFallbacks fallbacks_;  // ctx_.fallbacks
  std::string device_name_;
  MemoryPlan plan_;
  char* arena_ = nullptr;
  // The micro-batch inputs in two pinned slots, used in turn: a slot is refilled once the copy
  // out of it (recorded by its event) has run, so the host need not wait for the previous pass.
  Pinned pinned_[2], losses_;
  cudaEvent_t inputs_copied_[2] = {nullptr, nullptr};
  int input_slot_ = 0;
  // ForwardBackwardDeferred's per-token losses (a pinned slot per pending micro-batch) and masks.
  std::vector<std::unique_ptr<Pinned>> loss_slots_;
  std::vector<std::vector<float>> pending_masks_;
  size_t pending_losses_ = 0;
  int64_t b_ = 0, t_ = 0, n_ = 0;
  const int32_t* tokens_host_ = nullptr;
  const int32_t* positions_host_ = nullptr;
  std::vector<uint64_t> flash_keys_;
  std::vector<float> host_grads_;  // host staging for a host-memory communicator (gloo)
  int64_t padded_params_ = 0;      // ZeRO-1's plan (PlanOptions)
  // --overlap-grad-reduce: the communication stream, an event per bucket, the host thread (gloo).
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t comm_done_ = nullptr;
  std::vector<cudaEvent_t> bucket_events_;
  std::vector<GradRange> buckets_;
  std::unique_ptr<BucketWorker> worker_;
  absl::Status launch_error_;
  int64_t moment_params_ = -1;
  // The shard whose fp32 master this rank keeps when plan_.master_sharded.
  int64_t master_begin_ = 0, master_size_ = 0;
  // The LayerNorms' parameters as runs of the flat layout, each at `compact` in ln_master.
  std::vector<LayerNormRun> ln_runs_ = LayerNormRuns(layout());
  EmbeddingBackwardPlan embedding_plan_;
  bool profile_ = false;
  bool sync_ops_ = false;            // PTK_CUDA_SYNC_OPS=1: CudaModelOptions::sync_ops
  int64_t logits_budget_bytes_ = 0;  // CudaModelOptions::logits_budget_bytes (0: the plan's default)
  CudaModelOptions::Unfused unfused_;
  // The multi-tensor AdamW table (adamw_table.h) on the device; built at the first update.
  AdamWChunk* adamw_table_ = nullptr;
  int64_t adamw_table_size_ = -1;
  // What OpWhere names: the layer being run (-1: none), the LM head's chunk of rows.
  int64_t layer_ = -1, head_row0_ = 0, head_rows_ = 0;
  int64_t profiled_steps_ = 0;
  mutable std::vector<std::pair<const char*, cudaEvent_t>> marks_;
  mutable std::vector<cudaEvent_t> free_events_;
  mutable std::map<std::string, double> op_ms_;
};

template <typename T>
absl::StatusOr<std::unique_ptr<GPTModel>> Make(const GPTConfig& config, int device, bool deterministic,
                                               int64_t micro_batch_size, bool profile,
                                               const CudaModelOptions& options) {
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(config));
  auto m = std::make_unique<CudaGPTModelImpl<T>>(std::move(layout));
  PTK_RETURN_IF_ERROR(m->Init(device, deterministic, micro_batch_size, profile, options));
  return std::unique_ptr<GPTModel>(std::move(m));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GPTModel>> CreateCudaGPTModel(const GPTConfig& config, Precision precision,
                                                             int device_index, bool deterministic,
                                                             int64_t micro_batch_size, bool profile,
                                                             const CudaModelOptions& options) {
  switch (precision) {
    case Precision::kBf16:
      return Make<__nv_bfloat16>(config, device_index, deterministic, micro_batch_size, profile, options);
    case Precision::kFp16: return Make<__half>(config, device_index, deterministic, micro_batch_size, profile, options);
    case Precision::kFp32: break;
  }
  return Make<float>(config, device_index, deterministic, micro_batch_size, profile, options);
}

}  // namespace ptk::cuda
