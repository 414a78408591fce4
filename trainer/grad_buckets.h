// --overlap-grad-reduce / --ddp-bucket-size: which parts of the flat gradient buffer backward
// finishes, in what order; Megatron's buckets over them (consecutive parts gathered until a bucket
// holds --ddp-bucket-size elements); which buckets a finished part completes; and the host thread
// that reduces them while backward goes on. Host code for every backend.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace ptk {

struct ParamLayout;

// [begin, end) of the flat buffer.
struct GradRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const GradRange&) const = default;
};

// The ranges whose gradients backward completes, in that order: the final LayerNorm (and an
// untied output layer, whose gradient the head computes first), each layer from the last to the
// first, then the embeddings (a tied output layer's gradient is the word embedding's, complete
// only after the embedding backward). They tile [0, num_params).
std::vector<GradRange> BackwardReadyOrder(const ParamLayout& layout);

// Megatron's buckets: the ranges in backward order, gathered until a bucket holds at least
// `bucket_size` elements (the last one may hold fewer). Each bucket is contiguous.
std::vector<GradRange> MakeGradBuckets(const ParamLayout& layout, int64_t bucket_size);

// --sequence-parallel: the gradients each tensor rank computes from its own positions only, which
// Megatron marks `sequence_parallel` and all-reduces over the tensor group after the data-parallel
// reduction (finalize_model_grads' _allreduce_non_tensor_model_parallel_grads): every tensor every
// tensor rank holds whole but the position embeddings, i.e. the norms' weights and biases and the
// row-parallel products' (proj, fc2) biases. Contiguous ones merged, in buffer order; none at
// tensor size 1.
std::vector<GradRange> SequenceParallelGradRanges(const ParamLayout& layout);
// Every gradient Megatron's _allreduce_non_tensor_model_parallel_grads sums over the tensor group in
// its one all-reduce: under --sequence-parallel SequenceParallelGradRanges (the query and key norms
// among them), else with --qk-layernorm the query and key norms' weights and biases (whole on every
// tensor rank, each rank's gradient its heads' share), and multi-latent attention's down projections
// and latent norms (whole on every rank, each rank's gradient its heads' share), the decoder's layers' and the
// multi-token prediction depths'. None at tensor size 1.
std::vector<GradRange> NonTensorParallelGradRanges(const ParamLayout& layout, bool sequence_parallel);

// Megatron's default --ddp-bucket-size: max(40M, 1M x data-parallel size) elements.
int64_t DefaultDdpBucketSize(int data_parallel_size);

// Which buckets are complete as backward finishes ranges (in any order).
class BucketTracker {
 public:
  BucketTracker() = default;
  explicit BucketTracker(std::vector<GradRange> buckets);
  const std::vector<GradRange>& buckets() const { return buckets_; }
  // Marks [begin, end) finished; returns the buckets this completed, in index order.
  std::vector<int> MarkReady(int64_t begin, int64_t end);
  bool AllDone() const;

 private:
  std::vector<GradRange> buckets_;
  std::vector<int64_t> remaining_;
};

// One thread that runs `work(bucket)` for each enqueued bucket, in order, while the caller goes
// on; Finish waits for the queue to drain and returns the first error (after which the remaining
// buckets are skipped: a failed collective leaves the communicator unusable anyway).
class BucketWorker {
 public:
  explicit BucketWorker(std::function<absl::Status(int)> work);
  ~BucketWorker();
  BucketWorker(const BucketWorker&) = delete;
  BucketWorker& operator=(const BucketWorker&) = delete;
  void Enqueue(int bucket);
  absl::Status Finish();

 private:
  void Loop();
  std::function<absl::Status(int)> work_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queue_;
  bool busy_ = false, stop_ = false;
  absl::Status error_;
  std::thread thread_;
};

}  // namespace ptk
