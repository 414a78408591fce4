// Gradient buckets for the reduction overlapped with backward.
#include "trainer/grad_buckets.h"

#include <algorithm>
#include <vector>

#include "trainer/param_layout.h"

namespace ptk {

std::vector<GradRange> BackwardReadyOrder(const ParamLayout& layout) {
  // A pipeline stage without the final norm or the embeddings has an empty range in their place.
  std::vector<GradRange> out;
  const int64_t layers_end = layout.post_process ? layout.lnf_w : layout.num_params;
  out.push_back({layers_end, layout.num_params});  // the final LayerNorm, then an untied output layer
  for (size_t l = layout.layers.size(); l-- > 0;) {
    const int64_t begin = layout.layers[l].ln1_w;
    const int64_t end = l + 1 < layout.layers.size() ? layout.layers[l + 1].ln1_w : layers_end;
    out.push_back({begin, end});
  }
  out.push_back({0, layout.layers.empty() ? layers_end : layout.layers[0].ln1_w});
  return out;
}

std::vector<GradRange> MakeGradBuckets(const ParamLayout& layout, int64_t bucket_size) {
  std::vector<GradRange> buckets;
  GradRange open;
  bool has_open = false;
  for (const GradRange& r : BackwardReadyOrder(layout)) {
    if (r.size() == 0 && !has_open) continue;  // a stage without the final norm or the embeddings
    // Ranges come in descending order, each ending where the open bucket begins.
    open = has_open ? GradRange{r.begin, open.end} : r;
    has_open = true;
    if (open.size() >= bucket_size) {
      buckets.push_back(open);
      has_open = false;
    }
  }
  if (has_open) buckets.push_back(open);
  return buckets;
}

std::vector<GradRange> SequenceParallelGradRanges(const ParamLayout& layout) {
  std::vector<GradRange> out;
  if (layout.tensor_size <= 1) return out;
  for (const ParamInfo& p : layout.infos) {
    if (p.tensor_split_dim >= 0 || p.offset == layout.wpe) continue;
    if (!out.empty() && out.back().end == p.offset)
      out.back().end += p.size;
    else
      out.push_back({p.offset, p.offset + p.size});
  }
  return out;
}

std::vector<GradRange> NonTensorParallelGradRanges(const ParamLayout& layout, bool sequence_parallel) {
  if (sequence_parallel) return SequenceParallelGradRanges(layout);
  std::vector<GradRange> out;
  if (layout.tensor_size <= 1) return out;
  auto add = [&](int64_t at, int64_t size) {
    if (at < 0) return;
    if (!out.empty() && out.back().end == at)
      out.back().end += size;
    else
      out.push_back({at, at + size});
  };
  const GPTConfig& cf = layout.config;
  const int64_t c = cf.hidden_size, qr = cf.q_lora_rank, kvr = cf.kv_lora_rank;
  std::vector<const LayerParams*> layers;  // the decoder's, then the multi-token prediction depths' (registered after)
  for (const LayerParams& lp : layout.layers) layers.push_back(&lp);
  for (const MtpLayerParams& mp : layout.mtp) layers.push_back(&mp.layer);
  for (const LayerParams* l : layers) {
    const LayerParams& lp = *l;
    for (int64_t at : {lp.q_norm_w, lp.q_norm_b, lp.k_norm_w, lp.k_norm_b}) add(at, cf.head_dim());
    // Multi-latent attention's down projections and latent norms, whole on every rank: each rank's gradient is its
    // heads' share (the path through its up projections' rows and its heads' use of the shared rotary key).
    add(lp.mla_q_down, qr * c);
    add(lp.mla_kv_down, (kvr + cf.qk_pos_emb_head_dim) * c);
    for (int64_t at : {lp.mla_q_norm_w, lp.mla_q_norm_b}) add(at, qr);
    for (int64_t at : {lp.mla_kv_norm_w, lp.mla_kv_norm_b}) add(at, kvr);
  }
  return out;
}

int64_t DefaultDdpBucketSize(int data_parallel_size) {
  return std::max<int64_t>(40000000, int64_t{1000000} * data_parallel_size);
}

BucketTracker::BucketTracker(std::vector<GradRange> buckets) : buckets_(std::move(buckets)) {
  for (const GradRange& b : buckets_) remaining_.push_back(b.size());
}

std::vector<int> BucketTracker::MarkReady(int64_t begin, int64_t end) {
  std::vector<int> done;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const int64_t overlap = std::min(end, buckets_[i].end) - std::max(begin, buckets_[i].begin);
    if (overlap <= 0 || remaining_[i] == 0) continue;
    remaining_[i] -= overlap;
    if (remaining_[i] <= 0) {
      remaining_[i] = 0;
      done.push_back(static_cast<int>(i));
    }
  }
  return done;
}

bool BucketTracker::AllDone() const {
  return std::all_of(remaining_.begin(), remaining_.end(), [](int64_t r) { return r == 0; });
}

BucketWorker::BucketWorker(std::function<absl::Status(int)> work)
    : work_(std::move(work)), thread_([this] { Loop(); }) {}

BucketWorker::~BucketWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void BucketWorker::Enqueue(int bucket) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(bucket);
  }
  cv_.notify_all();
}

absl::Status BucketWorker::Finish() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
  absl::Status st = error_;
  error_ = absl::OkStatus();
  return st;
}

void BucketWorker::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping
    const int bucket = queue_.front();
    queue_.pop_front();
    if (!error_.ok()) {
      cv_.notify_all();
      continue;
    }
    busy_ = true;
    lock.unlock();
    absl::Status st = work_(bucket);
    lock.lock();
    busy_ = false;
    if (!st.ok() && error_.ok()) error_ = st;
    cv_.notify_all();
  }
}

}  // namespace ptk
