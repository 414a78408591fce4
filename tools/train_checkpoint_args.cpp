// ptk-train --use-checkpoint-args: the model's flags that the command line leaves out, taken from
// the settings of --load's latest checkpoint (Megatron's load_args_from_checkpoint).
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_retention.h"
#include "trainer/parallel_layout.h"

namespace ptk {
namespace {

using train_flags::kCheckpointForcedFlags;
using train_flags::kCheckpointModelFlags;

// The model's on/off flags (a bare flag: "on" when given), as the checkpoint's settings write them.
constexpr const char* kSwitches[] = {
    "--untie-embeddings-and-output-weights",
    "--use-rope-scaling",
    "--rotary-interleaved",
    "--swiglu",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--qk-layernorm",
    "--qk-l2-norm",
    "--attention-output-gate",
    "--squared-relu",
    "--apply-layernorm-1p",
    "--moe-router-pre-softmax",
    "--multi-latent-attention",
    "--moe-shared-expert-gate",
};
bool IsSwitch(const std::string& flag) {
  for (const char* s : kSwitches)
    if (flag == s) return true;
  return false;
}
bool IsForced(const std::string& flag) {
  for (const char* s : kCheckpointForcedFlags)
    if (flag == s) return true;
  return false;
}
// Multi-latent attention's (recorded only by an MLA model's checkpoint).
bool IsMlaFlag(const std::string& flag) {
  for (const char* s :
       {"--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
        "--v-head-dim", "--rope-type", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim"})
    if (flag == s) return true;
  return false;
}
// The flags ptk-train requires without --use-checkpoint-args (which lifts the requirement).
bool IsRequired(const std::string& flag) {
  return flag == "--num-layers" || flag == "--hidden-size" || flag == "--num-attention-heads" || flag == "--seq-length";
}
bool Given(const CLI::App& app, const char* name) { return app.get_option(name)->count() > 0; }

// The value of `flag` the command line gives, in the checkpoint's spelling; nullopt when not given.
// The position embedding and the query groups are given by any of Megatron's spellings of them.
std::optional<std::string> GivenValue(const CLI::App& app, const TrainFlags& f, const std::string& flag) {
  if (flag == "--position-embedding-type") {
    if (!Given(app, "--position-embedding-type") && !Given(app, "--use-rotary-position-embeddings") &&
        !Given(app, "--no-position-embedding"))
      return std::nullopt;
    std::string type = f.use_rotary_position_embeddings ? "rope" : f.position_embedding_type;
    if (f.no_position_embedding && type != "rope") type = "none";
    return type;
  }
  if (flag == "--num-query-groups") {
    if (!Given(app, "--group-query-attention") && !Given(app, "--num-query-groups")) return std::nullopt;
    return std::to_string(f.group_query_attention ? f.num_query_groups : f.options.model.num_attention_heads);
  }
  const CLI::Option* opt = app.get_option(flag);
  if (opt->count() == 0) return std::nullopt;
  if (flag == "--window-size" || flag == "--window-attn-skip-freq")  // as the checkpoint writes them
    return CanonicalAttentionVariantValue(flag, opt->as<std::string>(), f.options.model.num_layers,
                                          f.mtp.num_layers.value_or(0));
  return IsSwitch(flag) ? std::string("on") : opt->as<std::string>();
}

// --encoder-seq-length N is --seq-length N, as Megatron's validate_args takes it (args.seq_length =
// args.encoder_seq_length when --seq-length is not given); both given fail its assert, refused here.
// With --use-checkpoint-args the checkpoint's --seq-length would replace it unseen: refused too.
absl::Status ApplyEncoderSeqLength(const CLI::App& app, TrainFlags* f) {
  if (!f->encoder_seq_length) return absl::OkStatus();
  if (Given(app, "--seq-length"))
    return UsageError("--seq-length and --encoder-seq-length: give one (Megatron's other name for --seq-length)");
  if (f->use_checkpoint_args)
    return UsageError(
        "--encoder-seq-length with --use-checkpoint-args: give --seq-length (the checkpoint's is "
        "compared with it)");
  f->options.model.seq_length = *f->encoder_seq_length;
  return absl::OkStatus();
}

// The same value: the same text, or the same number written otherwise (1e-5, 0.00001).
bool SameValue(const std::string& a, const std::string& b) {
  if (a == b) return true;
  char *ea = nullptr, *eb = nullptr;
  const double x = std::strtod(a.c_str(), &ea), y = std::strtod(b.c_str(), &eb);
  return ea != a.c_str() && *ea == '\0' && eb != b.c_str() && *eb == '\0' && x == y;
}
std::string Shown(const std::string& value) { return value.empty() ? "none" : value; }

// The checkpoint's `value` of `flag` into the run's flags; a value no flag could have given is data
// loss in the checkpoint at `load`.
absl::Status TakeCheckpointValue(const std::string& flag, const std::string& value, const std::string& load,
                                 TrainFlags* f) {
  GPTConfig* m = &f->options.model;
  auto bad = [&] { return absl::DataLossError(fmt::format("{}: checkpoint records {} {:?}", load, flag, value)); };
  auto as_int = [&](int64_t* out) -> absl::Status {
    char* end = nullptr;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || v < 1) return bad();
    *out = v;
    return absl::OkStatus();
  };
  auto as_real = [&](double* out) -> absl::Status {
    if (value.empty() && flag == "--rotary-seq-len-interpolation-factor") return (*out = 0, absl::OkStatus());
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !std::isfinite(v)) return bad();
    *out = v;
    return absl::OkStatus();
  };
  if (IsSwitch(flag) && value != "on" && value != "off") return bad();
  const bool on = value == "on";
  const std::map<std::string, int64_t*> ints = {{"--num-layers", &m->num_layers},
                                                {"--hidden-size", &m->hidden_size},
                                                {"--num-attention-heads", &m->num_attention_heads},
                                                {"--ffn-hidden-size", &m->ffn_hidden_size},
                                                {"--seq-length", &m->seq_length},
                                                {"--max-position-embeddings", &m->max_position_embeddings},
                                                {"--vocab-size", &m->vocab_size},
                                                {"--kv-channels", &f->kv_channels},
                                                {"--num-query-groups", &f->num_query_groups},
                                                {"--num-experts", &f->moe.num_experts},
                                                {"--kv-lora-rank", &f->mla.kv_lora_rank},
                                                {"--qk-head-dim", &f->mla.qk_head_dim},
                                                {"--qk-pos-emb-head-dim", &f->mla.qk_pos_emb_head_dim},
                                                {"--v-head-dim", &f->mla.v_head_dim}};
  const std::map<std::string, double*> reals = {
      {"--layernorm-epsilon", &m->layernorm_epsilon},
      {"--hidden-dropout", &m->hidden_dropout},
      {"--attention-dropout", &m->attention_dropout},
      {"--rotary-base", &m->rotary_base},
      {"--rotary-percent", &m->rotary_percent},
      {"--rope-scaling-factor", &m->rope_scaling_factor},
      {"--rotary-seq-len-interpolation-factor", &m->rotary_seq_len_interpolation_factor},
      {"--rotary-scaling-factor", &f->mla.rotary_scaling_factor},
      {"--mscale", &f->mla.mscale},
      {"--mscale-all-dim", &f->mla.mscale_all_dim}};
  const std::map<std::string, bool*> switches = {
      {"--untie-embeddings-and-output-weights", &m->untie_embeddings_and_output_weights},
      {"--use-rope-scaling", &m->use_rope_scaling},
      {"--rotary-interleaved", &m->rotary_interleaved},
      {"--swiglu", &m->swiglu},
      {"--disable-bias-linear", &f->disable_bias_linear},
      {"--add-qkv-bias", &m->add_qkv_bias},
      {"--qk-layernorm", &m->qk_layernorm},
      {"--qk-l2-norm", &m->qk_l2_norm},
      {"--attention-output-gate", &m->attention_output_gate},
      {"--squared-relu", &m->squared_relu},
      {"--apply-layernorm-1p", &m->apply_layernorm_1p},
      {"--moe-router-pre-softmax", &f->moe.pre_softmax},
      {"--multi-latent-attention", &f->mla.on},
      {"--moe-shared-expert-gate", &f->moe.shared_expert_gate}};
  if (auto it = ints.find(flag); it != ints.end()) PTK_RETURN_IF_ERROR(as_int(it->second));
  if (auto it = reals.find(flag); it != reals.end()) PTK_RETURN_IF_ERROR(as_real(it->second));
  if (auto it = switches.find(flag); it != switches.end()) *it->second = on;
  for (auto [name, field] : {std::pair{"--moe-router-topk", &f->moe.topk}, {"--moe-ffn-hidden-size", &f->moe.ffn}})
    if (flag == name) {
      int64_t v = 0;
      PTK_RETURN_IF_ERROR(as_int(&v));
      *field = v;
    }
  if (flag == "--q-lora-rank" && value == "none") f->mla.q_lora_rank.reset();  // linear_q_proj
  if (flag == "--q-lora-rank" && value != "none") {
    int64_t v = 0;
    PTK_RETURN_IF_ERROR(as_int(&v));
    f->mla.q_lora_rank = v;
  }
  if (flag == "--rope-type") {
    if (value != "rope" && value != "yarn") return bad();
    f->mla.rope_type = value;
  }
  // Sliding window attention's, as the checkpoint writes them ("W,0"; the layer pattern, "[1,0,1]").
  if (flag == "--window-size") f->attn.window_size = value;
  if (flag == "--window-attn-skip-freq") f->attn.window_attn_skip_freq = value;
  if (flag == "--softmax-type") {
    if (value != "vanilla" && value != "off-by-one" && value != "learnable") return bad();
    f->attn.softmax_type = value;
  }
  if (flag == "--moe-layer-freq") f->moe.layer_freq = value;  // its written pattern, "[1,0,1]"
  if (flag == "--moe-router-topk-scaling-factor") {           // empty: none
    double v = 0;
    if (!value.empty()) PTK_RETURN_IF_ERROR(as_real(&v));
    f->moe.topk_scaling_factor = value.empty() ? std::nullopt : std::optional<double>(v);
  }
  for (auto [name, field] : {std::pair{"--moe-router-num-groups", &f->moe.num_groups},
                             {"--moe-router-group-topk", &f->moe.group_topk},
                             {"--moe-shared-expert-intermediate-size", &f->moe.shared_expert_size},
                             {"--mtp-num-layers", &f->mtp.num_layers}})
    if (flag == name) {  // empty: no group-limited routing (no shared experts, no MTP depths)
      int64_t v = 0;
      if (!value.empty()) PTK_RETURN_IF_ERROR(as_int(&v));
      *field = value.empty() ? std::nullopt : std::optional<int64_t>(v);
    }
  if (flag == "--moe-router-score-function") {
    if (value != "softmax" && value != "sigmoid") return bad();
    f->moe.score_function = value;
  }
  if (flag == "--num-query-groups")  // as many groups as heads: Megatron's multi-head attention
    f->group_query_attention = f->num_query_groups != m->num_attention_heads;
  if (flag == "--normalization") {
    if (value != "LayerNorm" && value != "RMSNorm") return bad();
    f->normalization = value;
  }
  if (flag == "--position-embedding-type") {
    if (value != "learned_absolute" && value != "rope" && value != "none") return bad();
    f->position_embedding_type = value;
    f->use_rotary_position_embeddings = f->no_position_embedding = false;
  }
  return absl::OkStatus();
}

// The name ptk's settings (and an imported Megatron checkpoint's) give the padded vocabulary.
constexpr char kPaddedVocabSetting[] = "--make-vocab-size-divisible-by (padded vocabulary)";

// The vocabulary's settings of Megatron's load_args_from_checkpoint: padded_vocab_size is taken (no
// flag gives it), make_vocab_size_divisible_by never (check_checkpoint_args compares it with the
// command line's), nor the init flags (the loaded weights do not depend on them: a note where they
// differ). Kept in `f` for PaddedVocabSize, which knows the vocabulary.
absl::Status TakeVocabPadding(const std::map<std::string, std::string>& ckpt, int64_t iteration,
                              const std::string& load, bool vocab_size_taken, TrainFlags* f,
                              std::vector<std::string>* notes) {
  auto positive = [&](const std::string& key, const std::string& value) -> absl::StatusOr<int64_t> {
    char* end = nullptr;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || v < 1)
      return absl::DataLossError(fmt::format("{}: checkpoint records {} {:?}", load, key, value));
    return static_cast<int64_t>(v);
  };
  for (const auto& [flag, now] :
       {std::pair<std::string, std::string>{"--init-method-std", fmt::format("{}", f->options.model.init_method_std)},
        {"--init-method-xavier-uniform", f->options.model.init_method_xavier_uniform ? "on" : "off"}})
    if (auto it = ckpt.find(flag); it != ckpt.end() && !SameValue(it->second, now))
      notes->push_back(fmt::format(
          "--use-checkpoint-args: {} {} is the command line's, not the checkpoint's {} (Megatron does not take "
          "the init flags; the loaded weights do not depend on them)",
          flag, now, it->second));
  auto padded = ckpt.find(kPaddedVocabSetting);
  if (padded == ckpt.end()) return absl::OkStatus();  // an older ptk's: padded from the divisor, as before
  TrainFlags::CheckpointVocab v;
  v.load = load;
  v.iteration = iteration;
  PTK_ASSIGN_OR_RETURN(v.padded_vocab_size, positive(padded->first, padded->second));
  if (auto d = ckpt.find("--make-vocab-size-divisible-by"); d != ckpt.end()) {
    PTK_ASSIGN_OR_RETURN(v.make_vocab_size_divisible_by, positive(d->first, d->second));
  }
  v.vocab_size_taken = vocab_size_taken;
  f->checkpoint_vocab = v;
  return absl::OkStatus();
}

// Whether Megatron's padding of `vocab` tokens to a multiple of `divisor` x some tensor size gives `padded`.
bool PaddingReaches(int64_t vocab, int64_t divisor, int64_t padded) {
  if (padded < vocab || padded % divisor != 0) return false;
  for (int64_t t = 1; t <= padded / divisor; ++t) {
    const int64_t step = divisor * t;
    if ((vocab + step - 1) / step * step == padded) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<int64_t> PaddedVocabSize(const TrainFlags& f, int64_t vocab_size, int64_t tp) {
  const int64_t divisor = f.make_vocab_size_divisible_by;
  if (!f.checkpoint_vocab) return TensorParallelVocabSize(vocab_size, divisor, static_cast<int>(tp));
  const TrainFlags::CheckpointVocab& c = *f.checkpoint_vocab;
  const std::string where = fmt::format("the checkpoint of iteration {} in {}", c.iteration, c.load);
  const std::string of = f.options.vocab_file.empty() ? "" : " of --vocab-file " + f.options.vocab_file;
  const int64_t saved_divisor = c.make_vocab_size_divisible_by.value_or(divisor);
  if (!f.options.vocab_file.empty() && !f.options.finetune && saved_divisor != divisor)
    return UsageError(fmt::format(
        "--use-checkpoint-args: --make-vocab-size-divisible-by {} differs from {}'s {}, which padded the "
        "vocabulary to {}: give --make-vocab-size-divisible-by {} (Megatron's check_checkpoint_args refuses it too)",
        divisor, where, saved_divisor, c.padded_vocab_size, saved_divisor));
  if (c.padded_vocab_size < vocab_size)
    return UsageError(fmt::format(
        "--use-checkpoint-args: {} has a padded vocabulary of {}, less than the {} tokens{}: it was trained on "
        "another vocabulary",
        where, c.padded_vocab_size, vocab_size, of));
  if (!PaddingReaches(vocab_size, saved_divisor, c.padded_vocab_size))
    return UsageError(fmt::format(
        "--use-checkpoint-args: {} has a padded vocabulary of {}, which padding the {} tokens{} to a multiple of "
        "--make-vocab-size-divisible-by {} times a tensor-parallel size does not give: it was trained on another "
        "vocabulary{}",
        where, c.padded_vocab_size, vocab_size, of, saved_divisor,
        c.make_vocab_size_divisible_by ? "" : ", or with another --make-vocab-size-divisible-by (give that one)"));
  return c.padded_vocab_size;
}

// Megatron's precedence: a flag it takes with force=True (kCheckpointForcedFlags) is the checkpoint's
// even where the command line gives it (a note names the replaced value); any other is the
// checkpoint's where the command line leaves it out, and one given otherwise is refused (Megatron
// keeps it and the load fails on another model). A setting the checkpoint does not record (saved
// before ptk recorded it) stays as the command line has it, its default when not given; of the
// required flags, that is refused.
absl::Status ApplyCheckpointArgs(const CLI::App& app, TrainFlags* f, std::vector<std::string>* notes) {
  PTK_RETURN_IF_ERROR(ApplyEncoderSeqLength(app, f));
  if (!f->use_checkpoint_args) return absl::OkStatus();
  if (f->options.load.empty())
    return UsageError("--use-checkpoint-args needs --load (the checkpoint to take the model from)");
  // The checkpoint the run will load: with --non-persistent-ckpt-type global, the non-persistent one where it is
  // newer (Megatron's load_args_from_checkpoint reads it through _load_base_checkpoint too).
  const std::string np = f->non_persistent_ckpt_type == "global"
                             ? NonPersistentDir(f->options.load, f->non_persistent_global_ckpt_dir)
                             : "";
  const absl::StatusOr<CheckpointChoice> choice = ChooseCheckpointToLoad(f->options.load, np, f->options.ckpt_step);
  const absl::StatusOr<int64_t> latest = choice.ok() ? absl::StatusOr<int64_t>(choice->iteration) : choice.status();
  const std::string load = choice.ok() ? choice->dir : f->options.load;
  if (absl::IsNotFound(latest.status()) && f->options.exit_on_missing_checkpoint)
    return absl::NotFoundError(
        fmt::format("--use-checkpoint-args: no checkpoint in --load {} ({}); "
                    "--exit-on-missing-checkpoint: stopping",
                    load, StatusMessage(latest.status())));
  if (absl::IsNotFound(latest.status()))
    return UsageError(
        fmt::format("--use-checkpoint-args: no checkpoint in --load {} ({})", load, StatusMessage(latest.status())));
  PTK_RETURN_IF_ERROR(latest.status());
  PTK_ASSIGN_OR_RETURN(const auto saved, ReadCheckpointSettings(load, *latest));
  const std::map<std::string, std::string> ckpt(saved.begin(), saved.end());
  std::string taken, unrecorded;
  for (const char* name : kCheckpointModelFlags) {
    const std::string flag = name;
    const std::optional<std::string> given = GivenValue(app, *f, flag);
    auto it = ckpt.find(flag);
    if (it == ckpt.end()) {
      if (flag.starts_with("--moe-") || flag == "--num-experts") continue;  // a dense model's checkpoint
      if (IsMlaFlag(flag)) continue;                                        // one without multi-latent attention
      if (flag == "--window-size" || flag == "--window-attn-skip-freq" || flag == "--softmax-type")
        continue;  // one without a sliding window (a vanilla softmax)
      if (!given && IsRequired(flag))
        return UsageError(
            fmt::format("--use-checkpoint-args: the checkpoint of iteration {} in {} does not record {}: give it",
                        *latest, load, flag));
      if (!given) unrecorded += (unrecorded.empty() ? "" : ", ") + flag;
      continue;
    }
    const std::string& value = it->second;
    if (flag == "--rope-scaling-factor" && value.empty()) continue;  // no RoPE scaling: nothing to take
    if (given && SameValue(*given, value)) continue;
    if (given && !IsForced(flag))
      return UsageError(fmt::format(
          "--use-checkpoint-args: {} {} differs from the checkpoint's {} {} (iteration {} in {}): drop the flag "
          "to take the checkpoint's, or drop --use-checkpoint-args",
          flag, Shown(*given), flag, Shown(value), *latest, load));
    PTK_RETURN_IF_ERROR(TakeCheckpointValue(flag, value, load, f));
    if (given)
      notes->push_back(fmt::format(
          "--use-checkpoint-args: {} {} from the checkpoint of iteration {}, in place of the command line's {} "
          "(Megatron takes it from the checkpoint over the command line)",
          flag, Shown(value), *latest, Shown(*given)));
    else
      taken += fmt::format("{}{} {}", taken.empty() ? "" : ", ", flag, Shown(value));
  }
  const bool vocab_size_taken = ckpt.count("--vocab-size") > 0 && !Given(app, "--vocab-size");
  PTK_RETURN_IF_ERROR(TakeVocabPadding(ckpt, *latest, load, vocab_size_taken, f, notes));
  if (f->checkpoint_vocab)
    taken += fmt::format("{}padded vocabulary {}", taken.empty() ? "" : ", ", f->checkpoint_vocab->padded_vocab_size);
  if (!taken.empty())
    notes->push_back(fmt::format("--use-checkpoint-args: from the checkpoint of iteration {}: {}", *latest, taken));
  if (!unrecorded.empty())
    notes->push_back(fmt::format(
        "--use-checkpoint-args: the checkpoint of iteration {} does not record {} (saved before ptk recorded "
        "them): their defaults",
        *latest, unrecorded));
  return absl::OkStatus();
}

}  // namespace ptk
