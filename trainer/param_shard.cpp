// ZeRO-1's partition of the flat parameter buffer.
#include "trainer/param_shard.h"

#include <algorithm>

#include <fmt/core.h>

#include "trainer/param_layout.h"

namespace ptk {

absl::StatusOr<ParamShard> ParamShard::Create(int64_t num_params, int world_size, int rank) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    return absl::InvalidArgumentError(fmt::format("rank {} of {}: not a valid rank", rank, world_size));
  if (num_params < 0) return absl::InvalidArgumentError("a negative parameter count");
  ParamShard s;
  s.num_params = num_params;
  s.world_size = world_size;
  s.rank = rank;
  const int64_t unit = kAlignment * world_size;
  s.padded_size = std::max<int64_t>(1, (num_params + unit - 1) / unit) * unit;
  s.shard_size = s.padded_size / world_size;
  return s;
}

int64_t ParamShard::begin(int r) const { return std::min(num_params, shard_size * r); }
int64_t ParamShard::end(int r) const { return std::min(num_params, shard_size * (r + 1)); }

std::vector<int64_t> ParamShard::CountsIn(int64_t a, int64_t b) const {
  std::vector<int64_t> out(static_cast<size_t>(world_size), 0);
  for (int r = 0; r < world_size; ++r)
    out[static_cast<size_t>(r)] = std::max<int64_t>(0, std::min(b, end(r)) - std::max(a, begin(r)));
  return out;
}

std::vector<ParamPiece> PiecesIn(const ParamLayout& layout, int64_t begin, int64_t end) {
  std::vector<ParamPiece> out;
  for (const ParamInfo& p : layout.infos) {
    const int64_t a = std::max(begin, p.offset), b = std::min(end, p.offset + p.size);
    if (a < b) out.push_back({a, b - a, p.no_weight_decay, p.qk_layernorm, p.decoupled_lr, p.tensor_split_dim});
  }
  return out;
}

}  // namespace ptk
