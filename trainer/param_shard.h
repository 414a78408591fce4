// Which data-parallel rank owns which part of the flat parameter buffer under ZeRO-1
// (--use-distributed-optimizer, Megatron's distributed optimizer): one contiguous range per rank,
// from rank 0 up. As Megatron, the buffer is padded to a multiple of the world size (here of
// world size x kAlignment, so that every range starts on a block of the gradient norm's fixed
// blocks); the padding is nobody's. One piece of host code for every backend.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk {

struct ParamLayout;

struct ParamShard {
  // Elements. A multiple of the CPU backend's gradient-norm block (trainer/cpu/adamw_cpu.cpp), so
  // that a norm added up from the ranks' block sums has the bits of the whole buffer's.
  static constexpr int64_t kAlignment = 16384;

  int64_t num_params = 0;
  int64_t padded_size = 0;  // world_size * shard_size >= num_params
  int64_t shard_size = 0;   // a multiple of kAlignment
  int world_size = 1, rank = 0;

  static absl::StatusOr<ParamShard> Create(int64_t num_params, int world_size, int rank);

  // Rank r's range [begin(r), end(r)) of the real parameters (the padding cut off: the last ranks'
  // ranges may be shorter, or empty for a model smaller than the ranks' blocks).
  int64_t begin(int r) const;
  int64_t end(int r) const;
  int64_t begin() const { return begin(rank); }
  int64_t end() const { return end(rank); }
  int64_t size() const { return end() - begin(); }
  // Each rank's count of elements in [a, b) (a bucket's pieces for ReduceScatterSum); the whole
  // buffer's with Counts().
  std::vector<int64_t> CountsIn(int64_t a, int64_t b) const;
  std::vector<int64_t> Counts() const { return CountsIn(0, num_params); }
};

// The tensors' parts that fall in [begin, end): what AdamW updates there, with the marks of its tensor
// that choose its optimizer group (AdamWGroups).
struct ParamPiece {
  int64_t offset = 0, size = 0;
  bool no_weight_decay = false, qk_layernorm = false, decoupled_lr = false;
  int tensor_split_dim = -1;  // the tensor's (ParamInfo::tensor_split_dim)
};
std::vector<ParamPiece> PiecesIn(const ParamLayout& layout, int64_t begin, int64_t end);

}  // namespace ptk
