// The multi-tensor AdamW table (pure host code).
#include "trainer/cuda/adamw_table.h"

#include <algorithm>

#include "trainer/gpt_model.h"
#include "trainer/param_shard.h"

namespace ptk::cuda {

std::vector<AdamWChunk> AdamWTable(const ParamLayout& layout, int64_t begin, int64_t end, const AdamWGroups& groups) {
  std::vector<AdamWChunk> table;
  for (const ParamPiece& p : PiecesIn(layout, begin, end)) {
    const int32_t group = groups.IndexOf(p.no_weight_decay, p.qk_layernorm, p.decoupled_lr);
    for (int64_t at = 0; at < p.size; at += kAdamWChunk)
      table.push_back({p.offset + at, static_cast<int32_t>(std::min(kAdamWChunk, p.size - at)), group});
  }
  return table;
}

}  // namespace ptk::cuda
