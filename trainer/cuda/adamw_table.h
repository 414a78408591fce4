// The table of pieces one multi-tensor AdamW launch runs over (pure host code, checked in CI): the
// parts of the tensors that a rank updates (every tensor, or under ZeRO-1 their parts in its
// shard), cut into chunks of at most kAdamWChunk elements, one block each, with each piece's
// weight-decay group.
#pragma once

#include <cstdint>
#include <vector>

// C++17 here: the .cu files include this header.
namespace ptk {
struct ParamLayout;
}  // namespace ptk

namespace ptk::cuda {

inline constexpr int64_t kAdamWChunk = 8192;

struct AdamWChunk {
  int64_t offset = 0;  // in the flat parameter layout
  int32_t size = 0;    // 1..kAdamWChunk
  int32_t no_weight_decay = 0;
};

// The chunks of [begin, end) of the layout (PiecesIn), in layout order: together they cover every
// element of the range exactly once, and none crosses a tensor's boundary.
std::vector<AdamWChunk> AdamWTable(const ParamLayout& layout, int64_t begin, int64_t end);

}  // namespace ptk::cuda
