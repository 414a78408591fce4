// Megatron's pretraining sampler (MegatronPretrainingSampler) and a prefetching loader that fills
// the next micro-batches on a background thread, so a training step never waits on I/O in steady
// state.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"

namespace ptk {

// Walks indices consumed_samples..total_samples; every mbs*dp indices form one step of the data
// parallel group, of which rank r takes [r*mbs, (r+1)*mbs). An incomplete last group is dropped.
// So iteration it, micro-batch m, rank r reads it*GBS + m*mbs*dp + r*mbs + [0, mbs).
class PretrainingSampler {
 public:
  PretrainingSampler(int64_t total_samples, int64_t consumed_samples, int64_t micro_batch_size, int64_t dp_rank,
                     int64_t dp_size);
  // The next micro-batch of this rank; false when the data is exhausted.
  bool Next(std::vector<int64_t>* indices);
  int64_t consumed_samples() const { return consumed_; }

 private:
  int64_t total_, consumed_, mbs_, rank_, dp_;
};

struct MicroBatch {
  int64_t micro_batch_size = 0, seq_length = 0;
  std::vector<int64_t> indices;       // top-level sample indices
  std::vector<int32_t> tokens;        // [mbs, seq]
  std::vector<int32_t> labels;        // [mbs, seq]
  std::vector<int32_t> position_ids;  // [mbs, seq]
  std::vector<float> loss_mask;       // [mbs, seq]
};

class DataLoader {
 public:
  DataLoader(std::shared_ptr<TopLevelDataset> dataset, PretrainingSampler sampler, int64_t micro_batch_size,
             size_t prefetch = 4);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next micro-batch (waits only if the producer is behind); nullptr at the end of the data.
  absl::StatusOr<std::unique_ptr<MicroBatch>> Next();
  // Times Next() had to wait for the producer (0 in steady state when data keeps up).
  int64_t waits() const { return waits_; }

 private:
  void Produce();
  std::shared_ptr<TopLevelDataset> dataset_;
  PretrainingSampler sampler_;
  int64_t mbs_;
  size_t prefetch_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<MicroBatch>> ready_;
  bool done_ = false, stop_ = false;
  absl::Status error_;
  int64_t waits_ = 0;
  std::thread thread_;
};

}  // namespace ptk
