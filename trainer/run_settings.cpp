// The run's settings under their flag names: the ranks' start-up handshake, the resume report.
#include "trainer/run_settings.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <iterator>
#include <map>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/status.h"

namespace ptk {
namespace {

std::string Joined(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& x : v) out += (out.empty() ? "" : " ") + x;
  return out;
}

// A data path as resolved files: each prefix whose .bin exists as its real path (symbolic links
// and the working directory resolved), weights and anything else as given.
std::string Resolved(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& x : v) {
    char buf[PATH_MAX];
    std::string word = x;
    if (::realpath((x + ".bin").c_str(), buf) != nullptr) {
      word = buf;
      word.resize(word.size() - 4);
    }
    out += (out.empty() ? "" : " ") + word;
  }
  return out;
}

// The data flags whose resolved files a resume compares (where both runs recorded them).
constexpr const char* kDataPathFlags[] = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"};
std::string ResolvedName(const std::string& flag) { return flag + " (resolved)"; }

std::string Serialize(const Settings& settings) {
  std::string out;
  for (const auto& [name, value] : settings) out += name + '\t' + value + '\n';
  return out;
}
std::map<std::string, std::string> Deserialize(const std::string& text) {
  std::map<std::string, std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t tab = text.find('\t', pos), nl = text.find('\n', pos);
    if (tab == std::string::npos || nl == std::string::npos || tab > nl) break;
    out[text.substr(pos, tab - pos)] = text.substr(tab + 1, nl - tab - 1);
    pos = nl + 1;
  }
  return out;
}
std::string Shown(const std::string& flag, const std::string& value) {
  return value.empty() ? fmt::format("no {}", flag) : fmt::format("{} {}", flag, value);
}

// `root`'s bytes to every rank (their size first: the others do not know it).
absl::StatusOr<std::string> BroadcastText(Communicator* comm, const std::string& text, int root) {
  int64_t len = comm->rank() == root ? static_cast<int64_t>(text.size()) : 0;
  PTK_RETURN_IF_ERROR(comm->Broadcast(&len, sizeof len, root));
  if (len < 0 || len > (int64_t{1} << 26)) return absl::InternalError("rank handshake: implausible length");
  std::string out = comm->rank() == root ? text : std::string(static_cast<size_t>(len), '\0');
  if (len > 0) PTK_RETURN_IF_ERROR(comm->Broadcast(out.data(), len, root));
  return out;
}

}  // namespace

namespace {

std::string Num(double v) { return fmt::format("{}", v); }
std::string Opt(const std::optional<double>& v) { return v ? Num(*v) : std::string("(default)"); }

// The model's settings.
Settings ModelSettings(const GPTConfig& m, int64_t make_vocab_size_divisible_by) {
  auto num = Num;
  return {
      {"--num-layers", std::to_string(m.num_layers)},
      {"--hidden-size", std::to_string(m.hidden_size)},
      {"--num-attention-heads", std::to_string(m.num_attention_heads)},
      {"--ffn-hidden-size", std::to_string(m.ffn_hidden_size)},
      {"--seq-length", std::to_string(m.seq_length)},
      {"--max-position-embeddings", std::to_string(m.max_position_embeddings)},
      {"--vocab-size", std::to_string(m.vocab_size)},
      {"--make-vocab-size-divisible-by (padded vocabulary)", std::to_string(m.padded_vocab_size)},
      {"--make-vocab-size-divisible-by", std::to_string(make_vocab_size_divisible_by)},
      {"--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights ? "on" : "off"},
      {"--layernorm-epsilon", num(m.layernorm_epsilon)},
      {"--normalization", m.normalization == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm"},
      {"--position-embedding-type", m.position_embedding == PositionEmbedding::kRope   ? "rope"
                                    : m.position_embedding == PositionEmbedding::kNone ? "none"
                                                                                       : "learned_absolute"},
      {"--rotary-base", num(m.rotary_base)},
      {"--rotary-percent", num(m.rotary_percent)},
      {"--use-rope-scaling", m.use_rope_scaling ? "on" : "off"},
      {"--rope-scaling-factor", m.use_rope_scaling ? num(m.rope_scaling_factor) : ""},
      {"--rotary-seq-len-interpolation-factor",
       m.rotary_seq_len_interpolation_factor > 0 ? num(m.rotary_seq_len_interpolation_factor) : ""},
      {"--rotary-interleaved", m.rotary_interleaved ? "on" : "off"},
      {"--swiglu", m.swiglu ? "on" : "off"},
      {"--num-query-groups", std::to_string(m.query_groups())},
      {"--kv-channels", std::to_string(m.head_dim())},
      {"--disable-bias-linear", m.add_bias_linear ? "off" : "on"},
      {"--add-qkv-bias", m.add_qkv_bias ? "on" : "off"},
      {"--qk-layernorm", m.qk_layernorm ? "on" : "off"},
      {"--qk-l2-norm", m.qk_l2_norm ? "on" : "off"},
      {"--attention-output-gate", m.attention_output_gate ? "on" : "off"},
      {"--squared-relu", m.squared_relu ? "on" : "off"},
      {"--no-bias-gelu-fusion", m.gelu_exact ? "on (the exact erf GELU)" : "off"},
      {"--apply-layernorm-1p", m.apply_layernorm_1p ? "on" : "off"},
      {"--hidden-dropout", num(m.hidden_dropout)},
      {"--attention-dropout", num(m.attention_dropout)},
      {"--init-method-std", num(m.init_method_std)},
      {"--init-method-xavier-uniform", m.init_method_xavier_uniform ? "on" : "off"},
      {"--embedding-init-method-std", m.embedding_init_method_std > 0 ? num(m.embedding_init_method_std) : ""},
      {"--recompute-activations", m.recompute_activations ? "on" : "off"},
  };
}

// Mixture of experts' (only with experts: a dense run's settings read as before).
Settings MoeSettingsOf(const GPTConfig& m) {
  std::string layers;
  for (int64_t l = 0; l < m.num_layers; ++l) layers += fmt::format("{}{}", l ? "," : "[", m.moe_layer(l) ? 1 : 0);
  return {
      {"--num-experts", std::to_string(m.num_experts)},
      {"--moe-router-topk", std::to_string(m.moe_router_topk)},
      {"--moe-ffn-hidden-size", std::to_string(m.moe_ffn())},
      {"--moe-router-pre-softmax", m.moe_router_pre_softmax ? "on" : "off"},
      {"--moe-router-score-function", m.moe_router_sigmoid ? "sigmoid" : "softmax"},
      {"--moe-aux-loss-coeff", Num(m.moe_aux_loss_coeff)},
      {"--moe-layer-freq", layers + "]"},
      {"--moe-z-loss-coeff", m.moe_z_loss_coeff > 0 ? Num(m.moe_z_loss_coeff) : ""},
      {"--moe-router-topk-scaling-factor",
       m.moe_router_topk_scaling_factor > 0 ? Num(m.moe_router_topk_scaling_factor) : ""},
      {"--moe-router-num-groups", m.moe_router_group_topk > 0 ? std::to_string(m.moe_router_num_groups) : ""},
      {"--moe-router-group-topk", m.moe_router_group_topk > 0 ? std::to_string(m.moe_router_group_topk) : ""},
      {"--moe-router-load-balancing-type seq_aux_loss",
       m.moe_seq_aux_loss_coeff > 0 ? Num(m.moe_seq_aux_loss_coeff) : ""},
      {"--moe-router-load-balancing-type global_aux_loss",
       m.moe_global_aux_loss_coeff > 0 ? Num(m.moe_global_aux_loss_coeff) : ""},
      {"--moe-router-enable-expert-bias", m.moe_router_enable_expert_bias ? "on" : ""},
      {"--moe-router-bias-update-rate", m.moe_router_enable_expert_bias ? Num(m.moe_router_bias_update_rate) : ""},
      {"--moe-shared-expert-intermediate-size",
       m.moe_shared_expert_intermediate_size > 0 ? std::to_string(m.moe_shared_expert_intermediate_size) : ""},
      {"--moe-shared-expert-gate", m.moe_shared_expert_gate ? "on" : "off"},
      {"--moe-expert-capacity-factor", m.moe_expert_capacity_factor >= 0 ? Num(m.moe_expert_capacity_factor) : ""},
      {"--moe-token-drop-policy",
       m.moe_expert_capacity_factor >= 0 ? (m.moe_token_drop_position ? "position" : "probs") : ""},
  };
}

// Multi-latent attention's (only with it: another run's settings read as before).
Settings MlaSettingsOf(const GPTConfig& m) {
  return {
      {"--multi-latent-attention", "on"},
      {"--q-lora-rank", m.q_lora_rank > 0 ? std::to_string(m.q_lora_rank) : "none"},
      {"--kv-lora-rank", std::to_string(m.kv_lora_rank)},
      {"--qk-head-dim", std::to_string(m.qk_head_dim)},
      {"--qk-pos-emb-head-dim", std::to_string(m.qk_pos_emb_head_dim)},
      {"--v-head-dim", std::to_string(m.v_head_dim)},
      {"--rope-type", m.mla_yarn ? "yarn" : "rope"},
      {"--rotary-scaling-factor", Num(m.rotary_scaling_factor)},
      {"--mscale", Num(m.mscale)},
      {"--mscale-all-dim", Num(m.mscale_all_dim)},
  };
}

// The parallel layout's and the batch's.
Settings LayoutAndBatchSettings(const TrainOptions& o, int64_t gbs) {
  return {
      {"--tensor-model-parallel-size", std::to_string(o.tensor_model_parallel_size)},
      {"--sequence-parallel", o.backend.sequence_parallel ? "on" : "off"},
      {"--pipeline-model-parallel-size", std::to_string(std::max<size_t>(1, o.pipeline_stage_layers.size()))},
      {"--context-parallel-size", std::to_string(o.context_parallel_size)},
      {"--expert-model-parallel-size", std::to_string(o.expert_model_parallel_size)},
      // The first and last stage's layers as the run has them (given or split evenly).
      {"--decoder-first-pipeline-num-layers",
       o.pipeline_stage_layers.size() > 1 ? std::to_string(o.pipeline_stage_layers.front()) : ""},
      {"--decoder-last-pipeline-num-layers",
       o.pipeline_stage_layers.size() > 1 ? std::to_string(o.pipeline_stage_layers.back()) : ""},
      {"--num-virtual-stages-per-pipeline-rank",
       o.pipeline_virtual_size > 1 ? std::to_string(o.pipeline_virtual_size) : ""},
      // The interleaved schedule's micro-batch groups as run (Megatron's default: the pipeline size);
      // another on resume orders the same passes otherwise, with the same results.
      {"--microbatch-group-size-per-virtual-pipeline-stage",
       o.pipeline_virtual_size > 1
           ? std::to_string(o.pipeline_microbatch_group_size > 0
                                ? o.pipeline_microbatch_group_size
                                : static_cast<int>(std::max<size_t>(1, o.pipeline_stage_layers.size())))
           : ""},
      {"--micro-batch-size", std::to_string(o.micro_batch_size)},
      {"--global-batch-size", std::to_string(gbs)},
      {"--decrease-batch-size-if-needed", o.decrease_batch_size_if_needed ? "on" : "off"},
      {"--phase-transition-iterations", Joined([&] {
         std::vector<std::string> r;
         for (int64_t x : o.phase_transition_iterations) r.push_back(std::to_string(x));
         return r;
       }())},
      {"--rampup-batch-size", Joined([&] {
         std::vector<std::string> r;
         for (int64_t x : o.rampup_batch_size) r.push_back(std::to_string(x));
         return r;
       }())},
      {"--train-iters", std::to_string(o.train_iters)},
      {"--train-samples", std::to_string(o.train_samples)},
  };
}

// The learning-rate and weight-decay schedule's and AdamW's.
Settings ScheduleSettings(const TrainOptions& o) {
  auto num = Num;
  auto opt = Opt;
  return {
      {"--lr", num(o.schedule.max_lr)},
      {"--min-lr", num(o.schedule.min_lr)},
      {"--lr-warmup-init", num(o.schedule.init_lr)},
      {"--lr-decay-style", o.schedule.decay_style},
      {"--lr-decay-iters", std::to_string(o.schedule_options.lr_decay_iters)},
      {"--lr-decay-samples", std::to_string(o.schedule_options.lr_decay_samples)},
      {"--lr-warmup-iters", std::to_string(o.schedule_options.lr_warmup_iters)},
      {"--lr-warmup-samples", std::to_string(o.schedule_options.lr_warmup_samples)},
      {"--lr-warmup-fraction", opt(o.schedule_options.lr_warmup_fraction)},
      {"--lr-wsd-decay-style", o.schedule.wsd_decay_style},
      {"--lr-wsd-decay-iters", std::to_string(o.schedule_options.lr_wsd_decay_iters)},
      {"--lr-wsd-decay-samples", std::to_string(o.schedule_options.lr_wsd_decay_samples)},
      {"--weight-decay", num(o.schedule_options.weight_decay)},
      {"--start-weight-decay", opt(o.schedule_options.start_weight_decay)},
      {"--end-weight-decay", opt(o.schedule_options.end_weight_decay)},
      {"--weight-decay-incr-style", o.schedule.wd_incr_style},
      {"--decoupled-lr", opt(o.schedule.decoupled_lr)},
      {"--decoupled-min-lr", opt(o.schedule.decoupled_min_lr)},
      {"--apply-wd-to-qk-layernorm", o.optimizer.apply_wd_to_qk_layernorm ? "on" : "off"},
      {"--adam-beta1", num(o.optimizer.adam_beta1)},
      {"--adam-beta2", num(o.optimizer.adam_beta2)},
      {"--adam-eps", num(o.optimizer.adam_eps)},
      {"--clip-grad", num(o.optimizer.clip_grad)},
  };
}

// The data's, the checkpoints', the exit conditions' and the backend's.
Settings DataAndRunSettings(const TrainOptions& o) {
  auto num = Num;
  return {
      {"--data-path", Joined(o.data.data_path)},
      {"--train-data-path", Joined(o.data.per_split_data_path[0])},
      {"--valid-data-path", Joined(o.data.per_split_data_path[1])},
      {"--test-data-path", Joined(o.data.per_split_data_path[2])},
      {ResolvedName("--data-path"), Resolved(o.data.data_path)},
      {ResolvedName("--train-data-path"), Resolved(o.data.per_split_data_path[0])},
      {ResolvedName("--valid-data-path"), Resolved(o.data.per_split_data_path[1])},
      {ResolvedName("--test-data-path"), Resolved(o.data.per_split_data_path[2])},
      {"--split", o.data.split},
      {"--mock-data", o.mock_data ? "on" : "off"},
      {"--seed", std::to_string(o.seed)},
      {"--eod-mask-loss", o.eod_mask_loss ? "on" : "off"},
      {"--calculate-per-token-loss", o.optimizer.calculate_per_token_loss ? "on" : "off"},
      {"--reset-position-ids", o.reset_position_ids ? "on" : "off"},
      {"--eval-interval", std::to_string(o.eval_interval)},
      {"--eval-iters", std::to_string(o.eval_iters)},
      {"--save", o.save},
      {"--load", o.load},
      {"--save-interval", std::to_string(o.save_interval)},
      {"--exit-interval", std::to_string(o.exit_interval)},
      // Every rank takes part in each save: they must save alike.
      {"--non-persistent-save-interval", std::to_string(o.non_persistent_save_interval)},
      {"--non-persistent-global-ckpt-dir", o.non_persistent_dir},
      {"--save-retain-interval", std::to_string(o.save_retain_interval)},
      {"--exit-duration-in-mins", num(o.exit_duration_in_mins)},
      // A rank that skips an iteration the others train would leave their collectives waiting. As a set: Megatron
      // asks only whether the counter is in the list.
      {"--iterations-to-skip", Joined([&] {
         std::vector<int64_t> skip = o.iterations_to_skip;
         std::sort(skip.begin(), skip.end());
         skip.erase(std::unique(skip.begin(), skip.end()), skip.end());
         std::vector<std::string> r;
         for (int64_t x : skip) r.push_back(std::to_string(x));
         return r;
       }())},
      {"--no-load-optim", o.no_load_optim ? "on" : "off"},
      {"--no-load-rng", o.no_load_rng ? "on" : "off"},
      {"--finetune", o.finetune ? "on" : "off"},
      {"--exit-on-missing-checkpoint", o.exit_on_missing_checkpoint ? "on" : "off"},
      {"--pretrained-checkpoint", o.pretrained_checkpoint},
      {"--ckpt-step", o.ckpt_step ? std::to_string(*o.ckpt_step) : "none"},
      {"--override-opt_param-scheduler", o.scheduler_on_load == SchedulerOnLoad::kOverride ? "on" : "off"},
      {"--use-checkpoint-opt_param-scheduler", o.scheduler_on_load == SchedulerOnLoad::kUseCheckpoint ? "on" : "off"},
      {"--check-for-nan-in-loss-and-grad", o.check_for_nan_in_loss_and_grad ? "on" : "off"},
      {"--use-distributed-optimizer", o.use_distributed_optimizer ? "on" : "off"},
      {"--overlap-grad-reduce", o.optimizer.overlap_grad_reduce ? "on" : "off"},
      {"--ddp-bucket-size", std::to_string(o.optimizer.ddp_bucket_size)},
      {"--distributed-backend", o.distributed_backend},
      {"--device", std::string(DeviceName(o.backend.device))},
      {"--bf16/--fp16", std::string(PrecisionName(o.backend.precision))},
      {"--deterministic-mode", o.backend.deterministic ? "on" : "off"},
      {"--loss-scale (fp16)", o.loss_scale.dynamic ? "dynamic" : num(o.loss_scale.scale)},
      {"--initial-loss-scale", num(o.loss_scale.scale)},
      {"--min-loss-scale", num(o.loss_scale.min_scale)},
      {"--loss-scale-window", std::to_string(o.loss_scale.window)},
      {"--hysteresis", std::to_string(o.loss_scale.hysteresis)},
      // The timers' all-gather takes the names of the level: every rank must make the same one.
      {"--timing-log-level", std::to_string(o.timing_log_level)},
      // So do the level-1 timers' barriers: a rank that skips them would leave the others waiting.
      {"--no-barrier-with-level-1-timing", o.barrier_with_l1_time ? "off" : "on"},
  };
}

}  // namespace

Settings MoeRunSettings(const GPTConfig& m) { return MoeSettingsOf(m); }
Settings MlaRunSettings(const GPTConfig& m) { return MlaSettingsOf(m); }

// What every rank must agree on (checked at start-up) and what a checkpoint records of its run:
// each setting under its Megatron flag name, resolved (the global batch size as used).
Settings RunSettings(const TrainOptions& o, int64_t gbs) {
  Settings all = ModelSettings(o.model, o.make_vocab_size_divisible_by);
  if (o.model.moe()) {
    const Settings moe = MoeSettingsOf(o.model);
    all.insert(all.end(), moe.begin(), moe.end());
  }
  if (o.model.mla()) {
    const Settings mla = MlaSettingsOf(o.model);
    all.insert(all.end(), mla.begin(), mla.end());
  }
  if (o.model.mtp_num_layers > 0) {  // multi-token prediction's (only with it: another run's read as before)
    all.push_back({"--mtp-num-layers", std::to_string(o.model.mtp_num_layers)});
    all.push_back({"--mtp-loss-scaling-factor", Num(o.model.mtp_loss_scaling_factor)});
  }
  if (o.model.window_left >= 0) {  // sliding window attention's (only with it)
    all.push_back({"--window-size", fmt::format("{},0", o.model.window_left)});
    all.push_back({"--window-attn-skip-freq", o.model.WindowSkipFreqSetting()});
  }
  if (o.model.softmax_sink()) all.push_back({"--softmax-type", o.model.softmax_type});
  for (Settings part : {LayoutAndBatchSettings(o, gbs), ScheduleSettings(o), DataAndRunSettings(o)})
    all.insert(all.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
  return all;
}

namespace {
// Resolved paths may differ between nodes that mount the same files elsewhere: the paths as given
// are compared.
Settings Agreed(const Settings& all) {
  Settings mine;
  for (const auto& kv : all)
    if (!kv.first.ends_with(" (resolved)")) mine.push_back(kv);
  return mine;
}
}  // namespace

std::string AgreedSettingsText(const Settings& all) { return Serialize(Agreed(all)); }

absl::Status CheckRanksAgree(Communicator* comm, const Settings& all) {
  if (comm->size() == 1) return absl::OkStatus();
  const Settings mine = Agreed(all);
  const int rank = comm->rank(), size = comm->size();
  // Rank 0's settings to every rank; each finds the first of them it differs in (index + 1).
  PTK_ASSIGN_OR_RETURN(std::string root_text, BroadcastText(comm, Serialize(mine), 0));
  const std::map<std::string, std::string> root = Deserialize(root_text);
  std::vector<std::string> root_order;
  for (size_t pos = 0; pos < root_text.size();) {
    const size_t tab = root_text.find('\t', pos), nl = root_text.find('\n', pos);
    if (tab == std::string::npos || nl == std::string::npos) break;
    root_order.push_back(root_text.substr(pos, tab - pos));
    pos = nl + 1;
  }
  std::map<std::string, std::string> own(mine.begin(), mine.end());
  std::vector<double> first_diff(static_cast<size_t>(size), 0.0);
  for (size_t i = 0; i < root_order.size(); ++i) {
    auto it = own.find(root_order[i]);
    if (it == own.end() || it->second != root.at(root_order[i])) {
      first_diff[static_cast<size_t>(rank)] = static_cast<double>(i + 1);
      break;
    }
  }
  if (first_diff[static_cast<size_t>(rank)] == 0 && own.size() != root.size())
    first_diff[static_cast<size_t>(rank)] = static_cast<double>(root_order.size() + 1);
  PTK_RETURN_IF_ERROR(comm->AllReduceSum(first_diff.data(), size));
  int differing = 0, first = -1;
  for (int r = 0; r < size; ++r)
    if (first_diff[static_cast<size_t>(r)] != 0) {
      ++differing;
      if (first < 0) first = r;
    }
  if (first < 0) return absl::OkStatus();
  // The first differing rank's own settings, so that every rank can name both values.
  PTK_ASSIGN_OR_RETURN(std::string other_text, BroadcastText(comm, Serialize(mine), first));
  const std::map<std::string, std::string> other = Deserialize(other_text);
  const size_t index = static_cast<size_t>(first_diff[static_cast<size_t>(first)]) - 1;
  const std::string others = differing > 1 ? fmt::format(" ({} ranks differ from rank 0)", differing) : "";
  if (index >= root_order.size())
    return UsageError(fmt::format(
        "rank {} runs another ptk-train version than rank 0 (their settings differ in kind){}", first, others));
  const std::string& flag = root_order[index];
  auto it = other.find(flag);
  return UsageError(fmt::format("rank {} was started with {}, rank 0 with {}: every rank needs the same flags{}", first,
                                it == other.end() ? "(no such setting)" : Shown(flag, it->second),
                                Shown(flag, root.at(flag)), others));
}

absl::StatusOr<SchedulerConfig> ResumedSchedule(const TrainState& loaded, const SchedulerConfig& here,
                                                SchedulerOnLoad mode, int64_t samples_per_iteration, bool lead) {
  if (!loaded.scheduler) {
    if (mode == SchedulerOnLoad::kUseCheckpoint && lead)
      log::Warning(
          "--use-checkpoint-opt_param-scheduler: the checkpoint of iteration {} does not record its schedule (an "
          "earlier ptk wrote it); going on with this command line's",
          loaded.iteration);
    return here;
  }
  std::vector<std::string> notes;
  PTK_ASSIGN_OR_RETURN(SchedulerConfig c, ResolveResumedScheduler(here, *loaded.scheduler, mode, loaded.iteration,
                                                                  samples_per_iteration, &notes));
  for (const std::string& n : notes)
    if (lead) log::Info("{}", n);
  return c;
}

void ReportResumeChanges(const Settings& saved, const Settings& now, const TrainState& loaded, bool no_load_rng) {
  if (saved.empty()) return;  // a checkpoint from before settings were recorded
  const std::map<std::string, std::string> before(saved.begin(), saved.end());
  const std::map<std::string, std::string> after(now.begin(), now.end());
  const std::string data = fmt::format(
      "the {} samples consumed so far count against another sample order: the samples read from here are not the "
      "ones the saved run would have read next",
      loaded.consumed_train_samples);
  for (const auto& [flag, value] : now) {
    std::string why;
    if (flag == "--data-path" || flag == "--train-data-path" || flag == "--valid-data-path" ||
        flag == "--test-data-path" || flag == "--split" || flag == "--mock-data") {
      why = data;
    } else if (flag == "--seed") {
      why = no_load_rng ? "the data order and dropout follow the new seed (--no-load-rng)"
                        : fmt::format(
                              "the data order follows the new seed from here, while dropout keeps the checkpoint's "
                              "seed {} (--no-load-rng makes dropout follow the new one too)",
                              loaded.seed);
    } else if (flag == "--seq-length") {
      why = fmt::format(
          "the {} samples consumed so far were {} tokens long: the position in the data no longer "
          "matches the saved run's",
          loaded.consumed_train_samples, before.count(flag) ? before.at(flag) : "?");
    } else if (flag == "--tensor-model-parallel-size" || flag == "--pipeline-model-parallel-size" ||
               flag == "--num-virtual-stages-per-pipeline-rank") {
      auto it = before.find(flag);
      if (it != before.end() && it->second != value)
        log::Info(
            "resuming with {} (the checkpoint of iteration {} was saved with {}): the saved ranks' slices of the "
            "weights and AdamW moments are put together and cut into this run's",
            Shown(flag, value), loaded.iteration, Shown(flag, it->second));
      continue;
    } else if (flag == "--context-parallel-size") {
      auto it = before.find(flag);
      if (it != before.end() && it->second != value)
        log::Info(
            "resuming with {} (the checkpoint of iteration {} was saved with {}): the checkpoint holds the model, "
            "whatever the context split; each context rank now holds another share of every sample's positions",
            Shown(flag, value), loaded.iteration, Shown(flag, it->second));
      continue;
    } else if (flag == "--device" || flag == "--bf16/--fp16") {
      auto it = before.find(flag);
      if (it != before.end() && it->second != value)
        log::Info(
            "resuming with {} (the checkpoint of iteration {} was saved with {}): the fp32 master weights and AdamW "
            "moments carry over exactly; the arithmetic from here is this backend's",
            Shown(flag, value), loaded.iteration, Shown(flag, it->second));
      continue;
    } else if (flag == "--apply-wd-to-qk-layernorm" && after.count("--qk-layernorm") &&
               after.at("--qk-layernorm") == "on") {
      why = value == "on" ? "the query and key norms decay from here (their AdamW moments carry over)"
                          : "the query and key norms no longer decay from here (their AdamW moments carry over)";
    } else if (flag == "--global-batch-size") {
      why = fmt::format(
          "iterations now take {} samples; the learning-rate schedule (in samples) and the data position go on from "
          "the {} samples consumed",
          value, loaded.consumed_train_samples);
    } else {
      continue;
    }
    auto it = before.find(flag);
    if (it == before.end() || it->second == value) continue;
    // The same files named another way (a relative path from another working directory, a link).
    if (std::find(std::begin(kDataPathFlags), std::end(kDataPathFlags), flag) != std::end(kDataPathFlags)) {
      auto was = before.find(ResolvedName(flag)), is = after.find(ResolvedName(flag));
      if (was != before.end() && is != after.end() && was->second == is->second) continue;
    }
    log::Warning("resuming with {} (the checkpoint of iteration {} was saved with {}): {}", Shown(flag, value),
                 loaded.iteration, Shown(flag, it->second), why);
  }
}

}  // namespace ptk
