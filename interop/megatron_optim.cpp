// distrib_optim.pt: Megatron's distributed optimizer's fp32 params and Adam moments, in grad-buffer order.
#include "interop/megatron_optim.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/status.h"
#include "interop/megatron_common.h"
#include "interop/torch_format.h"

namespace ptk::megatron {
namespace {

using torchfmt::PyValue;

int64_t Pad(int64_t n, int64_t d) { return (n + d - 1) / d * d; }

}  // namespace

std::optional<int64_t> DistribBucketSize(const PyValue* args, int64_t stage) {
  if (!BoolAttr(args, "overlap_grad_reduce", false) || stage != 0) return std::nullopt;
  const int64_t dp = static_cast<int64_t>(NumAttr(args, "data_parallel_size").value_or(1));
  return static_cast<int64_t>(NumAttr(args, "ddp_bucket_size").value_or(std::max(4e7, 1e6 * dp)));
}

int64_t DistribLayout(const std::vector<DistribParam>& params, std::optional<int64_t> bucket_size,
                      std::map<std::string, int64_t>* offset) {
  // As _ParamAndGradBuffer.__init__ with the distributed optimizer (data-parallel size only pads the
  // buckets' ends, which the file leaves out: bucket starts are multiples of 128 either way).
  int64_t param_start = 0, param_end = 0, bucket_start = 0, in_bucket = 0;
  int64_t saved = 0;  // the unpadded elements of the buckets closed so far
  std::map<std::string, int64_t> start_in_bucket;
  auto close = [&](int64_t end) {
    // The elements of the bucket [bucket_start, end) go to the world tensor at `saved`.
    for (auto& [name, s] : start_in_bucket) (*offset)[name] = saved + (s - bucket_start);
    start_in_bucket.clear();
    saved += end - bucket_start;
    bucket_start = Pad(end, 128);
    in_bucket = 0;
    return bucket_start;
  };
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    param_start = Pad(param_start, 64);
    if (it->shared && in_bucket > 0) param_start = close(param_start);
    param_end = param_start + it->numel;
    start_in_bucket[it->name] = param_start;
    ++in_bucket;
    if ((bucket_size && param_end - bucket_start >= *bucket_size) || it->shared) {
      param_start = close(param_end);
    } else {
      param_start = param_end;
    }
  }
  if (in_bucket > 0) close(param_end);
  return saved;
}

absl::StatusOr<DistribState> ReadDistribOptim(const std::string& path, const std::vector<DistribParam>& params,
                                              std::optional<int64_t> bucket_size) {
  return ReadDistribOptimChunks(path, {DistribBuffer{params, bucket_size}});
}

absl::StatusOr<DistribState> ReadDistribState(torchfmt::TorchArchiveReader* reader, const PyValue& root,
                                              const std::string& where, const std::vector<DistribParam>& params,
                                              std::optional<int64_t> bucket_size) {
  return ReadDistribStateChunks(reader, root, where, {DistribBuffer{params, bucket_size}});
}

absl::StatusOr<DistribState> ReadDistribOptimChunks(const std::string& path,
                                                    const std::vector<DistribBuffer>& buffers) {
  PTK_ASSIGN_OR_RETURN(auto reader, torchfmt::TorchArchiveReader::Open(path));
  return ReadDistribStateChunks(reader.get(), reader->root(), path, buffers);
}

namespace {

// Grad buffer `index` (`buffer`: {(param dtype, grad dtype): state}) laid out as `want` says, appended
// to `out`.
absl::Status ReadBuffer(torchfmt::TorchArchiveReader* reader, const PyValue* buffer, int64_t index,
                        const DistribBuffer& want, size_t chunks, const std::string& path, DistribState* out) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: grad buffer {}{}{}", path, index,
                                           chunks > 1 ? fmt::format(" (model chunk {})", index) : "", why));
  };
  if (!buffer || buffer->kind != PyValue::Kind::kDict || buffer->dict.size() != 1)
    return bad(": not one {(param dtype, grad dtype): state} entry");
  const PyValue* state = buffer->dict[0].second.get();
  const auto base = static_cast<int64_t>(out->param.size());
  std::map<std::string, int64_t> offset;
  const int64_t total = DistribLayout(want.params, want.bucket_size, &offset);
  const PyValue* n = state->Get("numel_unpadded");
  if (!n || !n->IsInt()) return bad(": no numel_unpadded");
  if (n->i != total)
    return bad(
        fmt::format(" holds {} elements; the {} parameters of this rank's model{}, laid out as megatron-core "
                    "lays them (bucket size {}), take {}",
                    n->i, want.params.size(), chunks > 1 ? " chunk" : "",
                    want.bucket_size ? std::to_string(*want.bucket_size) : "none", total));
  for (const auto& [name, at] : offset) out->offset[name] = base + at;
  for (const char* key : {"param", "exp_avg", "exp_avg_sq"}) {
    const PyValue* t = state->Get(key);
    if (!t || t->kind != PyValue::Kind::kTensor || t->tensor.numel() != total)
      return bad(fmt::format(": {} is not a tensor of {} elements", key, total));
    PTK_ASSIGN_OR_RETURN(std::vector<float> v, reader->ReadFloat(t->tensor, key));
    std::vector<float>& to = std::string(key) == "param"     ? out->param
                             : std::string(key) == "exp_avg" ? out->exp_avg
                                                             : out->exp_avg_sq;
    to.insert(to.end(), v.begin(), v.end());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DistribState> ReadDistribStateChunks(torchfmt::TorchArchiveReader* reader, const PyValue& root,
                                                    const std::string& path,
                                                    const std::vector<DistribBuffer>& buffers) {
  auto bad = [&](const std::string& why) { return absl::DataLossError(fmt::format("{}: {}", path, why)); };
  if (root.kind != PyValue::Kind::kDict) return bad("the pickle is not a dict: not a distributed optimizer's state");
  if (const PyValue* t = root.Get("param_state_sharding_type"); t && t->kind == PyValue::Kind::kStr)
    return bad(
        fmt::format("parameter state sharded as {:?}; ptk reads the layout save_parameter_state writes "
                    "(buckets_coalesced)",
                    t->s));
  const PyValue* coalesced = root.Get("buckets_coalesced");
  if (!coalesced || coalesced->Number() == 0)
    return bad("no buckets_coalesced: the per-bucket layout of Megatron before 2024, which ptk does not read");
  const auto chunks = static_cast<int64_t>(buffers.size());
  std::vector<const PyValue*> found(buffers.size(), nullptr);
  for (const auto& [k, v] : root.dict) {
    if (!k->IsInt()) continue;
    if (k->i < 0 || k->i >= chunks)
      return bad(chunks == 1 ? fmt::format("grad buffer {}: more than one (parameters of several dtypes, or experts): "
                                           "ptk reads one",
                                           k->i)
                             : fmt::format("grad buffer {}: more than the {} model chunks' (one each; parameters of "
                                           "several dtypes, or experts): ptk reads one a chunk",
                                           k->i, chunks));
    found[static_cast<size_t>(k->i)] = v.get();
  }
  DistribState out;
  for (int64_t i = 0; i < chunks; ++i) {
    if (!found[static_cast<size_t>(i)] && chunks > 1)
      return bad(
          fmt::format("grad buffer {} (model chunk {}): missing; the checkpoint has {} model chunks a rank, one "
                      "grad buffer each",
                      i, i, chunks));
    PTK_RETURN_IF_ERROR(ReadBuffer(reader, found[static_cast<size_t>(i)], i, buffers[static_cast<size_t>(i)],
                                   buffers.size(), path, &out));
  }
  return out;
}

bool WarnIfTiedCopyDiffers(const std::string& first_file, const DistribState& first, const std::string& emb_key,
                           const std::string& last_file, const DistribState& last, const std::string& out_key,
                           int64_t row0, int64_t rows, int64_t cols) {
  const int64_t e = first.offset.at(emb_key), o = last.offset.at(out_key);
  for (auto [what, a, b] : {std::tuple{"fp32 param", &first.param, &last.param},
                            {"exp_avg", &first.exp_avg, &last.exp_avg},
                            {"exp_avg_sq", &first.exp_avg_sq, &last.exp_avg_sq}})
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float x = (*a)[static_cast<size_t>(e + i)], y = (*b)[static_cast<size_t>(o + i)];
      if (std::memcmp(&x, &y, sizeof(float)) == 0) continue;
      log::Warning(
          "{}: the distributed optimizer's {} of {} (the last stage's copy of the tied embedding) differs from "
          "{}'s in {} at [{}, {}] ({} vs {}), which Megatron keeps equal: a damaged or edited checkpoint. Megatron "
          "would load each as it is; ptk's tied model takes stage 0's",
          last_file, what, out_key, emb_key, first_file, row0 + i / cols, i % cols, y, x);
      return true;
    }
  return false;
}

}  // namespace ptk::megatron
