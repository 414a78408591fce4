// The table of pieces one multi-tensor AdamW launch runs over (pure host code, checked in CI): the
// parts of the tensors that a rank updates (every tensor, or under ZeRO-1 their parts in its
// shard), cut into chunks of at most kAdamWChunk elements, one block each, with each piece's
// optimizer group (AdamWGroups: weight decay or none, --decoupled-lr's rate or --lr's).
#pragma once

#include <cstdint>
#include <vector>

// C++17 here: the .cu files include this header.
namespace ptk {
struct ParamLayout;
struct AdamWGroups;
}  // namespace ptk

namespace ptk::cuda {

inline constexpr int64_t kAdamWChunk = 8192;

struct AdamWChunk {
  int64_t offset = 0;  // in the flat parameter layout
  int32_t size = 0;    // 1..kAdamWChunk
  int32_t group = 0;   // the index into AdamWGroups::group
};

// The chunks of [begin, end) of the layout (PiecesIn), in layout order: together they cover every
// element of the range exactly once, and none crosses a tensor's boundary; each chunk's group is its
// tensor's under `groups`' rule (AdamWGroups::IndexOf).
std::vector<AdamWChunk> AdamWTable(const ParamLayout& layout, int64_t begin, int64_t end, const AdamWGroups& groups);

}  // namespace ptk::cuda
