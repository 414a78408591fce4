// Megatron's torch_dist checkpoints (megatron-core dist_checkpointing over
// torch.distributed.checkpoint) -> a ptk checkpoint.
#include <algorithm>
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
  // megatron-core shards SwiGLU's fc1 in torch_dist by a factory of its own (gate and up as separate
  // pieces): not read yet, rather than read wrong.
  if (!c.gpt3() || c.add_qkv_bias)
    return absl::UnimplementedError(fmt::format(
        "{}: a model of Megatron's Llama line in torch_dist format: ptk reads it in --ckpt-format torch (save it so, "
        "or convert it with Megatron's tools/checkpoint first)",
        common));
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
  // dp_zero_gather_scatter: objects optimizer.distributed.dp_group_idx_N.{param_state,optimizer}/shard_...
  std::string dp_zero_state, dp_zero_groups;
  for (const std::string& item : ck->byte_items()) {
    if (item.rfind("optimizer.distributed.", 0) != 0) continue;
    if (item.find(".param_state/") != std::string::npos) {
      if (!dp_zero_state.empty() || item.rfind("optimizer.distributed.dp_group_idx_0.", 0) != 0 || saved_tp > 1 ||
          NumAttr(args, "pipeline_model_parallel_size").value_or(1) > 1)
        return bad(meta, fmt::format("object {}: {} state of a tensor- or pipeline-parallel run (an object per "
                                     "model-parallel rank); ptk reads it saved at tensor and pipeline size 1",
                                     item, layout_name));
      dp_zero_state = item;
    } else if (item.find(".optimizer/") != std::string::npos) {
      dp_zero_groups = item;
    }
  }

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

  // dp_reshardable: tensors optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(...).bucket_idx_B.<what>, each
  // bucket's unpadded span of the world tensors (megatron-core's grad-buffer order).
  static const std::regex kBucket(
      R"(optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.*)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq))");
  std::map<int64_t, std::map<std::string, std::string>> buckets;  // bucket -> what -> key
  std::string bucket_dtype;
  for (const std::string& key : optimizer_keys) {
    std::smatch mt;
    if (key.rfind("optimizer.distributed.", 0) != 0) continue;
    if (!std::regex_match(key, mt, kBucket))
      return bad(meta, fmt::format("tensor {}: optimizer state in a layout ptk does not read ({})", key, layout_name));
    if (mt[1].str() != "0" || mt[2].str() != "0" || (!bucket_dtype.empty() && mt[3].str() != bucket_dtype) ||
        saved_tp > 1 || NumAttr(args, "pipeline_model_parallel_size").value_or(1) > 1)
      return bad(meta, fmt::format("tensor {}: {} state of a tensor- or pipeline-parallel run, or of parameters of "
                                   "several dtypes (a grad buffer each); ptk reads one, saved at tensor and "
                                   "pipeline size 1",
                                   key, layout_name));
    bucket_dtype = mt[3].str();
    buckets[std::atoll(mt[4].str().c_str())][mt[5].str()] = key;
  }
  // The parameters in megatron-core's grad-buffer layout (one stage: tensor and pipeline size 1).
  auto distrib_params = [&] {
    const bool te = StrAttr(args, "transformer_impl").value_or("transformer_engine") != "local";
    std::vector<DistribParam> dparams;
    for (const MegParam* m : StageOrder(params, 0, te)) {
      std::vector<int64_t> shape = m->info->shape;
      if (m->vocab) shape[0] = model.ckpt_padded;
      dparams.push_back(DistribParam{m->info->name, Elements(shape), false});
    }
    return dparams;
  };
  auto scatter_distrib = [&](const DistribState& d) {
    for (const MegParam& m : params) {
      const int64_t at = d.offset.at(m.info->name);
      for (auto [src, dst] : {std::pair{&d.param, &weights}, {&d.exp_avg, &m1}, {&d.exp_avg_sq, &m2}})
        std::copy(src->begin() + at, src->begin() + at + m.info->size, dst->begin() + m.info->offset);
    }
  };

  if (!buckets.empty()) {
    DistribState d;
    const std::vector<DistribParam> dparams = distrib_params();
    const int64_t total = DistribLayout(dparams, DistribBucketSize(args, 0), &d.offset);
    int64_t next = 0;
    for (const auto& [b, keys] : buckets) {
      if (b != next++)
        return bad(meta, fmt::format("{}: bucket {} missing ({} state)", keys.begin()->second, next - 1, layout_name));
      for (auto [what, dst] : {std::pair{"param", &d.param}, {"exp_avg", &d.exp_avg}, {"exp_avg_sq", &d.exp_avg_sq}}) {
        auto it = keys.find(what);
        if (it == keys.end()) return bad(meta, fmt::format("bucket {}: no tensor {} ({} state)", b, what, layout_name));
        PTK_ASSIGN_OR_RETURN(std::vector<float> v, ck->ReadFloat(it->second));
        dst->insert(dst->end(), v.begin(), v.end());
        optimizer_keys.erase(it->second);
      }
    }
    if (static_cast<int64_t>(d.param.size()) != total || d.exp_avg.size() != d.param.size() ||
        d.exp_avg_sq.size() != d.param.size())
      return bad(meta, fmt::format("{} state: its {} buckets hold {} elements; the {} parameters common.pt's args "
                                   "describe, laid out as megatron-core lays them, take {}",
                                   layout_name, buckets.size(), d.param.size(), dparams.size(), total));
    if (!optimizer_keys.empty())
      return bad(meta, fmt::format("tensor {} beside {}'s buckets: two optimizer states", *optimizer_keys.begin(),
                                   layout_name));
    scatter_distrib(d);
  } else if (!dp_zero_state.empty()) {
    // The world tensors distrib_optim.pt holds, as one object (a list of one state dict), in megatron-core's
    // grad-buffer order; the param groups in another object.
    if (!optimizer_keys.empty())
      return bad(meta, fmt::format("tensor {} beside object {}: two optimizer states", *optimizer_keys.begin(),
                                   dp_zero_state));
    PTK_ASSIGN_OR_RETURN(auto item, ck->OpenItem(dp_zero_state));
    const PyValue& list = item->root();
    if (list.kind != PyValue::Kind::kList || list.items.size() != 1)
      return bad(meta, fmt::format("object {}: not the list of one state megatron-core saves", dp_zero_state));
    PTK_ASSIGN_OR_RETURN(DistribState d,
                         ReadDistribState(item.get(), *list.items[0], fmt::format("{}: object {}", meta, dp_zero_state),
                                          distrib_params(), DistribBucketSize(args, 0)));
    scatter_distrib(d);
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
  if (!buckets.empty() || !dp_zero_state.empty()) {
    // The grad-buffer formats keep the param groups (and Adam's step) in an object of their own.
    have_moments = have_masters = true;
    if (dp_zero_groups.empty())
      return bad(meta, fmt::format("{} state: no object optimizer.distributed.dp_group_idx_0.optimizer beside {} (the "
                                   "param groups and Adam's step)",
                                   layout_name, buckets.empty() ? dp_zero_state : "its buckets"));
    PTK_ASSIGN_OR_RETURN(groups_reader, ck->OpenItem(dp_zero_groups));
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
  if (!dp_zero_state.empty() || !buckets.empty())
    s.notes.push_back(fmt::format("the weights and AdamW moments are {} fp32 state ({})", layout_name,
                                  buckets.empty() ? dp_zero_state : "its grad-buffer buckets"));
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
