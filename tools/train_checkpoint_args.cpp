// ptk-train --use-checkpoint-args: the model's flags that the command line leaves out, taken from
// the settings of --load's latest checkpoint (Megatron's load_args_from_checkpoint).
#include <cmath>
#include <cstdlib>
#include <map>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using train_flags::kCheckpointModelFlags;

// A flag given on the command line must agree with the checkpoint's value of it.
absl::Status CheckGivenAgrees(const CLI::Option& opt, const GPTConfig& m, const std::string& flag,
                              const std::string& value, int64_t latest, const std::string& load) {
  std::string mine;
  if (flag == "--untie-embeddings-and-output-weights") {
    mine = m.untie_embeddings_and_output_weights ? "on" : "off";
  } else {
    mine = opt.as<std::string>();
    // The same number written otherwise (1e-5, 0.00001) is no conflict.
    char* end = nullptr;
    const double a = std::strtod(mine.c_str(), &end), b = std::strtod(value.c_str(), nullptr);
    if (end != mine.c_str() && *end == '\0' && a == b) mine = value;
  }
  if (mine != value)
    return UsageError(fmt::format(
        "--use-checkpoint-args: {} {} differs from the checkpoint's {} {} (iteration {} in {}): drop the flag "
        "to take the checkpoint's, or drop --use-checkpoint-args",
        flag, mine, flag, value, latest, load));
  return absl::OkStatus();
}

// The checkpoint's `value` of `flag` into the model's setting; a value no flag could have given is
// data loss in the checkpoint at `load`.
absl::Status TakeCheckpointValue(const std::string& flag, const std::string& value, const std::string& load,
                                 GPTConfig* m) {
  auto as_int = [&](int64_t* out) -> absl::Status {
    char* end = nullptr;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || v < 1)
      return absl::DataLossError(fmt::format("{}: checkpoint records {} {:?}", load, flag, value));
    *out = v;
    return absl::OkStatus();
  };
  auto as_real = [&](double* out) -> absl::Status {
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !std::isfinite(v))
      return absl::DataLossError(fmt::format("{}: checkpoint records {} {:?}", load, flag, value));
    *out = v;
    return absl::OkStatus();
  };
  if (flag == "--num-layers") PTK_RETURN_IF_ERROR(as_int(&m->num_layers));
  if (flag == "--hidden-size") PTK_RETURN_IF_ERROR(as_int(&m->hidden_size));
  if (flag == "--num-attention-heads") PTK_RETURN_IF_ERROR(as_int(&m->num_attention_heads));
  if (flag == "--ffn-hidden-size") PTK_RETURN_IF_ERROR(as_int(&m->ffn_hidden_size));
  if (flag == "--seq-length") PTK_RETURN_IF_ERROR(as_int(&m->seq_length));
  if (flag == "--max-position-embeddings") PTK_RETURN_IF_ERROR(as_int(&m->max_position_embeddings));
  if (flag == "--vocab-size") PTK_RETURN_IF_ERROR(as_int(&m->vocab_size));
  if (flag == "--layernorm-epsilon") PTK_RETURN_IF_ERROR(as_real(&m->layernorm_epsilon));
  if (flag == "--hidden-dropout") PTK_RETURN_IF_ERROR(as_real(&m->hidden_dropout));
  if (flag == "--attention-dropout") PTK_RETURN_IF_ERROR(as_real(&m->attention_dropout));
  if (flag == "--untie-embeddings-and-output-weights") m->untie_embeddings_and_output_weights = value == "on";
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyCheckpointArgs(const CLI::App& app, TrainFlags* f, std::vector<std::string>* notes) {
  if (!f->use_checkpoint_args) return absl::OkStatus();
  const std::string& load = f->options.load;
  if (load.empty()) return UsageError("--use-checkpoint-args needs --load (the checkpoint to take the model from)");
  absl::StatusOr<int64_t> latest = LatestCheckpointIteration(load);
  if (absl::IsNotFound(latest.status()))
    return UsageError(
        fmt::format("--use-checkpoint-args: no checkpoint in --load {} ({})", load, StatusMessage(latest.status())));
  PTK_RETURN_IF_ERROR(latest.status());
  PTK_ASSIGN_OR_RETURN(const auto saved, ReadCheckpointSettings(load, *latest));
  const std::map<std::string, std::string> ckpt(saved.begin(), saved.end());
  GPTConfig& m = f->options.model;
  std::vector<std::string> missing;
  for (const char* name : kCheckpointModelFlags) {
    const CLI::Option* opt = app.get_option(name);
    auto it = ckpt.find(name);
    if (it == ckpt.end()) {
      if (opt->get_required() || opt->count() == 0) missing.push_back(name);
      continue;
    }
    const std::string& value = it->second;
    const std::string flag = name;
    if (opt->count() > 0) {  // given: must agree with the checkpoint
      PTK_RETURN_IF_ERROR(CheckGivenAgrees(*opt, m, flag, value, *latest, load));
      continue;
    }
    PTK_RETURN_IF_ERROR(TakeCheckpointValue(flag, value, load, &m));
    notes->push_back(
        fmt::format("--use-checkpoint-args: {} {} from the checkpoint of iteration {}", flag, value, *latest));
  }
  for (const std::string& name : missing)
    if (app.get_option(name)->count() == 0 && (name == "--num-layers" || name == "--hidden-size" ||
                                               name == "--num-attention-heads" || name == "--seq-length"))
      return UsageError(
          fmt::format("--use-checkpoint-args: the checkpoint of iteration {} in {} does not record {}: "
                      "give it",
                      *latest, load, name));
  return absl::OkStatus();
}

}  // namespace ptk
