// What ptk-train's flag files share (tools/train_flags.h declares what the main calls): the range
// check every numeric flag carries where it is declared, the tables of Megatron's flags accepted
// for compatibility or refused for another model (train_compat_flags.cpp), and the model flags
// --use-checkpoint-args takes from a checkpoint (train_checkpoint_args.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "common/cli.h"
#include "tools/train_flags.h"

namespace ptk::train_flags {

// Range checks, attached where each flag is declared: common/cli.h's (a value outside the range,
// or not a number, is a usage error naming the flag and the range). Sizes and counts are capped
// where products of them would overflow 64-bit integers.
constexpr int64_t kMaxSize = (int64_t{1} << 31) - 1;  // a dimension, a vocabulary, a batch
constexpr int64_t kMaxCount = int64_t{1} << 40;       // iterations, samples
using cli::IntIn;
using cli::NonNegative;  // [0, inf)
using cli::Positive;     // (0, inf)
using cli::RealIn;
// dropout: [0, 1)
inline CLI::Validator Probability() { return RealIn(0, false, 1, true); }

// The model's flags --use-checkpoint-args takes from the checkpoint (Megatron's
// load_args_from_checkpoint), as the checkpoint's settings name them: every architecture setting a
// ptk checkpoint records.
inline constexpr const char* kCheckpointModelFlags[] = {
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--ffn-hidden-size",
    "--seq-length",
    "--max-position-embeddings",
    "--vocab-size",
    "--layernorm-epsilon",
    "--untie-embeddings-and-output-weights",
    "--hidden-dropout",
    "--attention-dropout",
    "--normalization",
    "--position-embedding-type",
    "--rotary-base",
    "--rotary-percent",
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "--rotary-seq-len-interpolation-factor",
    "--rotary-interleaved",
    "--swiglu",
    "--num-query-groups",
    "--kv-channels",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--qk-layernorm",
    "--qk-l2-norm",
    "--attention-output-gate",
    "--squared-relu",
    "--apply-layernorm-1p",
    // A mixture-of-experts checkpoint's (a dense one records none of them).
    "--num-experts",
    "--moe-router-topk",
    "--moe-ffn-hidden-size",
    "--moe-router-pre-softmax",
    "--moe-router-score-function",
    "--moe-layer-freq",
    "--moe-router-topk-scaling-factor",
    "--moe-router-num-groups",
    "--moe-router-group-topk",
    "--moe-shared-expert-intermediate-size",
    "--moe-shared-expert-gate",
    // A multi-latent attention checkpoint's (another records none of them). Megatron's
    // load_args_from_checkpoint takes none of them; ptk takes them as it takes the shape flags.
    "--multi-latent-attention",
    "--q-lora-rank",
    "--kv-lora-rank",
    "--qk-head-dim",
    "--qk-pos-emb-head-dim",
    "--v-head-dim",
    "--rope-type",
    "--rotary-scaling-factor",
    "--mscale",
    "--mscale-all-dim",
    // A multi-token prediction checkpoint's depth count (its loss factor is a training setting, not taken).
    "--mtp-num-layers",
    // Sliding window attention's and the softmax type (recorded only where set; Megatron's load_args_from_checkpoint
    // takes none of them; ptk takes them as the shape flags).
    "--window-size",
    "--window-attn-skip-freq",
    "--softmax-type",
};
// Those Megatron's load_args_from_checkpoint takes with force=True: the checkpoint's value replaces
// one the command line gives. The others (Megatron's shape flags, which it takes only where the
// command line leaves them out, and the settings it does not take at all) are refused when given
// otherwise than the checkpoint has them.
inline constexpr const char* kCheckpointForcedFlags[] = {
    "--untie-embeddings-and-output-weights",
    "--normalization",
    "--position-embedding-type",
    "--rotary-percent",
    "--rotary-interleaved",
    "--swiglu",
    "--num-query-groups",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--apply-layernorm-1p",
    "--num-experts",
    "--moe-router-topk",
    "--moe-ffn-hidden-size",
    "--moe-router-pre-softmax",
    "--moe-router-score-function",
    "--moe-layer-freq",
    "--moe-router-topk-scaling-factor",
};

// Megatron's flags for other models than ptk's, each declared to be refused by RefuseOtherModel
// with what ptk's model has instead (in the "unsupported" group of --help).
void AddModelRefusalFlags(CLI::App* app, TrainFlags* f);
// Megatron's flags that change only speed or memory, never results: accepted, noted by NoteCompatFlags.
void AddCompatFlags(CLI::App* app, TrainFlags* f);
// The rest of Megatron's pretrain_gpt.py flags (train_megatron_table.cpp): accepted with a note or refused,
// each with its reason. MegatronTableReason: the reason of a flag of that table noted (refuse false) or
// refused (refuse true); nullptr for any other flag.
void AddMegatronTableFlags(CLI::App* app, TrainFlags* f);
const char* MegatronTableReason(const std::string& name, bool refuse);
// A usage error naming every refused model flag given (the first with its reason); OK when none is.
absl::Status RefuseOtherModel(const TrainFlags& f);
// Megatron's non-persistent checkpoints and --save-retain-interval (train_checkpoint_flags.cpp): the flags, then
// their values checked against --save, --load and --save-interval (a usage error naming the flag) and put into
// `out` (the non-persistent directories); notes for the local checkpoints' flags, which change nothing.
void AddCheckpointKeepingFlags(CLI::App* app, TrainFlags* f);
absl::Status ResolveCheckpointKeeping(const TrainFlags& f, TrainOptions* out, std::vector<std::string>* notes);
// The optimizer's flags (train_optimizer_flags.cpp): fp16's loss scaling into out->loss_scale (a note for the
// flags that change nothing: any without --fp16, the dynamic ones beside --loss-scale), and Megatron's parameter
// groups (--no-weight-decay-cond-type as --apply-wd-to-qk-layernorm; a usage error for another value).
void ResolveLossScale(const TrainFlags& f, TrainOptions* out, std::vector<std::string>* notes);
absl::Status ResolveParamGroups(const TrainFlags& f, TrainOptions* out, std::vector<std::string>* notes);
// A note for each compatibility flag given: "--flag [value]: accepted, why it changes nothing".
void NoteCompatFlags(const TrainFlags& f, std::vector<std::string>* notes);
// Megatron's moe_freq_type list pattern ("[1,0,1]", "([1]*3+[0])*2") into its entries (moe_flags.cpp).
bool ParseLayerPattern(const std::string& text, std::vector<int>* out);

}  // namespace ptk::train_flags
