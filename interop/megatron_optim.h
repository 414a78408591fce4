// Megatron's distributed optimizer (--use-distributed-optimizer) in the `torch` format: beside each
// rank's model_optim_rng.pt (whose optimizer keeps only the param groups and Adam's step), a
// distrib_optim.pt that DistributedOptimizer.save_parameter_state writes on data-parallel rank 0:
//   {"buckets_coalesced": True,
//    <grad buffer index>: {(param dtype, grad dtype): {"param": fp32[n], "exp_avg": fp32[n],
//                                                       "exp_avg_sq": fp32[n], "numel_unpadded": n}}}
// The world tensors hold the stage's parameters where megatron-core's grad buffer
// (_ParamAndGradBuffer) puts them: in reverse named_parameters order, each start padded to 64
// elements, a bucket closed once it holds --ddp-bucket-size elements (only with
// --overlap-grad-reduce; never on a pipeline stage after the first) and around a shared (tied,
// pipeline-parallel) embedding; the buckets' end padding is not saved (their unpadded spans are
// concatenated). An interleaved run (V model chunks a rank) has one grad buffer per chunk, keyed 0 ..
// V-1 in chunk order (DistributedOptimizer chains the chunks' buffers), each laid out alone; only
// chunk 0 is bucketed (Megatron-LM's get_model disables bucketing for the later chunks).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "interop/torch_format.h"

namespace ptk::megatron {

struct DistribParam {
  std::string name;     // the stage's local name
  int64_t numel = 0;    // of this rank's shard
  bool shared = false;  // the shared embedding (tied, pipeline-parallel): a bucket of its own
};

struct DistribState {
  std::vector<float> param, exp_avg, exp_avg_sq;  // the world tensors (of several buffers: one after the other)
  std::map<std::string, int64_t> offset;          // each parameter's first element in them
};

// One grad buffer: a model chunk's parameters (named_parameters order; names unique over the buffers
// of a file) and its bucket size.
struct DistribBuffer {
  std::vector<DistribParam> params;
  std::optional<int64_t> bucket_size;
};

// megatron-core's bucket size for the grad buffer of pipeline stage `stage` of the run `args` (its
// Namespace) describes: --ddp-bucket-size, else max(4e7, 1e6 x data-parallel size), only with
// --overlap-grad-reduce, and only on the first pipeline stage; none (one bucket) otherwise.
std::optional<int64_t> DistribBucketSize(const torchfmt::PyValue* args, int64_t stage);

// Where the grad buffer puts `params` (named_parameters order) in the world tensors; their total
// (numel_unpadded).
int64_t DistribLayout(const std::vector<DistribParam>& params, std::optional<int64_t> bucket_size,
                      std::map<std::string, int64_t>* offset);

// Reads `path` and checks it against the layout of `params` (one grad buffer of one dtype; its
// numel_unpadded must be the layout's total), naming the file and what differs.
absl::StatusOr<DistribState> ReadDistribOptim(const std::string& path, const std::vector<DistribParam>& params,
                                              std::optional<int64_t> bucket_size);
// The same from the archive `reader` holds (its root the state dict: a distrib_optim.pt, or the
// object of a torch_dist checkpoint's dp_zero_gather_scatter param_state); `where` names it in errors.
absl::StatusOr<DistribState> ReadDistribState(torchfmt::TorchArchiveReader* reader, const torchfmt::PyValue& root,
                                              const std::string& where, const std::vector<DistribParam>& params,
                                              std::optional<int64_t> bucket_size);
// The same for one grad buffer per model chunk (`buffers`, in chunk order: grad buffers 0, 1, ...):
// each checked against its layout, a buffer missing or one more refused naming it.
absl::StatusOr<DistribState> ReadDistribOptimChunks(const std::string& path, const std::vector<DistribBuffer>& buffers);
absl::StatusOr<DistribState> ReadDistribStateChunks(torchfmt::TorchArchiveReader* reader, const torchfmt::PyValue& root,
                                                    const std::string& where,
                                                    const std::vector<DistribBuffer>& buffers);

// One tensor rank's shard of a tied embedding in the distributed optimizer's state: stage 0's
// (`emb_key` in `first`, read from `first_file`) and the last (virtual) stage's copy (`out_key` in
// `last`, from `last_file`), `rows` x `cols` elements each, the shard starting at row `row0` of the
// whole table. Megatron keeps the two equal (their gradients are summed, so the same AdamW update
// reaches both); its loader takes each as it is. Warns at the first element whose fp32 param,
// exp_avg or exp_avg_sq differs, naming both files and the element, and returns whether it did.
bool WarnIfTiedCopyDiffers(const std::string& first_file, const DistribState& first, const std::string& emb_key,
                           const std::string& last_file, const DistribState& last, const std::string& out_key,
                           int64_t row0, int64_t rows, int64_t cols);

}  // namespace ptk::megatron
