// ZeRO-1 under expert parallelism (expert_shard.h).
#include "trainer/expert_shard.h"

#include <algorithm>

#include "common/status.h"
#include "trainer/expert_grads.h"

namespace ptk {
namespace {

// `runs` laid end to end, cut into `parts` contiguous parts of ceil(total / parts) elements (the last ones
// shorter or empty), each as its ranges of the buffer.
std::vector<std::vector<GradRange>> Cut(const std::vector<GradRange>& runs, int parts) {
  int64_t total = 0;
  for (const GradRange& r : runs) total += r.size();
  const int64_t each = parts > 0 ? (total + parts - 1) / parts : 0;
  std::vector<std::vector<GradRange>> out(static_cast<size_t>(std::max(parts, 1)));
  int64_t at = 0;  // position in the runs laid end to end
  for (const GradRange& r : runs) {
    for (int64_t b = r.begin; b < r.end;) {
      const int part = each > 0 ? static_cast<int>(at / each) : 0;
      const int64_t n = std::min(r.end - b, (part + 1) * each - at);
      out[static_cast<size_t>(part)].push_back({b, b + n});
      b += n;
      at += n;
    }
  }
  return out;
}

Communicator* ExpertData(const GPTModel& model) {
  Communicator* c = model.expert_data_comm();
  return c != nullptr && c->size() > 1 ? c : nullptr;
}

}  // namespace

std::vector<GradRange> ExpertShard::Owned() const {
  std::vector<GradRange> out = dense[static_cast<size_t>(data_rank)];
  const std::vector<GradRange>& e = experts[static_cast<size_t>(expert_data_rank)];
  out.insert(out.end(), e.begin(), e.end());
  std::sort(out.begin(), out.end(), [](const GradRange& a, const GradRange& b) { return a.begin < b.begin; });
  return out;
}

ExpertShard MakeExpertShard(const ParamLayout& layout, int data_size, int data_rank, int expert_data_size,
                            int expert_data_rank) {
  std::vector<GradRange> experts, rest;
  ExpertGradRanges(layout, &experts, &rest);
  ExpertShard s;
  s.dense = Cut(rest, data_size);
  s.experts = Cut(experts, expert_data_size);
  s.data_rank = data_rank;
  s.expert_data_rank = expert_data_rank;
  return s;
}

ExpertShard ExpertShardOf(const GPTModel& model, const Communicator& data) {
  const Communicator* ed = ExpertData(model);
  return MakeExpertShard(model.layout(), data.size(), data.rank(), ed ? ed->size() : 1, ed ? ed->rank() : 0);
}

absl::Status AllGatherRanges(Communicator* comm, const std::vector<std::vector<GradRange>>& of_rank,
                             std::span<float> full) {
  const int size = comm->size();
  if (static_cast<int>(of_rank.size()) != size)
    return absl::InternalError("AllGatherRanges: not one list of ranges per rank");
  if (size == 1) return absl::OkStatus();
  std::vector<int64_t> bytes(static_cast<size_t>(size), 0);
  int64_t total = 0, before = 0;
  for (int r = 0; r < size; ++r) {
    int64_t n = 0;
    for (const GradRange& g : of_rank[static_cast<size_t>(r)]) {
      if (g.begin < 0 || g.end > static_cast<int64_t>(full.size()) || g.begin > g.end)
        return absl::InternalError("AllGatherRanges: a range outside the buffer");
      n += g.size();
    }
    if (r < comm->rank()) before += n;
    total += n;
    bytes[static_cast<size_t>(r)] = n * static_cast<int64_t>(sizeof(float));
  }
  std::vector<float> buf(static_cast<size_t>(total));
  const std::vector<float> mine = PackRanges(of_rank[static_cast<size_t>(comm->rank())], full);
  std::copy(mine.begin(), mine.end(), buf.begin() + before);
  PTK_RETURN_IF_ERROR(comm->AllGather(buf.data(), bytes));
  const float* at = buf.data();
  for (const std::vector<GradRange>& ranges : of_rank)
    for (const GradRange& g : ranges) {
      std::copy_n(at, g.size(), full.begin() + g.begin);
      at += g.size();
    }
  return absl::OkStatus();
}

absl::Status AllGatherExpertShardedParams(GPTModel* model, Communicator* data) {
  const ExpertShard s = ExpertShardOf(*model, *data);
  std::vector<float> params(static_cast<size_t>(model->num_params()));
  PTK_RETURN_IF_ERROR(model->ReadParams(params));
  PTK_RETURN_IF_ERROR(AllGatherRanges(data, s.dense, params));
  if (Communicator* ed = ExpertData(*model)) PTK_RETURN_IF_ERROR(AllGatherRanges(ed, s.experts, params));
  return model->WriteParams(params);
}

absl::Status GatherExpertShardedMoments(GPTModel* model, Communicator* data, std::span<float> exp_avg,
                                        std::span<float> exp_avg_sq) {
  const ExpertShard s = ExpertShardOf(*model, *data);
  const size_t n = static_cast<size_t>(model->moments_size());
  std::vector<float> m(n), v(n);
  PTK_RETURN_IF_ERROR(model->ReadMoments(m, v));
  size_t at = 0;
  for (const GradRange& g : model->owned_ranges()) {
    std::copy_n(m.begin() + static_cast<std::ptrdiff_t>(at), g.size(), exp_avg.begin() + g.begin);
    std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(at), g.size(), exp_avg_sq.begin() + g.begin);
    at += static_cast<size_t>(g.size());
  }
  for (std::span<float> full : {exp_avg, exp_avg_sq}) {
    PTK_RETURN_IF_ERROR(AllGatherRanges(data, s.dense, full));
    if (Communicator* ed = ExpertData(*model)) PTK_RETURN_IF_ERROR(AllGatherRanges(ed, s.experts, full));
  }
  return absl::OkStatus();
}

std::vector<float> PackRanges(const std::vector<GradRange>& ranges, std::span<const float> full) {
  std::vector<float> out;
  for (const GradRange& g : ranges) out.insert(out.end(), full.begin() + g.begin, full.begin() + g.end);
  return out;
}

}  // namespace ptk
