// Expert parallelism's gradient reduction and whole-model sums (expert_grads.h).
#include "trainer/expert_grads.h"

#include "common/status.h"

namespace ptk {

void ExpertGradRanges(const ParamLayout& layout, std::vector<GradRange>* experts, std::vector<GradRange>* rest) {
  experts->clear();
  rest->clear();
  for (const ParamInfo& p : layout.infos) {
    std::vector<GradRange>* to = p.expert ? experts : rest;
    if (!to->empty() && to->back().end == p.offset)
      to->back().end = p.offset + p.size;
    else
      to->push_back({p.offset, p.offset + p.size});
  }
}

absl::Status ReduceExpertParallelGrads(GPTModel* model, Communicator* data) {
  std::vector<GradRange> experts, rest;
  ExpertGradRanges(model->layout(), &experts, &rest);
  if (data->size() > 1 && !rest.empty()) PTK_RETURN_IF_ERROR(model->AllReduceGradRanges(data, rest));
  Communicator* expert_data = model->expert_data_comm();
  if (expert_data != nullptr && expert_data->size() > 1 && !experts.empty())
    PTK_RETURN_IF_ERROR(model->AllReduceGradRanges(expert_data, experts));
  return absl::OkStatus();
}

absl::StatusOr<double> ExpertParallelSum(const ParamLayout& layout, std::span<const float> values, bool squares,
                                         Communicator* expert) {
  double sums[2] = {0, 0};  // the rest's, the experts'
  for (const ParamInfo& p : layout.infos) {
    if (!layout.CountedInNorms(p)) continue;
    if (layout.tensor_rank != 0 && p.tensor_split_dim < 0) continue;  // a whole tensor: tensor rank 0 counts it
    double& s = sums[p.expert ? 1 : 0];
    for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
      const double v = values[static_cast<size_t>(i)];
      s += squares ? v * v : (v == 0 ? 1.0 : 0.0);
    }
  }
  PTK_RETURN_IF_ERROR(SumInRankOrder(&sums[1], 1, expert));
  return sums[0] + sums[1];
}

}  // namespace ptk
