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
    return bad(common, "virtual pipeline stages (model0, model1, ...): ptk reads one model chunk");
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
  static const char* kStates[] = {"optimizer.state.fp32_param.", "optimizer.state.exp_avg.",
                                  "optimizer.state.exp_avg_sq."};
  std::set<std::string> other_optimizer;
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
      other_optimizer.insert(key);
      continue;
    }
    return bad(meta, fmt::format("tensor {}: not a weight of the GPT model common.pt's args describe{}", key,
                                 c.untie_embeddings_and_output_weights ? "" : " (output layer tied)"));
  }
  for (const auto& [key, shape] : want)
    if (!tensors.count(key)) return bad(meta, fmt::format("tensor {}: missing", key));
  // The plain optimizer's state in model space: optimizer.state.<what>.<key>, the model's shapes.
  bool have_moments = true, have_masters = true;
  for (const auto& [key, shape] : want)
    for (int w = 0; w < 3; ++w) {
      const std::string k = kStates[w] + key;
      auto it = tensors.find(k);
      if (it == tensors.end() || it->second.shape != shape) {
        (w == 0 ? have_masters : have_moments) = false;
      } else {
        other_optimizer.erase(k);
      }
    }

  std::vector<float> weights(static_cast<size_t>(layout.num_params)), m1(weights.size(), 0.0f),
      m2(weights.size(), 0.0f);
  bool low_precision = false;
  // Each key read once (a stacked tensor holds every layer's parameter), scattered to ptk's tensors:
  // the layer's slice, then ptk's rows (the vocabulary cut to ptk's padding: a prefix).
  std::map<std::string, std::vector<std::pair<const MegParam*, int64_t>>> by_key;
  for (const MegParam& m : params) {
    const DistKey k = KeyOf(m);
    by_key[k.key].emplace_back(&m, k.layer);
  }
  for (int w = 0; w < 3; ++w) {
    if (w > 0 && !have_moments) continue;
    std::vector<float>& dst = w == 0 ? weights : w == 1 ? m1 : m2;
    for (const auto& [base, members] : by_key) {
      const std::string key = w == 0 ? (have_masters ? kStates[0] + base : base) : kStates[w] + base;
      if (w == 0 && !have_masters && tensors.at(base).dtype != torchfmt::DType::kFloat32) low_precision = true;
      PTK_ASSIGN_OR_RETURN(std::vector<float> v, ck->ReadFloat(key));
      for (const auto& [m, layer] : members) {
        const int64_t per_layer = Elements(want.at(base)) / (layer >= 0 ? c.num_layers : 1);
        const int64_t start = layer >= 0 ? layer * per_layer : 0;
        std::copy(v.begin() + start, v.begin() + start + m->info->size, dst.begin() + m->info->offset);
      }
    }
  }
  for (size_t i = 0; i < weights.size(); ++i)
    if (!std::isfinite(weights[i])) return bad(meta, fmt::format("weight element {} is NaN or infinite", i));

  // Adam's step: the optimizer's param groups in common.pt (optimizer[.optimizer].param_groups[].step).
  int64_t adam_step = 0;
  if (have_moments) {
    const PyValue* opt = root.Get("optimizer");
    if (opt && opt->Get("optimizer")) opt = opt->Get("optimizer");
    const PyValue* groups = opt ? opt->Get("param_groups") : nullptr;
    if (groups && groups->kind == PyValue::Kind::kList)
      for (const auto& g : groups->items)
        if (auto st = NumAttr(g.get(), "step")) adam_step = std::max(adam_step, static_cast<int64_t>(*st));
    if (adam_step == 0) {  // Megatron steps once per iteration (skipped fp16 steps aside)
      adam_step = s.iteration;
      s.notes.push_back(
          fmt::format("common.pt's optimizer records no Adam step: taken as the iteration, {}", s.iteration));
    }
  } else {
    std::fill(m1.begin(), m1.end(), 0.0f);
    std::fill(m2.begin(), m2.end(), 0.0f);
    s.notes.push_back(
        other_optimizer.empty()
            ? "the checkpoint holds no AdamW moments (saved with --no-save-optim): they start at zero"
            : fmt::format("the optimizer's state is sharded in a layout ptk does not read ({} ...; the distributed "
                          "optimizer's): the AdamW moments start at zero (ptk-train --load ... --no-load-optim)",
                          *other_optimizer.begin()));
  }
  if (low_precision)
    s.notes.push_back("the weights are the model's bf16/fp16 copies widened to fp32 (no fp32 masters saved)");
  if (have_masters) s.notes.push_back("the weights are the optimizer's fp32 master copies (a --bf16/--fp16 run)");
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
