// Pretraining sampler and prefetching loader.
#include "indexed_dataset/data_loader.h"

#include "common/status.h"

namespace ptk {

PretrainingSampler::PretrainingSampler(int64_t total_samples, int64_t consumed_samples, int64_t micro_batch_size,
                                       int64_t dp_rank, int64_t dp_size)
    : total_(total_samples), consumed_(consumed_samples), mbs_(micro_batch_size), rank_(dp_rank), dp_(dp_size) {
  PTK_CHECK(mbs_ > 0 && dp_ > 0 && rank_ >= 0 && rank_ < dp_);
}

bool PretrainingSampler::Next(std::vector<int64_t>* indices) {
  const int64_t group = mbs_ * dp_;
  if (consumed_ + group > total_) return false;
  indices->resize(static_cast<size_t>(mbs_));
  for (int64_t i = 0; i < mbs_; ++i) (*indices)[i] = consumed_ + rank_ * mbs_ + i;
  consumed_ += group;
  return true;
}

DataLoader::DataLoader(std::shared_ptr<TopLevelDataset> dataset, PretrainingSampler sampler, int64_t micro_batch_size,
                       size_t prefetch)
    : dataset_(std::move(dataset)),
      sampler_(sampler),
      mbs_(micro_batch_size),
      prefetch_(std::max<size_t>(1, prefetch)) {
  thread_ = std::thread([this] { Produce(); });
}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DataLoader::Produce() {
  const int64_t seq = dataset_->config().sequence_length;
  std::vector<int64_t> indices;
  GPTSample s;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || ready_.size() < prefetch_; });
      if (stop_) return;
    }
    if (!sampler_.Next(&indices)) {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      cv_.notify_all();
      return;
    }
    auto b = std::make_unique<MicroBatch>();
    b->micro_batch_size = mbs_;
    b->seq_length = seq;
    b->indices = indices;
    const size_t n = static_cast<size_t>(mbs_ * seq);
    b->tokens.resize(n);
    b->labels.resize(n);
    b->position_ids.resize(n);
    b->loss_mask.resize(n);
    absl::Status st;
    for (int64_t r = 0; r < mbs_ && st.ok(); ++r) {
      st = dataset_->Get(indices[static_cast<size_t>(r)], &s);
      if (!st.ok()) break;
      for (int64_t t = 0; t < seq; ++t) {
        const size_t k = static_cast<size_t>(r * seq + t);
        b->tokens[k] = static_cast<int32_t>(s.tokens[t]);
        b->labels[k] = static_cast<int32_t>(s.labels[t]);
        b->position_ids[k] = static_cast<int32_t>(s.position_ids[t]);
        b->loss_mask[k] = s.loss_mask[t];
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok()) {
      error_ = st;
      done_ = true;
      cv_.notify_all();
      return;
    }
    ready_.push_back(std::move(b));
    cv_.notify_all();
  }
}

absl::StatusOr<std::unique_ptr<MicroBatch>> DataLoader::Next() {
  std::unique_lock<std::mutex> lock(mu_);
  if (ready_.empty() && !done_) ++waits_;
  cv_.wait(lock, [&] { return !ready_.empty() || done_; });
  if (!ready_.empty()) {
    auto b = std::move(ready_.front());
    ready_.pop_front();
    cv_.notify_all();
    return b;
  }
  if (!error_.ok()) return error_;
  return std::unique_ptr<MicroBatch>();
}

}  // namespace ptk
