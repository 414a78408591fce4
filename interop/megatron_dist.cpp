// Megatron's torch_dist checkpoints (megatron-core dist_checkpointing over
// torch.distributed.checkpoint) -> a ptk checkpoint. The keys' global tensors are the whole model's
// whatever the tensor size: SwiGLU's linear_fc1 too, whose rows megatron-core's
// apply_swiglu_sharded_factory saves as every rank's gate, then every rank's up ([gate; up], ptk's
// layout); only the distributed optimizer's grad-buffer formats hold a state per model-parallel rank.
#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <regex>
#include <set>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/status.h"
#include "interop/megatron_common.h"
#include "interop/megatron_optim.h"
#include "interop/torch_dist.h"

namespace ptk::megatron {
namespace {

// The sharded key megatron-core's GPTModel.sharded_state_dict gives a ptk parameter, and whether its
// layers are stacked on a leading axis (decoder.layers.N.X -> decoder.layers.X, [L, ...]).
struct DistKey {
  std::string key;
  int64_t layer = -1;  // the index on the leading axis; -1 not stacked
};

// megatron-core's sharded keys use Transformer Engine's names for either layer spec (the local spec's
// input_layernorm is saved as self_attention.linear_qkv.layer_norm_weight, so that each loads the other).
DistKey KeyOf(const MegParam& m) {
  static const std::regex kLayer(R"(decoder\.layers\.(\d+)\.(.*))");
  std::smatch match;
  const std::string& name = m.te_name;  // MegParams(layout, 1): global layer numbers
  if (std::regex_match(name, match, kLayer))
    return DistKey{"decoder.layers." + match[2].str(), std::atoll(match[1].str().c_str())};
  return DistKey{name, -1};
}

// fully_sharded_model_space's tensor `v`, saved as `saved` ([X/x, Y/y, ..., x*y*...]: the grid of the
// ranks' local shapes [x, y, ...], then a local shape flattened), back to `shape` ([X, Y, ...]); a shape
// of neither form is refused.
absl::StatusOr<std::vector<float>> Unflatten(const std::vector<float>& v, const std::vector<int64_t>& saved,
                                             const std::vector<int64_t>& shape, const std::string& where) {
  const size_t n = shape.size();
  std::vector<int64_t> local(n, 1);
  int64_t local_numel = 1;
  bool ok = saved.size() == n + 1;
  for (size_t d = 0; ok && d < n; ++d) {
    ok = saved[d] > 0 && shape[d] % saved[d] == 0;
    if (ok) local_numel *= (local[d] = shape[d] / saved[d]);
  }
  if (!ok || saved[n] != local_numel)
    return absl::DataLossError(
        fmt::format("{}: shape {}: neither the parameter's {} nor a grid of its flattened "
                    "local shards ([X/x, ..., x*...])",
                    where, ShapeStr(saved), ShapeStr(shape)));
  std::vector<int64_t> stride(n, 1);
  for (size_t d = n; d-- > 1;) stride[d - 1] = stride[d] * shape[d];
  std::vector<float> out(v.size());
  for (int64_t src = 0; src < static_cast<int64_t>(v.size()); ++src) {
    int64_t grid = src / local_numel, in_local = src % local_numel, dst = 0;
    for (size_t d = n; d-- > 0;) {
      dst += ((grid % saved[d]) * local[d] + in_local % local[d]) * stride[d];
      grid /= saved[d];
      in_local /= local[d];
    }
    out[dst] = v[src];
  }
  return out;
}

// The distributed optimizer's state in megatron-core's grad-buffer layout, one world state per
// model-parallel rank (the N of optimizer.distributed.dp_group_idx_N: megatron-core's model-parallel group
// rank, tensor rank + TP x pipeline rank): dp_reshardable's buckets or dp_zero_gather_scatter's object.
struct GradBuffers {
  std::map<int64_t, std::map<int64_t, std::map<std::string, std::string>>> buckets;  // rank -> bucket -> what -> key
  std::map<int64_t, std::string> objects;                                            // rank -> its param_state object
  std::string groups;  // dp_group_idx_0.optimizer: the param groups and Adam's step
  bool empty() const { return buckets.empty() && objects.empty(); }
};

// What reading the grad buffers needs of the checkpoint and the model.
struct DistSource {
  torchdist::DistCheckpoint* ck;
  const PyValue* args;
  const std::vector<MegParam>& params;
  const MegatronModel& model;
  int64_t tp, pp;
  bool te;  // Transformer Engine's parameter order (args.transformer_impl)
  std::string meta, layout_name;
};

// Rank `rank`'s world state (tensor rank rank % TP, pipeline rank rank / TP), checked against that rank's
// grad-buffer layout.
absl::StatusOr<DistribState> RankGradBuffer(const DistSource& x, const GradBuffers& g, int64_t rank) {
  const int64_t p = rank / x.tp;
  const bool tied_copy = !x.model.config.untie_embeddings_and_output_weights && x.pp > 1;
  const std::vector<DistribParam> dparams =
      StageDistribParams(x.params, p, x.pp, x.te, tied_copy, x.model.ckpt_padded, x.tp, x.model.config.hidden_size);
  const std::string rank_name =
      fmt::format("model-parallel rank {} (tensor rank {}, pipeline rank {})", rank, rank % x.tp, p);
  if (auto it = g.objects.find(rank); it != g.objects.end()) {
    PTK_ASSIGN_OR_RETURN(auto item, x.ck->OpenItem(it->second));
    const PyValue& list = item->root();
    if (list.kind != PyValue::Kind::kList || list.items.size() != 1)
      return absl::DataLossError(
          fmt::format("{}: object {}: not the list of one state megatron-core saves", x.meta, it->second));
    return ReadDistribState(item.get(), *list.items[0], fmt::format("{}: object {}", x.meta, it->second), dparams,
                            DistribBucketSize(x.args, p));
  }
  auto it = g.buckets.find(rank);
  if (it == g.buckets.end())
    return absl::DataLossError(
        fmt::format("{}: {} state: nothing of {} (optimizer.distributed.dp_group_idx_{}), "
                    "which the args' {} tensor x {} pipeline ranks have",
                    x.meta, x.layout_name, rank_name, rank, x.tp, x.pp));
  DistribState d;
  const int64_t total = DistribLayout(dparams, DistribBucketSize(x.args, p), &d.offset);
  int64_t next = 0;
  for (const auto& [b, keys] : it->second) {
    if (b != next++)
      return absl::DataLossError(
          fmt::format("{}: {}: bucket {} missing ({} state)", x.meta, keys.begin()->second, next - 1, x.layout_name));
    for (auto [what, dst] : {std::pair{"param", &d.param}, {"exp_avg", &d.exp_avg}, {"exp_avg_sq", &d.exp_avg_sq}}) {
      auto k = keys.find(what);
      if (k == keys.end())
        return absl::DataLossError(
            fmt::format("{}: {}, bucket {}: no tensor {} ({} state)", x.meta, rank_name, b, what, x.layout_name));
      PTK_ASSIGN_OR_RETURN(std::vector<float> v, x.ck->ReadFloat(k->second));
      dst->insert(dst->end(), v.begin(), v.end());
    }
  }
  if (static_cast<int64_t>(d.param.size()) != total || d.exp_avg.size() != d.param.size() ||
      d.exp_avg_sq.size() != d.param.size())
    return absl::DataLossError(fmt::format(
        "{}: {} state of {}: its {} buckets hold {} elements; the {} parameters common.pt's args give it, laid out "
        "as megatron-core lays them, take {}",
        x.meta, x.layout_name, rank_name, it->second.size(), d.param.size(), dparams.size(), total));
  return d;
}

// Every model-parallel rank's grad-buffer state gathered into the whole tensors (w, m1, m2 in ptk's layout):
// each rank's shard of each of its stage's parameters (SwiGLU's linear_fc1: the rank's [gate; up]).
absl::Status GatherGradBuffers(const DistSource& x, const GradBuffers& g, std::vector<float>& w, std::vector<float>& m1,
                               std::vector<float>& m2) {
  auto beyond = [&](const std::string& what, int64_t rank) {
    return absl::DataLossError(
        fmt::format("{}: {}: {} state of model-parallel rank {}, beyond the args' {} tensor "
                    "x {} pipeline ranks",
                    x.meta, what, x.layout_name, rank, x.tp, x.pp));
  };
  for (const auto& [rank, item] : g.objects)
    if (rank >= x.tp * x.pp) return beyond(item, rank);
  for (const auto& [rank, buckets] : g.buckets)
    if (rank >= x.tp * x.pp) return beyond(buckets.begin()->second.begin()->second, rank);
  std::map<const MegParam*, std::array<std::vector<float>, 3>> full;  // at the checkpoint's vocabulary rows
  for (int64_t rank = 0; rank < x.tp * x.pp; ++rank) {
    const int64_t t = rank % x.tp, p = rank / x.tp;
    PTK_ASSIGN_OR_RETURN(DistribState d, RankGradBuffer(x, g, rank));
    for (const MegParam& m : x.params) {
      if (m.stage != p || (m.split < 0 && t > 0)) continue;  // a replicated parameter: tensor rank 0's
      std::vector<int64_t> shape = m.info->shape;
      if (m.vocab) shape[0] = x.model.ckpt_padded;
      const int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1;
      const int64_t at = d.offset.at(x.te ? m.te_name : m.local_name);
      auto& f = full[&m];
      int i = 0;
      for (std::vector<float>* src : {&d.param, &d.exp_avg, &d.exp_avg_sq}) {
        f[i].resize(static_cast<size_t>(rows * cols));
        CopyShard(f[i].data(), src->data() + at, rows, cols, m.split, m.split < 0 ? 0 : t, m.split < 0 ? 1 : x.tp,
                  /*gather=*/true, m.chunks);
        ++i;
      }
    }
  }
  for (const auto& [m, f] : full) {  // ptk's rows: the vocabulary cut to ptk's padding is a prefix
    int i = 0;
    for (std::vector<float>* dst : {&w, &m1, &m2}) {
      std::copy(f[i].begin(), f[i].begin() + m->info->size, dst->begin() + m->info->offset);
      ++i;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ConvertSummary> ImportFromMegatronDist(const ConvertOptions& o, const std::string& iter_dir,
                                                      int64_t iteration) {
  ConvertSummary s;
  s.iteration = iteration;
  // common.pt: what is not sharded (args, iteration, the scheduler, the optimizer's groups).
  const std::string common = JoinPath(iter_dir, "common.pt");
  if (!PathExists(common))
    return absl::NotFoundError(
        fmt::format("{}: missing: a torch_dist checkpoint keeps its args and iteration there", common));
  PTK_ASSIGN_OR_RETURN(auto reader, torchfmt::TorchArchiveReader::Open(common));
  s.source = iter_dir;
  const PyValue& root = reader->root();
  auto bad = [&](const std::string& file, const std::string& why) {
    return absl::DataLossError(fmt::format("{}: {}", file, why));
  };
  if (root.kind != PyValue::Kind::kDict) return bad(common, "the pickle is not a dict: not Megatron's common.pt");
  const PyValue* args = root.Get("args");
  if (!args || args->kind != PyValue::Kind::kObject)
    return bad(common, "no args (an argparse.Namespace): not a Megatron training checkpoint");
  if (const PyValue* it = root.Get("iteration"); it && it->IsInt()) s.iteration = it->i;
  if (auto vp = NumAttr(args, "virtual_pipeline_model_parallel_size"); vp && *vp > 1)
    return bad(common,
               "virtual pipeline stages (an interleaved run's model chunks) in torch_dist: ptk reads them in "
               "Megatron's torch format only (--ckpt-format torch)");
  const int64_t saved_tp = static_cast<int64_t>(NumAttr(args, "tensor_model_parallel_size").value_or(1));
  PTK_ASSIGN_OR_RETURN(MegatronModel model, ModelFromArgs(args, common, o, saved_tp));
  s.config = model.config;
  const GPTConfig& c = s.config;
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  PTK_ASSIGN_OR_RETURN(std::vector<MegParam> params, MegParams(layout, 1));

  PTK_ASSIGN_OR_RETURN(auto ck, torchdist::DistCheckpoint::Open(iter_dir));
  const std::string meta = JoinPath(iter_dir, ".metadata");
  const auto& tensors = ck->tensors();

  // The keys the model must have, each with its global shape; nothing else but the optimizer's.
  std::map<std::string, std::vector<int64_t>> want;
  for (const MegParam& m : params) {
    const DistKey k = KeyOf(m);
    std::vector<int64_t> shape = m.info->shape;
    if (m.vocab) shape[0] = model.ckpt_padded;
    if (k.layer >= 0) shape.insert(shape.begin(), c.num_layers);
    want[k.key] = shape;
  }
  std::set<std::string> optimizer_keys;  // the optimizer's tensors, each to be read or refused
  for (const auto& [key, e] : tensors) {
    if (want.count(key)) {
      if (e.shape != want.at(key))
        return bad(meta, fmt::format("tensor {}: shape {}, the model common.pt's args describe has {} (--num-layers "
                                     "{}, --hidden-size {}, --ffn-hidden-size {}, padded vocabulary {})",
                                     key, ShapeStr(e.shape), ShapeStr(want.at(key)), c.num_layers, c.hidden_size,
                                     c.ffn_hidden_size, model.ckpt_padded));
      continue;
    }
    if (key.rfind("optimizer.", 0) == 0) {
      optimizer_keys.insert(key);
      continue;
    }
    // megatron-core's singleton_local_shards layout (what its metadata asks for, never Megatron-LM since 0.14):
    // each layer a key of its own, SwiGLU's gate and up as linear_fc1.weight_w / _v.
    static const std::regex kSingleton(R"(decoder\.layers\.\d+\..*|.*\.linear_fc1\.(weight|bias)_[wv])");
    if (std::regex_match(key, kSingleton))
      return bad(meta, fmt::format("tensor {}: megatron-core's singleton_local_shards layout (a key per layer, "
                                   "SwiGLU's gate and up apart as linear_fc1.weight_w / _v), which Megatron-LM does "
                                   "not save and ptk does not read: save with Megatron-LM's save_checkpoint",
                                   key));
    return bad(meta, fmt::format("tensor {}: not a weight of the GPT model common.pt's args describe{}", key,
                                 c.untie_embeddings_and_output_weights ? "" : " (output layer tied)"));
  }
  for (const auto& [key, shape] : want)
    if (!tensors.count(key)) return bad(meta, fmt::format("tensor {}: missing", key));

  // The optimizer's layout: common.pt's optimizer.param_state_sharding_type for the distributed optimizer.
  const PyValue* opt_common = root.Get("optimizer");
  const std::string sharding = opt_common ? StrAttr(opt_common, "param_state_sharding_type").value_or("") : "";
  const std::string layout_name =
      sharding.empty() ? "the plain optimizer's layout" : fmt::format("the distributed optimizer's {:?}", sharding);
  // The grad-buffer formats, one state per model-parallel rank N: dp_zero_gather_scatter's objects
  // optimizer.distributed.dp_group_idx_N.{param_state,optimizer}/shard_..., dp_reshardable's tensors
  // optimizer.distributed.dp_group_idx_N.gbuf_idx_0.dtype_(...).bucket_idx_B.<what>, each bucket's unpadded span of
  // the rank's world tensors (megatron-core's grad-buffer order).
  const int64_t saved_pp = static_cast<int64_t>(NumAttr(args, "pipeline_model_parallel_size").value_or(1));
  GradBuffers grad_buffers;
  static const std::regex kGroupItem(R"(optimizer\.distributed\.dp_group_idx_(\d+)\.(param_state|optimizer)/.*)");
  for (const std::string& item : ck->byte_items()) {
    std::smatch mt;
    if (!std::regex_match(item, mt, kGroupItem)) continue;
    const int64_t rank = std::atoll(mt[1].str().c_str());
    if (mt[2].str() == "optimizer") {
      if (rank == 0) grad_buffers.groups = item;
    } else if (!grad_buffers.objects.emplace(rank, item).second) {
      return bad(meta, fmt::format("object {}: a second param_state of model-parallel rank {} ({} state)", item, rank,
                                   layout_name));
    }
  }
  static const std::regex kBucket(
      R"(optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.*)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq))");
  std::string bucket_dtype;
  for (const std::string& key : optimizer_keys) {
    std::smatch mt;
    if (key.rfind("optimizer.distributed.", 0) != 0) continue;
    if (!std::regex_match(key, mt, kBucket))
      return bad(meta, fmt::format("tensor {}: optimizer state in a layout ptk does not read ({})", key, layout_name));
    if (mt[2].str() != "0" || (!bucket_dtype.empty() && mt[3].str() != bucket_dtype))
      return bad(meta, fmt::format("tensor {}: {} state of parameters of several dtypes (a grad buffer each); ptk "
                                   "reads one",
                                   key, layout_name));
    bucket_dtype = mt[3].str();
    grad_buffers.buckets[std::atoll(mt[1].str().c_str())][std::atoll(mt[4].str().c_str())][mt[5].str()] = key;
  }
  if (!grad_buffers.empty() && saved_pp > 1)
    return bad(meta, fmt::format("{} state of a pipeline-parallel run ({} stages, {}): ptk reads the grad-buffer "
                                 "formats saved at pipeline size 1",
                                 layout_name, saved_pp,
                                 grad_buffers.objects.empty()
                                     ? grad_buffers.buckets.begin()->second.begin()->second.begin()->second
                                     : grad_buffers.objects.begin()->second));
  if (!grad_buffers.buckets.empty() && !grad_buffers.objects.empty())
    return bad(meta,
               fmt::format("object {} beside tensor {}: two optimizer states", grad_buffers.objects.begin()->second,
                           grad_buffers.buckets.begin()->second.begin()->second.begin()->second));

  std::vector<float> weights(static_cast<size_t>(layout.num_params)), m1(weights.size(), 0.0f),
      m2(weights.size(), 0.0f);
  bool low_precision = false, have_moments = false, have_masters = false;
  const PyValue* groups_holder = opt_common;  // what holds the param groups (and Adam's step)
  std::unique_ptr<torchfmt::TorchArchiveReader> groups_reader;
  // Each key read once (a stacked tensor holds every layer's parameter), scattered to ptk's tensors:
  // the layer's slice, then ptk's rows (the vocabulary cut to ptk's padding: a prefix).
  std::map<std::string, std::vector<std::pair<const MegParam*, int64_t>>> by_key;
  for (const MegParam& m : params) {
    const DistKey k = KeyOf(m);
    by_key[k.key].emplace_back(&m, k.layer);
  }
  auto scatter = [&](const std::string& base, const std::vector<float>& v, std::vector<float>& dst) {
    for (const auto& [m, layer] : by_key.at(base)) {
      const int64_t per_layer = Elements(want.at(base)) / (layer >= 0 ? c.num_layers : 1);
      const int64_t start = layer >= 0 ? layer * per_layer : 0;
      std::copy(v.begin() + start, v.begin() + start + m->info->size, dst.begin() + m->info->offset);
    }
  };
  for (const auto& [base, members] : by_key) {
    if (tensors.at(base).dtype != torchfmt::DType::kFloat32) low_precision = true;
    PTK_ASSIGN_OR_RETURN(std::vector<float> v, ck->ReadFloat(base));
    scatter(base, v, weights);
  }

  if (!grad_buffers.empty()) {
    std::set<std::string> bucket_keys;
    for (const auto& [rank, buckets] : grad_buffers.buckets)
      for (const auto& [b, keys] : buckets)
        for (const auto& [what, key] : keys) bucket_keys.insert(key);
    for (const std::string& key : optimizer_keys)
      if (!bucket_keys.count(key))
        return bad(meta, fmt::format("tensor {} beside {}'s {}: two optimizer states", key, layout_name,
                                     grad_buffers.buckets.empty() ? "objects" : "buckets"));
    const bool te = StrAttr(args, "transformer_impl").value_or("transformer_engine") != "local";
    PTK_RETURN_IF_ERROR(
        GatherGradBuffers(DistSource{ck.get(), args, params, model, saved_tp, saved_pp, te, meta, layout_name},
                          grad_buffers, weights, m1, m2));
  } else if (!optimizer_keys.empty()) {
    // In model space, optimizer.state.<what>.<key>: the plain optimizer's (fp32_param: the masters of a
    // --bf16/--fp16 run), the distributed optimizer's fully_reshardable (param) and fully_sharded_model_space
    // (fp32_param; megatron-core <= 0.13: a [X, Y, ...] tensor whose ranks hold [x, y, ...] saved as
    // [X/x, Y/y, ..., x*y*...], each rank's flattened shard along the last axis).
    const char* master = nullptr;
    for (const char* m : {"optimizer.state.fp32_param.", "optimizer.state.param."})
      if (tensors.count(m + by_key.begin()->first)) master = m;
    for (const auto& [base, members] : by_key) {
      for (const char* what : {"optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.", master}) {
        if (!what) continue;
        const std::string key = what + base;
        auto it = tensors.find(key);
        if (it == tensors.end())
          return bad(meta, fmt::format("tensor {}: missing from {} state (which has {}, ...)", key, layout_name,
                                       *optimizer_keys.begin()));
        PTK_ASSIGN_OR_RETURN(std::vector<float> v, ck->ReadFloat(key));
        if (it->second.shape != want.at(base)) {
          PTK_ASSIGN_OR_RETURN(v, Unflatten(v, it->second.shape, want.at(base),
                                            fmt::format("{}: tensor {} ({} state)", meta, key, layout_name)));
        }
        scatter(base, v, what == master ? weights : std::string(what) == "optimizer.state.exp_avg." ? m1 : m2);
        optimizer_keys.erase(key);
      }
    }
    if (!optimizer_keys.empty())
      return bad(meta, fmt::format("tensor {}: optimizer state in a layout ptk does not read ({})",
                                   *optimizer_keys.begin(), layout_name));
    have_moments = true;
    have_masters = master != nullptr;
  }
  if (!grad_buffers.empty()) {
    // The grad-buffer formats keep the param groups (and Adam's step) in an object of their own.
    have_moments = have_masters = true;
    if (grad_buffers.groups.empty())
      return bad(meta,
                 fmt::format("{} state: no object optimizer.distributed.dp_group_idx_0.optimizer beside {} (the "
                             "param groups and Adam's step)",
                             layout_name,
                             grad_buffers.buckets.empty() ? grad_buffers.objects.begin()->second : "its buckets"));
    PTK_ASSIGN_OR_RETURN(groups_reader, ck->OpenItem(grad_buffers.groups));
    const PyValue& g = groups_reader->root();
    groups_holder = g.kind == PyValue::Kind::kList && g.items.size() == 1 ? g.items[0].get() : nullptr;
  }
  if (have_masters) low_precision = false;
  for (size_t i = 0; i < weights.size(); ++i)
    if (!std::isfinite(weights[i])) return bad(meta, fmt::format("weight element {} is NaN or infinite", i));

  // Adam's step: the optimizer's param groups (optimizer[.optimizer].param_groups[].step), in common.pt or,
  // for dp_zero_gather_scatter, in an object of its own.
  int64_t adam_step = 0;
  if (have_moments) {
    const PyValue* opt = groups_holder;
    if (opt && opt->Get("optimizer")) opt = opt->Get("optimizer");
    const PyValue* groups = opt ? opt->Get("param_groups") : nullptr;
    if (groups && groups->kind == PyValue::Kind::kList)
      for (const auto& g : groups->items)
        if (auto st = NumAttr(g.get(), "step")) adam_step = std::max(adam_step, static_cast<int64_t>(*st));
    if (adam_step == 0) {  // Megatron steps once per iteration (skipped fp16 steps aside)
      adam_step = s.iteration;
      s.notes.push_back(
          fmt::format("the optimizer's param groups record no Adam step: taken as the iteration, {}", s.iteration));
    }
  } else {
    s.notes.push_back("the checkpoint holds no AdamW moments (saved with --no-save-optim): they start at zero");
  }
  if (low_precision)
    s.notes.push_back("the weights are the model's bf16/fp16 copies widened to fp32 (no fp32 masters saved)");
  if (!grad_buffers.empty())
    s.notes.push_back(
        fmt::format("the weights and AdamW moments are {} fp32 state ({})", layout_name,
                    grad_buffers.buckets.empty() ? "its param_state objects" : "its grad-buffer buckets"));
  else if (have_masters)
    s.notes.push_back(fmt::format("the weights are the optimizer's fp32 master copies ({} state)", layout_name));
  if (model.ckpt_padded > c.padded_vocab_size)
    s.notes.push_back(
        fmt::format("the vocabulary's {} padded rows are cut to {} (a multiple of {}, as ptk-train pads "
                    "{} tokens)",
                    model.ckpt_padded, c.padded_vocab_size, model.divisible, c.vocab_size));
  PTK_RETURN_IF_ERROR(SaveImported(o, args, root, reader.get(), layout, model.divisible, have_moments ? adam_step : 0,
                                   weights, m1, m2, &s));
  s.notes.push_back(fmt::format("read a torch_dist checkpoint ({} tensors){}", tensors.size(),
                                have_moments ? ", with the AdamW moments" : ""));
  return s;
}

}  // namespace ptk::megatron
