// ptk-train's mixture-of-experts flags (Megatron's --num-experts, --moe-*): declared, resolved into
// GPTConfig, and the MoE features and combinations this first slice has not refused in one line each.
#include <cctype>
#include <charconv>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"

namespace ptk {

using train_flags::IntIn;
using train_flags::kMaxSize;
using train_flags::NonNegative;

void AddMoeFlags(CLI::App* app, TrainFlags* f) {
  TrainFlags::Moe& m = f->moe;
  app->add_option("--num-experts", m.num_experts,
                  "Mixture of experts: experts per MoE layer (default none: every MLP dense), with "
                  "--disable-bias-linear; --device cuda: dropless and data-parallel only")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--moe-router-topk", m.topk, "Experts each token is sent to (default 2)")->check(IntIn(1, kMaxSize));
  app->add_option("--moe-ffn-hidden-size", m.ffn, "Each expert's ffn width (default --ffn-hidden-size)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--moe-aux-loss-coeff", m.aux_loss_coeff,
                  "Weight of the switch load-balancing loss (default 0: none); logged as load_balancing_loss")
      ->check(NonNegative());
  app->add_option("--moe-z-loss-coeff", m.z_loss_coeff,
                  "Weight of the router z-loss (the tokens' mean of logsumexp(logits)^2; default none); logged as "
                  "z_loss")
      ->check(NonNegative());
  app->add_option("--moe-router-topk-scaling-factor", m.topk_scaling_factor,
                  "The chosen experts' probabilities times this factor (default none)")
      ->check(NonNegative());
  app->add_option("--moe-router-num-groups", m.num_groups,
                  "Group-limited routing: the experts in this many equal groups (with --moe-router-group-topk)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--moe-router-group-topk", m.group_topk,
                  "Group-limited routing: each token's experts chosen among this many groups, those whose "
                  "topk / group-topk largest scores add up to the most")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--moe-router-load-balancing-type", m.load_balancing_type,
                  "aux_loss (the default: the switch load-balancing loss, weighted by --moe-aux-loss-coeff), "
                  "seq_aux_loss (each sequence's, logged as seq_load_balancing_loss), global_aux_loss (the global "
                  "batch's counts, logged as global_load_balancing_loss) or none; a list of several takes as many "
                  "--moe-aux-loss-coeff values");
  app->add_option("--moe-router-score-function", m.score_function,
                  "softmax (the default) or sigmoid (the top-k's sigmoids over their sum)");
  app->add_flag("--moe-router-pre-softmax", m.pre_softmax,
                "The probabilities are the softmax over all experts' logits, not over the top-k ones");
  app->add_option("--moe-layer-freq", m.layer_freq,
                  "Which layers are MoE: N (every Nth from layer 0; default 1) or a pattern of 0/1 per layer, as "
                  "Megatron's: \"[1,0,1,1]\", \"([1]*3+[0])*2\"");
  app->add_option("--moe-token-dispatcher-type", m.dispatcher,
                  "allgather or alltoall: accepted, the same math at one rank (flex is refused)");
  app->add_option("--moe-router-dtype", m.router_dtype,
                  "fp32: accepted (the CPU backend's router is fp32 already); fp64 is refused");
  app->add_flag("--moe-grouped-gemm", m.grouped_gemm, "Accepted: the experts run one after another (same math)");
  app->add_flag("--moe-permute-fusion", m.permute_fusion, "Accepted: kernel fusion flag (same math)");
  app->add_option("--expert-model-parallel-size", m.expert_parallel,
                  "Expert-parallel ranks: each holds --num-experts / N experts of every MoE layer (CPU; N divides the "
                  "data x context ranks)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--expert-tensor-parallel-size", m.expert_tensor_parallel,
                  "Tensor ranks each expert is split over (default --tensor-model-parallel-size, the one value ptk "
                  "implements: fc1 column-parallel, fc2 row-parallel)")
      ->check(IntIn(1, kMaxSize));
  AddMoeBalanceFlags(app, f);  // moe_balance_flags.cpp
  AddSharedExpertFlags(app, f);
  app->add_option("--moe-expert-capacity-factor", m.capacity_factor,
                  "Token dropping: each expert takes at most ceil(tokens x topk / experts x F) of the router's "
                  "tokens (this rank's micro-batch), the rest get no expert output (default none: dropless; below "
                  "0: none)")
      ->check(cli::RealIn(-1e6, true, 1e6, true));
  app->add_option("--moe-token-drop-policy", m.drop_policy,
                  "With a capacity factor: probs (the default: each expert keeps its largest probabilities) or "
                  "position (the earliest tokens, sequence then micro-batch order)");
  app->add_flag("--moe-pad-expert-input-to-capacity", m.pad_to_capacity,
                "With a capacity factor: accepted, layout only (Megatron's padded rows have probability 0: no "
                "output, no gradient)");
}

namespace {
// Megatron's moe_freq_type pattern: a Python list expression of 0s and 1s ("[1,0]", "([1]*3+[0]*1)*2"):
// list literals, + (concatenation), * by a count, parentheses. Parsed here, not evaluated.
class PatternParser {
 public:
  explicit PatternParser(const std::string& s) : s_(s) {}
  bool Parse(std::vector<int>* out) { return Sum(out) && (Skip(), at_ == s_.size()); }

 private:
  void Skip() {
    while (at_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[at_]))) ++at_;
  }
  bool Eat(char c) { return Skip(), at_ < s_.size() && s_[at_] == c ? (++at_, true) : false; }
  bool Int(int64_t* v) {
    Skip();
    size_t begin = at_;
    while (at_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[at_])) && at_ - begin < 6) ++at_;
    if (at_ == begin) return false;
    return std::from_chars(s_.data() + begin, s_.data() + at_, *v).ec == std::errc();
  }
  bool Sum(std::vector<int>* out) {
    if (!Product(out)) return false;
    while (Eat('+')) {
      std::vector<int> more;
      if (!Product(&more)) return false;
      out->insert(out->end(), more.begin(), more.end());
    }
    return true;
  }
  bool Product(std::vector<int>* out) {
    if (!Atom(out)) return false;
    int64_t n = 0;
    while (Eat('*')) {
      if (!Int(&n) || out->size() * static_cast<size_t>(n) > 1'000'000) return false;
      std::vector<int> one = *out;
      out->clear();
      for (int64_t i = 0; i < n; ++i) out->insert(out->end(), one.begin(), one.end());
    }
    return true;
  }
  bool Atom(std::vector<int>* out) {
    if (Eat('(')) return Sum(out) && Eat(')');
    if (!Eat('[')) return false;
    int64_t v = 0;
    if (Eat(']')) return true;
    do {
      if (!Int(&v)) return false;
      out->push_back(static_cast<int>(v));
    } while (Eat(','));
    return Eat(']');
  }
  const std::string& s_;
  size_t at_ = 0;
};

absl::Status ResolveLayerFreq(const std::string& freq, int64_t layers, std::vector<int>* pattern) {
  const std::string flag = "--moe-layer-freq " + freq;
  if (freq.empty()) return absl::OkStatus();  // 1: every layer
  if (freq.find('[') == std::string::npos) {  // N: layer i is MoE when i % N == 0
    int64_t n = 0;
    const auto [end, ec] = std::from_chars(freq.data(), freq.data() + freq.size(), n);
    if (ec != std::errc() || end != freq.data() + freq.size() || n < 1)
      return UsageError(flag + ": a positive count or a list pattern (\"[1,0,1]\")");
    for (int64_t l = 0; l < layers; ++l) pattern->push_back(l % n == 0 ? 1 : 0);
    return absl::OkStatus();
  }
  if (!PatternParser(freq).Parse(pattern))
    return UsageError(flag +
                      ": ptk reads list patterns of 0 and 1 with +, * and parentheses (\"[1,0,1]\", "
                      "\"([1]*3+[0])*2\"), not other Python");
  if (static_cast<int64_t>(pattern->size()) != layers)
    return UsageError(fmt::format("{}: {} entries for --num-layers {} (one per layer)", flag, pattern->size(), layers));
  for (int v : *pattern)
    if (v != 0 && v != 1) return UsageError(fmt::format("{}: entry {}: 1 (MoE) or 0 (dense)", flag, v));
  return absl::OkStatus();
}
// The z-loss, the top-k scaling factor and group-limited routing, with Megatron's checks of them.
absl::Status ResolveRouterExtras(const TrainFlags::Moe& m, GPTConfig* model, std::vector<std::string>* notes) {
  model->moe_z_loss_coeff = m.z_loss_coeff.value_or(0.0);
  if (m.z_loss_coeff == 0.0)
    notes->push_back(
        "--moe-z-loss-coeff 0: no z-loss (Megatron computes a zero one and logs z_loss as 0/0, NaN; ptk logs none)");
  model->moe_router_topk_scaling_factor = m.topk_scaling_factor.value_or(0.0);
  if (m.topk_scaling_factor == 0.0)
    notes->push_back("--moe-router-topk-scaling-factor 0: no scaling (Megatron's `if scaling_factor` is false)");
  if (!m.group_topk) {
    if (m.num_groups)
      notes->push_back(
          fmt::format("--moe-router-num-groups {}: accepted, no effect without --moe-router-group-topk (as Megatron)",
                      *m.num_groups));
    return absl::OkStatus();
  }
  const std::string flags = fmt::format("--moe-router-group-topk {}", *m.group_topk);
  if (!m.num_groups) return UsageError(flags + " needs --moe-router-num-groups (as Megatron's TransformerConfig)");
  const int64_t E = model->num_experts, G = *m.num_groups, g = *m.group_topk, K = model->moe_router_topk;
  if (E % G != 0) return UsageError(fmt::format("--moe-router-num-groups {} does not divide --num-experts {}", G, E));
  if (g > G) return UsageError(fmt::format("{} is more than --moe-router-num-groups {}", flags, G));
  if (K < g || K > g * (E / G))
    return UsageError(fmt::format(
        "{} with --moe-router-topk {} and {} groups of {} experts: each chosen group's score is the sum of its "
        "topk / group-topk largest (at least 1, at most a group), and the chosen groups must hold topk experts "
        "(else Megatron picks masked -inf ones)",
        flags, K, G, E / G));
  model->moe_router_num_groups = G;
  model->moe_router_group_topk = g;
  return absl::OkStatus();
}
// Token dropping: --moe-expert-capacity-factor, --moe-token-drop-policy, --moe-pad-expert-input-to-capacity, with
// Megatron's TransformerConfig checks (a factor below 0 is None; padding needs a factor).
absl::Status ResolveCapacity(const TrainFlags::Moe& m, GPTConfig* model, std::vector<std::string>* notes) {
  if (!m.drop_policy.empty() && m.drop_policy != "probs" && m.drop_policy != "position")
    return UsageError("--moe-token-drop-policy " + m.drop_policy + ": probs or position (Megatron's choices)");
  const bool capacity = m.capacity_factor && *m.capacity_factor >= 0;
  if (m.capacity_factor && !capacity)
    notes->push_back(fmt::format("--moe-expert-capacity-factor {}: below 0, no capacity (dropless, as Megatron)",
                                 *m.capacity_factor));
  if (m.pad_to_capacity && !capacity)
    return UsageError(
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (0 or more; as Megatron's "
        "TransformerConfig)");
  if (!m.drop_policy.empty() && !capacity)
    notes->push_back("--moe-token-drop-policy " + m.drop_policy +
                     ": accepted, no effect without --moe-expert-capacity-factor (as Megatron)");
  if (m.pad_to_capacity)
    notes->push_back(
        "--moe-pad-expert-input-to-capacity: accepted, layout only (the padded rows have probability 0: no output, "
        "no gradient; ptk sends the kept rows alone)");
  model->moe_expert_capacity_factor = capacity ? *m.capacity_factor : -1;
  model->moe_token_drop_position = capacity && m.drop_policy == "position";
  return absl::OkStatus();
}
}  // namespace

absl::Status ResolveMoeFlags(const TrainFlags& f, GPTConfig* model, std::vector<std::string>* notes) {
  const TrainFlags::Moe& m = f.moe;
  if (m.num_experts == 0 && (m.shared_expert_size || m.shared_expert_gate || m.shared_expert_overlap))
    notes->push_back("--moe-shared-expert-*: accepted, no effect without --num-experts (as Megatron)");
  if (m.num_experts == 0) {
    if (m.topk || m.ffn || !m.aux_loss_coeff.empty() || m.pre_softmax || !m.layer_freq.empty() ||
        !m.router_dtype.empty() || m.z_loss_coeff || m.topk_scaling_factor || m.num_groups || m.group_topk ||
        m.enable_expert_bias || m.bias_update_rate)
      notes->push_back("--moe-* flags: accepted, no effect without --num-experts (as Megatron)");
    else if (m.capacity_factor || !m.drop_policy.empty() || m.pad_to_capacity)
      notes->push_back("--moe-* flags: accepted, no effect without --num-experts (as Megatron)");
    return absl::OkStatus();
  }
  if (m.score_function != "softmax" && m.score_function != "sigmoid")
    return UsageError("--moe-router-score-function " + m.score_function + ": softmax or sigmoid (Megatron's choices)");
  if (!m.router_dtype.empty() && m.router_dtype != "fp32")
    return UsageError("--moe-router-dtype " + m.router_dtype +
                      ": ptk's router computes in fp32 (--moe-router-dtype fp32, the CPU backend's precision)");
  if (!m.router_dtype.empty())
    notes->push_back("--moe-router-dtype fp32: accepted, the CPU backend's router is fp32 already");
  if (!m.dispatcher.empty() && m.dispatcher != "allgather" && m.dispatcher != "alltoall")
    return UsageError("--moe-token-dispatcher-type " + m.dispatcher +
                      ": ptk's dispatch is allgather's and alltoall's at one rank (flex needs DeepEP on GPUs)");
  model->num_experts = m.num_experts;
  model->moe_router_topk = m.topk.value_or(2);
  if (model->moe_router_topk > m.num_experts)
    return UsageError(
        fmt::format("--moe-router-topk {} is more than --num-experts {}", model->moe_router_topk, m.num_experts));
  model->moe_ffn_hidden_size = m.ffn.value_or(0);
  model->moe_router_pre_softmax = m.pre_softmax;
  model->moe_router_sigmoid = m.score_function == "sigmoid";
  if (m.pre_softmax && model->moe_router_sigmoid)
    notes->push_back(
        "--moe-router-pre-softmax: accepted, no effect with --moe-router-score-function sigmoid (as "
        "Megatron)");
  PTK_RETURN_IF_ERROR(ResolveMoeBalance(f, model, notes));  // the load-balancing types (moe_balance_flags.cpp)
  PTK_RETURN_IF_ERROR(ResolveRouterExtras(m, model, notes));
  PTK_RETURN_IF_ERROR(ResolveSharedExpertFlags(f, model, notes));
  PTK_RETURN_IF_ERROR(ResolveCapacity(m, model, notes));
  PTK_RETURN_IF_ERROR(ResolveLayerFreq(m.layer_freq, model->num_layers, &model->moe_layer_pattern));
  if (!model->moe_layer_pattern.empty() && model->moe_layers() == 0)
    return UsageError("--moe-layer-freq " + m.layer_freq +
                      ": no layer is MoE (give no --num-experts for a dense model)");
  if (!f.disable_bias_linear)
    return UsageError(
        "--num-experts without --disable-bias-linear: ptk's MoE layers have no biases (Megatron gives its router and "
        "experts biases under --add-bias-linear, its default); give --disable-bias-linear");
  for (const auto& [flag, on] : {std::pair{"--moe-token-dispatcher-type", !m.dispatcher.empty()},
                                 {"--moe-grouped-gemm", m.grouped_gemm},
                                 {"--moe-permute-fusion", m.permute_fusion}})
    if (on)
      notes->push_back(fmt::format("{}: accepted, speed only (the experts run one after another, same math)", flag));
  return absl::OkStatus();
}

namespace {
// --expert-model-parallel-size N above 1: what ptk's expert parallelism covers (the CPU model's MoE layers over
// data × context ranks, on each pipeline stage, split over the tensor ranks), every other combination refused naming
// both flags (tensor parallelism's own conditions: RefuseMoeTensorParallel).
absl::Status RefuseExpertParallel(const TrainFlags& f) {
  const int64_t ep = f.moe.expert_parallel;
  if (ep == 1) return absl::OkStatus();
  const std::string flag = fmt::format("--expert-model-parallel-size {}", ep);
  if (f.moe.num_experts % ep != 0)
    return UsageError(fmt::format("--num-experts {} is not divisible by {}: each expert rank holds as many experts",
                                  f.moe.num_experts, flag));
  if (f.options.sample.interval > 0)
    return UsageError(fmt::format(
        "{} with --sample-interval: expert parallelism is implemented for training and evaluation only", flag));
  return absl::OkStatus();
}
// --tensor-model-parallel-size above 1: Megatron's checks (sequence parallelism), the experts split over the tensor
// ranks (--expert-tensor-parallel-size the tensor size) and their widths divisible by it.
absl::Status RefuseMoeTensorParallel(const TrainFlags& f) {
  const int64_t tp = f.tensor_model_parallel_size, etp = f.moe.expert_tensor_parallel.value_or(tp);
  const std::string flags = fmt::format("--num-experts {} with --tensor-model-parallel-size {}", f.moe.num_experts, tp);
  if (etp != tp)
    return UsageError(fmt::format(
        "--expert-tensor-parallel-size {} with --tensor-model-parallel-size {}: ptk splits the experts over the "
        "tensor ranks (--expert-tensor-parallel-size equal to the tensor size) only",
        etp, tp));
  if (tp == 1) return absl::OkStatus();
  if (!f.options.backend.sequence_parallel)
    return UsageError(flags +
                      " needs --sequence-parallel (as Megatron: \"When using MoE and tensor parallelism, "
                      "sequence parallelism must be used.\")");
  const TrainFlags::Moe& m = f.moe;
  for (const auto& [flag, size] : {std::pair{"--moe-ffn-hidden-size", m.ffn.value_or(0)},
                                   {"--moe-shared-expert-intermediate-size", m.shared_expert_size.value_or(0)}})
    if (size % tp != 0)
      return UsageError(
          fmt::format("{} {} is not divisible by --tensor-model-parallel-size {}: each tensor rank "
                      "holds as many of each expert's columns",
                      flag, size, tp));
  return absl::OkStatus();
}
}  // namespace

absl::Status RefuseMoeParallelism(const TrainFlags& f) {
  if (f.moe.num_experts == 0) {
    if (f.moe.expert_parallel > 1)
      return UsageError(fmt::format("--expert-model-parallel-size {} without --num-experts", f.moe.expert_parallel));
    if (f.moe.expert_tensor_parallel && *f.moe.expert_tensor_parallel != f.tensor_model_parallel_size)
      return UsageError(
          fmt::format("--expert-tensor-parallel-size {} without --num-experts", *f.moe.expert_tensor_parallel));
    return absl::OkStatus();
  }
  PTK_RETURN_IF_ERROR(RefuseExpertParallel(f));
  PTK_RETURN_IF_ERROR(RefuseMoeBalanceParallelism(f));
  PTK_RETURN_IF_ERROR(RefuseMoeTensorParallel(f));
  return absl::OkStatus();
}

absl::Status RefuseMoeDevice(const TrainFlags& f, Device device) {
  if (f.moe.num_experts == 0 || device == Device::kCpu) return absl::OkStatus();
  if (f.moe.expert_parallel > 1)
    return UsageError(fmt::format(
        "--expert-model-parallel-size {} with --device cuda: expert parallelism runs on the CPU backend only",
        f.moe.expert_parallel));
  // The CUDA backend's MoE layers (trainer/cuda/moe_layer_cuda.h): dropless, data-parallel, aux_loss and z-loss,
  // seq_aux_loss, shared experts, group-limited routing (at most 64 groups), the expert bias.
  auto refuse = [&](const std::string& what) {
    return UsageError(fmt::format(
        "--num-experts {} with {} on --device cuda (or --bf16 / --fp16: the CUDA backend's): its mixture-of-experts "
        "layers are dropless and data-parallel only; train on the CPU (--device cpu) or drop it",
        f.moe.num_experts, what));
  };
  if (f.tensor_model_parallel_size > 1)
    return refuse(fmt::format("--tensor-model-parallel-size {}", f.tensor_model_parallel_size));
  if (f.pipeline_model_parallel_size > 1)
    return refuse(fmt::format("--pipeline-model-parallel-size {}", f.pipeline_model_parallel_size));
  if (f.context_parallel_size > 1) return refuse(fmt::format("--context-parallel-size {}", f.context_parallel_size));
  if (f.moe.group_topk && f.moe.num_groups && *f.moe.num_groups > 64)
    return refuse(
        fmt::format("--moe-router-num-groups {} (the CUDA router takes at most 64 groups)", *f.moe.num_groups));
  for (const std::string& type : f.moe.load_balancing_type)
    if (type != "aux_loss" && type != "seq_aux_loss" && type != "none")
      return refuse(fmt::format("--moe-router-load-balancing-type {}", type));
  if (f.moe.capacity_factor && *f.moe.capacity_factor >= 0)
    return refuse(fmt::format("--moe-expert-capacity-factor {} (token dropping)", *f.moe.capacity_factor));
  return absl::OkStatus();
}

// Megatron's list patterns, for the other layer-pattern flags (--window-attn-skip-freq).
bool train_flags::ParseLayerPattern(const std::string& text, std::vector<int>* out) {
  return PatternParser(text).Parse(out);
}

}  // namespace ptk
