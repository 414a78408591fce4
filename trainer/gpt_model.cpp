// What every backend shares: the model's common state (ZeRO-1 shard, gradient buckets), the batch
// checks.
#include "trainer/gpt_model.h"

#include <algorithm>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {

std::string_view DeviceName(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }
std::string_view PrecisionName(Precision p) {
  switch (p) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp32: break;
  }
  return "fp32";
}

absl::Status GPTModel::InitWeights(uint64_t seed) {
  std::vector<float> host(static_cast<size_t>(num_params()));
  layout_.InitWeights(seed, host);
  return WriteParams(host);
}

absl::Status GPTModel::ReadOwnedParams(std::span<float> out) const {
  if (static_cast<int64_t>(out.size()) != moments_size())
    return absl::InvalidArgumentError(
        fmt::format("ReadOwnedParams: {} values for a range of {} parameters", out.size(), moments_size()));
  std::vector<float> all(static_cast<size_t>(num_params()));
  PTK_RETURN_IF_ERROR(ReadParams(all));
  if (ranges_sharded_) {  // the owned ranges, packed
    auto at = out.begin();
    for (const GradRange& g : owned_) at = std::copy(all.begin() + g.begin, all.begin() + g.end, at);
    return absl::OkStatus();
  }
  std::copy_n(all.begin() + moments_begin(), moments_size(), out.begin());
  return absl::OkStatus();
}

absl::Status GPTModel::ShardOptimizerState(const ParamShard& shard) {
  if (shard_) return absl::FailedPreconditionError("the optimizer state is sharded already");
  if (shard.num_params != num_params())
    return absl::InvalidArgumentError(
        fmt::format("a shard of {} parameters for a model of {}", shard.num_params, num_params()));
  PTK_RETURN_IF_ERROR(ResizeMoments(shard));
  shard_ = shard;
  return absl::OkStatus();
}

absl::Status GPTModel::ShardOptimizerStateRanges(std::vector<GradRange> owned) {
  if (shard_ || ranges_sharded_) return absl::FailedPreconditionError("the optimizer state is sharded already");
  int64_t total = 0, at = 0;
  for (const GradRange& g : owned) {
    if (g.begin < at || g.end < g.begin || g.end > num_params())
      return absl::InvalidArgumentError(fmt::format(
          "ShardOptimizerStateRanges: range [{}, {}) of {} parameters out of order", g.begin, g.end, num_params()));
    at = g.end;
    total += g.size();
  }
  PTK_RETURN_IF_ERROR(ResizeMomentsPacked(total));
  owned_ = std::move(owned);
  owned_size_ = total;
  ranges_sharded_ = true;
  return absl::OkStatus();
}

absl::Status GPTModel::ResizeMomentsPacked(int64_t) {
  return absl::UnimplementedError(fmt::format("{}: no optimizer state sharded by ranges", Describe()));
}

absl::Status GPTModel::StartGradReduction(Communicator* comm, const std::vector<GradRange>& buckets) {
  if (reduce_comm_) return absl::FailedPreconditionError("a gradient reduction is armed already");
  int64_t at = num_params();
  for (const GradRange& b : buckets) {  // contiguous, descending, tiling the buffer
    if (b.end != at || b.begin >= b.end)
      return absl::InvalidArgumentError("gradient buckets must tile the buffer from its end down");
    at = b.begin;
  }
  if (at != 0) return absl::InvalidArgumentError("gradient buckets must tile the buffer from its end down");
  if (ready_order_.empty()) ready_order_ = BackwardReadyOrder(layout_);
  tracker_ = BucketTracker(buckets);
  launched_in_backward_ = 0;
  reduce_comm_ = comm;
  absl::Status st = BeginBucketReduction(buckets);
  if (!st.ok()) reduce_comm_ = nullptr;
  return st;
}

absl::Status GPTModel::FinishGradReduction() {
  if (!reduce_comm_) return absl::FailedPreconditionError("no gradient reduction is armed");
  absl::Status st = EndBucketReduction();
  if (st.ok() && !tracker_.AllDone())
    st = absl::InternalError("backward did not finish every gradient bucket (was ForwardBackward run?)");
  reduce_comm_ = nullptr;
  return st;
}

void GPTModel::GradsReady(size_t index) {
  if (!reduce_comm_) return;
  if (layout_.virtual_size > 1) {  // only the chunk's last backward, and only its own ranges
    const size_t L = layout_.layers.size();
    const int owner = index == 0  ? layout_.virtual_size - 1
                      : index > L ? 0
                                  : layout_.ChunkOfLayer(static_cast<int64_t>(L - index));
    if (!last_backward_of_chunk_ || owner != chunk_) return;
  }
  const GradRange& r = ready_order_[index];
  for (int b : tracker_.MarkReady(r.begin, r.end)) {
    ++launched_in_backward_;
    LaunchBucket(b, tracker_.buckets()[static_cast<size_t>(b)]);
  }
}

absl::Status GPTModel::ReduceHostBucket(float* grads, const GradRange& range) {
  if (shard_) return reduce_comm_->ReduceScatterSum(grads + range.begin, shard_->CountsIn(range.begin, range.end));
  if (expert_comm_ != nullptr) return ReduceExpertParallelBucket(grads, range);
  return reduce_comm_->AllReduceSum(grads + range.begin, range.size());
}

// Expert parallelism (ReduceExpertParallelGrads' sums, bucket by bucket): the bucket's expert weights over the
// expert-data group (nothing to add at one rank), every other run over the data group. Each element gets the bits
// the whole buffer's reduction gives it (gloo adds in rank order).
absl::Status GPTModel::ReduceExpertParallelBucket(float* grads, const GradRange& range) {
  Communicator* expert_data = expert_data_comm_;
  Communicator* run_comm = nullptr;  // the run [run_begin, run_end) of one group, summed at once
  int64_t run_begin = range.begin, run_end = range.begin;
  auto flush = [&]() -> absl::Status {
    if (run_comm == nullptr || run_comm->size() == 1 || run_end == run_begin) return absl::OkStatus();
    return run_comm->AllReduceSum(grads + run_begin, run_end - run_begin);
  };
  for (const ParamInfo& p : layout_.infos) {
    const int64_t a = std::max(range.begin, p.offset), b = std::min(range.end, p.offset + p.size);
    if (a >= b) continue;
    Communicator* comm = p.expert ? expert_data : reduce_comm_;
    if (comm != run_comm || a != run_end) {
      PTK_RETURN_IF_ERROR(flush());
      run_comm = comm;
      run_begin = a;
    }
    run_end = b;
  }
  return flush();
}

absl::Status ValidateBatch(const GPTConfig& cf, const ModelBatch& batch) {
  if (batch.b < 1 || batch.t < 1 || batch.t > cf.seq_length)
    return absl::InvalidArgumentError(
        fmt::format("micro-batch of {}x{} tokens for a model of --seq-length {}", batch.b, batch.t, cf.seq_length));
  const int64_t n = batch.b * batch.t;
  for (int64_t i = 0; i < n; ++i) {
    if (batch.tokens[i] < 0 || batch.tokens[i] >= cf.padded_vocab_size || batch.labels[i] < 0 ||
        batch.labels[i] >= cf.padded_vocab_size)
      return absl::InvalidArgumentError(
          fmt::format("sample row {}, position {}: token id {} / label {} outside the vocabulary of {} (padded {}); "
                      "was the data tokenized with another vocabulary?",
                      i / batch.t, i % batch.t, batch.tokens[i], batch.labels[i], cf.vocab_size, cf.padded_vocab_size));
    if (batch.position_ids[i] < 0 || batch.position_ids[i] >= cf.max_position_embeddings)
      return absl::InvalidArgumentError(fmt::format("position id {} outside --max-position-embeddings {}",
                                                    batch.position_ids[i], cf.max_position_embeddings));
  }
  return absl::OkStatus();
}

absl::Status GPTModel::ForwardBackwardDeferred(const ModelBatch& batch, double loss_scale, bool train, uint64_t seed) {
  PTK_ASSIGN_OR_RETURN(const LossSum s, ForwardBackward(batch, loss_scale, train, seed));
  deferred_.loss_sum += s.loss_sum;
  deferred_.tokens += s.tokens;
  deferred_.load_balancing_loss += s.load_balancing_loss;
  deferred_.z_loss += s.z_loss;
  deferred_.AddMtp(s);
  return absl::OkStatus();
}

absl::Status GPTModel::WriteBuffers(const ModelBuffers& in) {
  if (in.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      fmt::format("the checkpoint holds {} (saved with --moe-router-enable-expert-bias?), a buffer this model has not",
                  in.front().first));
}

absl::StatusOr<LossSum> GPTModel::TakeLosses() {
  const LossSum s = deferred_;
  deferred_ = LossSum{};
  return s;
}

absl::StatusOr<LossSum> GPTModel::StageForward(const ModelBatch&, int, std::span<const float>, std::span<float>,
                                               std::optional<double>, bool, uint64_t, std::vector<float>*) {
  return absl::UnimplementedError(fmt::format("the {} backend has no pipeline parallelism", Describe()));
}
absl::Status GPTModel::StageBackward(const ModelBatch&, int, std::span<const float>, std::span<float>, bool, uint64_t) {
  return absl::UnimplementedError(fmt::format("the {} backend has no pipeline parallelism", Describe()));
}
absl::Status GPTModel::SelectChunk(int chunk) {
  if (chunk < 0 || chunk >= layout_.virtual_size)
    return absl::InvalidArgumentError(
        fmt::format("model chunk {}: this stage holds {} chunk(s)", chunk, layout_.virtual_size));
  chunk_ = chunk;
  return absl::OkStatus();
}

absl::StatusOr<StageExchange> GPTModel::StageBuffers(const ModelBatch& batch, int slot, bool) {
  if (layout_.pipeline_size <= 1)
    return absl::FailedPreconditionError("StageBuffers: the model is not a pipeline stage");
  if (slot < 0 || slot > static_cast<int>(stage_inputs_.size()))
    return absl::InvalidArgumentError(
        fmt::format("StageBuffers: slot {}: slots are taken in order ({} so far)", slot, stage_inputs_.size()));
  const int64_t nc = StageExchangeFloats(batch);
  if (nc <= 0) return absl::InvalidArgumentError(fmt::format("StageBuffers: a {}x{} micro-batch", batch.b, batch.t));
  const size_t size = static_cast<size_t>(nc);
  StageExchange e;
  e.elements = nc;
  if (slot == static_cast<int>(stage_inputs_.size())) {  // counted on the first stage too (no input there)
    stage_inputs_.emplace_back();
    stage_output_grads_.emplace_back();
  }
  if (!chunk_pre_process()) {
    std::vector<float>& in = stage_inputs_[static_cast<size_t>(slot)];
    in.resize(size);
    stage_input_grad_.resize(size);
    e.input = in.data();
    e.input_grad = stage_input_grad_.data();
  }
  if (!chunk_post_process()) {
    // An output gradient per slot: the interleaved schedule may receive several before their
    // backwards (the last stage's, for chunks the first stage sends back).
    std::vector<float>& dy = stage_output_grads_[static_cast<size_t>(slot)];
    stage_output_.resize(size);
    dy.resize(size);
    e.output = stage_output_.data();
    e.output_grad = dy.data();
  }
  return e;
}

namespace {
// A host buffer of StageBuffers' default as the span StageForward / StageBackward take: `elements`
// floats of it, none where the stage has no such neighbour.
template <typename F>
absl::StatusOr<std::span<F>> StageSpan(std::vector<float>& v, bool used, int64_t elements, std::string_view what) {
  if (!used) return std::span<F>();
  if (static_cast<int64_t>(v.size()) < elements)
    return absl::FailedPreconditionError(
        fmt::format("{}: the slot's buffers are not those of this micro-batch (StageBuffers first)", what));
  return std::span<F>(v.data(), static_cast<size_t>(elements));
}
}  // namespace

absl::StatusOr<LossSum> GPTModel::StageForwardExchanged(const ModelBatch& batch, int slot,
                                                        std::optional<double> loss_scale, bool train, uint64_t seed,
                                                        std::vector<float>* logits, bool defer_loss) {
  if (slot < 0 || slot >= static_cast<int>(stage_inputs_.size()))
    return absl::FailedPreconditionError(
        fmt::format("StageForwardExchanged: slot {} has no buffers (StageBuffers first)", slot));
  const int64_t nc = StageExchangeFloats(batch);
  PTK_ASSIGN_OR_RETURN(std::span<const float> in,
                       StageSpan<const float>(stage_inputs_[static_cast<size_t>(slot)], !chunk_pre_process(), nc,
                                              "StageForwardExchanged"));
  PTK_ASSIGN_OR_RETURN(std::span<float> out,
                       StageSpan<float>(stage_output_, !chunk_post_process(), nc, "StageForwardExchanged"));
  PTK_ASSIGN_OR_RETURN(const LossSum l, StageForward(batch, slot, in, out, loss_scale, train, seed, logits));
  if (!defer_loss) return l;
  deferred_.loss_sum += l.loss_sum;
  deferred_.tokens += l.tokens;
  deferred_.load_balancing_loss += l.load_balancing_loss;
  deferred_.z_loss += l.z_loss;
  deferred_.AddMtp(l);  // the last stage's multi-token prediction losses
  return LossSum{};
}

absl::Status GPTModel::StageBackwardExchanged(const ModelBatch& batch, int slot, bool train, uint64_t seed) {
  if (slot < 0 || slot >= static_cast<int>(stage_output_grads_.size()))
    return absl::FailedPreconditionError(
        fmt::format("StageBackwardExchanged: slot {} has no buffers (StageBuffers first)", slot));
  const int64_t nc = StageExchangeFloats(batch);
  PTK_ASSIGN_OR_RETURN(std::span<const float> dy,
                       StageSpan<const float>(stage_output_grads_[static_cast<size_t>(slot)], !chunk_post_process(), nc,
                                              "StageBackwardExchanged"));
  PTK_ASSIGN_OR_RETURN(std::span<float> dx,
                       StageSpan<float>(stage_input_grad_, !chunk_pre_process(), nc, "StageBackwardExchanged"));
  return StageBackward(batch, slot, dy, dx, train, seed);
}

absl::Status GPTModel::AllReduceGradRange(Communicator*, int64_t, int64_t) {
  return absl::UnimplementedError(fmt::format("the {} backend has no pipeline parallelism", Describe()));
}
absl::Status GPTModel::AllGatherGradRange(Communicator*, int64_t, int64_t) {
  return absl::UnimplementedError(fmt::format("the {} backend has no pipeline parallelism", Describe()));
}

absl::Status GPTModel::AllReduceGradRanges(Communicator*, std::span<const GradRange>) {
  return absl::UnimplementedError(fmt::format("the {} backend has no coalesced gradient all-reduce", Describe()));
}

absl::Status GPTModel::SumNonTensorParallelGrads() {
  if (!sums_non_tensor_parallel_grads()) return absl::OkStatus();
  if (non_tensor_parallel_ranges_.empty())
    non_tensor_parallel_ranges_ = NonTensorParallelGradRanges(layout_, sequence_parallel_);
  return AllReduceGradRanges(tensor_comm_, non_tensor_parallel_ranges_);
}

absl::StatusOr<int64_t> CheckGradRanges(std::span<const GradRange> ranges, int64_t num_params) {
  int64_t total = 0;
  for (const GradRange& g : ranges) {
    if (g.begin < 0 || g.end < g.begin || g.end > num_params)
      return absl::InvalidArgumentError(
          fmt::format("AllReduceGradRanges: [{}, {}) of {} parameters", g.begin, g.end, num_params));
    total += g.size();
  }
  return total;
}

absl::Status GPTModel::ScaledAdamWUpdate(double grad_scale, const AdamWGroups& groups) {
  if (grad_scale != 1.0) PTK_RETURN_IF_ERROR(ScaleGrads(grad_scale));
  return AdamWUpdate(groups);
}

}  // namespace ptk
