// The sharded keys megatron-core 0.16.1's GPTModel.sharded_state_dict gives ptk's parameters in a torch_dist
// checkpoint (interop/megatron_dist.cpp reads them), mixture-of-experts and multi-latent attention models included,
// and the args a torch_dist import reads the model from (the experts' parallel layout dropped: the keys are global).
#include <algorithm>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "interop/megatron_common.h"

namespace ptk::megatron {

// The layers are stacked on a leading axis (decoder.layers.N.X -> decoder.layers.X, [L, ...]); the routed experts
// on a second (SequentialMLP's local_experts.K, TEGroupedMLP's and GroupedMLP's stacked weights alike:
// decoder.layers.mlp.experts.experts.linear_fc1.weight, [L, E, ...], the expert a global offset whatever the
// expert-parallel size). The names are Transformer Engine's under its spec; under the local spec the layer's own
// but for the input and pre-MLP norms of a layer without MLA, which its sharded_state_dict_keys_map gives TE's
// fused names (a MoE layer's pre-MLP norm too: mlp.linear_fc1.layer_norm_weight, while TE's MoE layer keeps
// pre_mlp_layernorm.weight). megatron-core's TransformerBlock gives each layer keys of its own instead
// (decoder.layers.N.X, `per_layer`) when its layers differ: --moe-layer-freq other than 1 (a list, or every k-th).
DistKey DistKeyOf(const GPTConfig& c, const MegParam& m, bool te, bool per_layer) {
  static const std::regex kLayer(R"(decoder\.layers\.(\d+)\.(.*))");
  static const std::regex kExpert(R"(mlp\.experts\.local_experts\.(\d+)\.(.*))");
  std::smatch match;
  const std::string& name = te ? m.te_name : m.local_name;  // MegParams(layout, 1): global layer numbers
  if (!std::regex_match(name, match, kLayer)) return DistKey{name, -1, -1};
  int64_t layer = std::atoll(match[1].str().c_str());
  std::string rest = match[2].str();
  std::smatch em;
  const std::string prefix = per_layer ? fmt::format("decoder.layers.{}.", layer) : "decoder.layers.";
  if (per_layer) layer = -1;
  if (std::regex_match(rest, em, kExpert))
    return DistKey{prefix + "mlp.experts.experts." + em[2].str(), layer, std::atoll(em[1].str().c_str())};
  if (!te && !c.mla()) {
    for (const auto& [from, to] :
         {std::pair<std::string, std::string>{"input_layernorm.", "self_attention.linear_qkv.layer_norm_"},
          {"pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"}})
      if (rest.rfind(from, 0) == 0) rest = to + rest.substr(from.size());
  }
  return DistKey{prefix + rest, layer, -1};
}

torchfmt::PyRef DistModelArgs(const PyValue* args, int64_t tp, std::vector<std::string>* notes) {
  auto copy = std::make_shared<PyValue>(*args);
  if (!args->state || args->state->kind != PyValue::Kind::kDict) return copy;
  copy->state = std::make_shared<PyValue>(*args->state);
  std::vector<std::string> layout;
  if (BoolAttr(args, "moe_grouped_gemm", false)) layout.push_back("--moe-grouped-gemm");
  if (auto ep = NumAttr(args, "expert_model_parallel_size"); ep && *ep != 1)
    layout.push_back(fmt::format("--expert-model-parallel-size {}", *ep));
  if (auto etp = NumAttr(args, "expert_tensor_parallel_size"); etp && *etp != static_cast<double>(tp))
    layout.push_back(fmt::format("--expert-tensor-parallel-size {}", *etp));
  if (layout.empty() || NumAttr(args, "num_experts").value_or(0) <= 0) return copy;
  auto& d = copy->state->dict;
  d.erase(std::remove_if(d.begin(), d.end(),
                         [](const auto& kv) {
                           return kv.first->kind == PyValue::Kind::kStr &&
                                  (kv.first->s == "moe_grouped_gemm" || kv.first->s == "expert_model_parallel_size" ||
                                   kv.first->s == "expert_tensor_parallel_size");
                         }),
          d.end());
  torchfmt::DictSet(copy->state.get(), "moe_grouped_gemm", torchfmt::MakeBool(false));
  torchfmt::DictSet(copy->state.get(), "expert_model_parallel_size", torchfmt::MakeInt(1));
  torchfmt::DictSet(copy->state.get(), "expert_tensor_parallel_size", torchfmt::MakeInt(tp));
  std::string what;
  for (const std::string& l : layout) what += (what.empty() ? "" : ", ") + l;
  notes->push_back(
      fmt::format("the experts were saved with {}: torch_dist keeps their global tensors, read whatever "
                  "the layout (ptk's MoE: SequentialMLP on one expert rank)",
                  what));
  return copy;
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

absl::Status CheckStackedLayers(const GPTConfig& c, const std::string& file, const std::string& key,
                                const std::vector<bool>& present, const std::vector<int64_t>& layers) {
  std::vector<bool> taken(present.size(), false);
  for (int64_t l : layers) taken[static_cast<size_t>(l)] = true;
  for (size_t l = 0; l < present.size(); ++l) {
    const char* kind = c.moe_layer(static_cast<int64_t>(l)) ? "a mixture-of-experts" : "a dense";
    if (taken[l] && !present[l])
      return absl::DataLossError(
          fmt::format("{}: tensor {}: layer {} missing (not saved), which common.pt's args make "
                      "{} layer with this parameter",
                      file, key, l, kind));
    if (present[l] && !taken[l])
      return absl::DataLossError(
          fmt::format("{}: tensor {}: holds layer {}, which common.pt's args make {} layer "
                      "without this parameter (--moe-layer-freq)",
                      file, key, l, kind));
  }
  return absl::OkStatus();
}

}  // namespace ptk::megatron
