// ptk-train's option table: Megatron's flag names and defaults (megatron/training/arguments.py)
// for everything the trainer implements, and a policy for the rest of the flags the seeds'
// scripts pass: accepted with a note when they only tune speed, refused with one line saying what
// ptk supports otherwise. Only tools/train_main.cpp parses argv; this file declares the table
// and turns the parsed values into TrainOptions.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/statusor.h"
#include "common/cli.h"
#include "trainer/dry_run.h"
#include "trainer/training.h"

namespace ptk {

struct TrainFlags {
  // A flag that is one setting of the run writes it here, where RunTraining reads it.
  TrainOptions options;
  // The flags resolved into `options` after parsing (ResolveTrainFlags), or read by the main.
  // model
  int64_t make_vocab_size_divisible_by = 128, kv_channels = 0;
  std::optional<int64_t> encoder_seq_length;  // Megatron's other name for --seq-length (ApplyCheckpointArgs)
  std::string recompute_granularity, position_embedding_type = "learned_absolute", normalization = "LayerNorm";
  // optimizer and data
  std::string optimizer = "adam";
  std::string no_weight_decay_cond_type;  // "" or apply_wd_to_qk_layernorm (ResolveParamGroups)
  std::string data_cache_path, tokenizer_type = "GPT2BPETokenizer";
  std::string dataloader_type = "single";
  std::string per_dataset_sequences_path;  // checked against each .idx (CheckSequencesPerDataset)
  bool reset_attention_mask = false;
  int64_t seed = 1234;
  // logging, checkpoints
  std::string metrics_file;
  bool exit_signal_handler = false;
  std::string exit_signal;  // --exit-signal: "" when not given (Megatron's SIGTERM)
  bool override_opt_param_scheduler = false, use_checkpoint_opt_param_scheduler = false;
  // Megatron's non-persistent checkpoints (train_checkpoint_flags.cpp): "" when not given.
  std::string non_persistent_ckpt_type, non_persistent_global_ckpt_dir, non_persistent_local_ckpt_dir,
      non_persistent_local_ckpt_algo;
  // precision, parallelism, device
  bool fp16 = false, bf16 = false;
  bool disable_bf16_reduced_precision_matmul = false;
  std::string device;  // "": cuda where the build has CUDA and a GPU is visible, else cpu
  // Megatron's loss scaling (fp16): --loss-scale fixes the scale; else dynamic from --initial-loss-scale.
  // Unset: Megatron's defaults (2^32, 1, 1000, 2); given without --fp16, or beside --loss-scale, a note names them.
  std::optional<double> loss_scale, initial_loss_scale, min_loss_scale, loss_scale_window;
  std::optional<int64_t> hysteresis;
  int64_t tensor_model_parallel_size = 1, pipeline_model_parallel_size = 1, context_parallel_size = 1;
  std::string cp_comm_type = "p2p";  // --cp-comm-type: p2p and allgather (the same attention on the CPU)
  int64_t threads = 0;               // ptk: CPU threads per rank (0: all cores of this rank's share)
  double distributed_timeout_minutes = 5;
  std::string distributed_backend;  // "": nccl with --device cuda, else gloo
  // Flags accepted only for compatibility, by name -> value given ("" for a bare flag).
  std::map<std::string, std::string> compat;
  // Megatron's flags for other models than ptk's, given: refused saying why.
  std::map<std::string, std::string>
      refused;  // --use-checkpoint-args: the model's flags from --load's latest checkpoint (ApplyCheckpointArgs).
  bool use_checkpoint_args = false;
  // --use-checkpoint-args: the vocabulary padding the checkpoint records (ApplyCheckpointArgs), for
  // ResolveModel (CheckpointPaddedVocabSize).
  struct CheckpointVocab {
    std::string load;
    int64_t iteration = 0;
    int64_t padded_vocab_size = 0;                        // Megatron's padded_vocab_size: the model's, taken
    std::optional<int64_t> make_vocab_size_divisible_by;  // the saving run's divisor, where recorded
    bool vocab_size_taken = false;                        // --vocab-size came from the checkpoint
  };
  std::optional<CheckpointVocab> checkpoint_vocab;
  // --data-args-path / --per-split-data-args-path: the data paths from a file, as Megatron reads it.
  std::string data_args_path, per_split_data_args_path;
  std::string phase_transition_iterations;  // Megatron's comma-separated list, as given (ResolveDataFlags parses it)
  bool profile = false;                     // --profile: ptk's per-op CUDA timing
  // --dry-run: plan the run (any tensor and pipeline size) and exit; trainer/dry_run.h.
  bool dry_run = false;
  int64_t gpus_per_node = 0;
  // the Llama line (llama_flags.cpp)
  bool use_rotary_position_embeddings = false, no_position_embedding = false, group_query_attention = false,
       disable_bias_linear = false;
  int64_t num_query_groups = 1;
  std::optional<int64_t> decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers;
  // Megatron's mixture of experts (moe_flags.cpp).
  struct Moe {
    int64_t num_experts = 0;  // 0: no --num-experts
    std::optional<int64_t> topk, ffn;
    std::optional<int64_t> num_groups, group_topk;  // group-limited routing
    std::optional<double> z_loss_coeff, topk_scaling_factor;
    std::vector<double> aux_loss_coeff;
    std::vector<std::string> load_balancing_type;
    std::string score_function = "softmax", layer_freq, dispatcher, router_dtype;
    bool pre_softmax = false, grouped_gemm = false, permute_fusion = false;
    int64_t expert_parallel = 1;
    std::optional<int64_t> expert_tensor_parallel;  // --expert-tensor-parallel-size (default: the tensor size)
    bool enable_expert_bias = false;                // aux-loss-free routing (moe_balance_flags.cpp)
    std::optional<double> bias_update_rate;
    // Shared experts (shared_experts_flags.cpp): their width (none: no shared experts), the gate, the overlap.
    std::optional<int64_t> shared_expert_size;
    bool shared_expert_gate = false, shared_expert_overlap = false;
    std::optional<double> capacity_factor;  // token dropping (ResolveCapacity, moe_flags.cpp)
    std::string drop_policy;                // empty: not given (probs)
    bool pad_to_capacity = false;
  } moe;
  // Megatron's multi-latent attention (mla_flags.cpp): Megatron-LM's defaults; rope_type empty: not given.
  struct Mla {
    bool on = false;
    std::optional<int64_t> q_lora_rank;
    int64_t kv_lora_rank = 32, qk_head_dim = 128, qk_pos_emb_head_dim = 64, v_head_dim = 128;
    std::string rope_type;
    double rotary_scaling_factor = 1.0, mscale = 1.0, mscale_all_dim = 0.0;
  } mla;
  // Megatron's multi-token prediction (mtp_flags.cpp): num_layers none or 0: off.
  struct Mtp {
    std::optional<int64_t> num_layers;
    double loss_scaling_factor = 0.1;
    bool standalone = false;
  } mtp;
  // Megatron's sliding window attention and softmax type (attention_variant_flags.cpp): empty, not given.
  struct AttentionVariant {
    std::string window_size, window_attn_skip_freq, softmax_type;
  } attn;
  // Megatron's interleaved schedule: layers per model chunk, or model chunks per stage.
  std::optional<int64_t> num_layers_per_virtual_pipeline_stage, num_virtual_stages_per_pipeline_rank;
  // --microbatch-group-size-per-virtual-pipeline-stage: the interleaved schedule's micro-batch groups.
  std::optional<int64_t> microbatch_group_size_per_vp_stage;
};

// Adds every flag to `app`, writing into `flags`. Every numeric flag carries its range check here,
// where it is declared: a value out of range (or NaN, or not a number) is a usage error.
void AddTrainFlags(CLI::App* app, TrainFlags* flags);
// What ptk-train says of a launcher's flag given to it (--rank, --world-size, torchrun's --nproc-per-node,
// ...): where it takes that from instead (cli::Parse's hints).
cli::UnknownFlagHints LauncherFlagHints();
// Megatron's mixture-of-experts flags (moe_flags.cpp), added by AddTrainFlags; their settings into
// `model` (a usage error naming the flag for a feature ptk has not); the parallelism (tensor, pipeline,
// context, expert) and the device (CUDA) ptk's MoE layers do not run with yet, refused naming them.
void AddMoeFlags(CLI::App* app, TrainFlags* flags);
absl::Status ResolveMoeFlags(const TrainFlags& flags, GPTConfig* model, std::vector<std::string>* notes);
// Its shared experts' (shared_experts_flags.cpp; AddMoeFlags and ResolveMoeFlags call them).
void AddSharedExpertFlags(CLI::App* app, TrainFlags* flags);
absl::Status ResolveSharedExpertFlags(const TrainFlags& flags, GPTConfig* model, std::vector<std::string>* notes);
// --fim-data: refused with --mock-data and without --num-workers 0, its flags and tokens checked (MakeFimConfig).
absl::Status ResolveFimFlags(const TrainFlags& f, const TrainOptions& o);
absl::Status RefuseMoeParallelism(const TrainFlags& flags);
// The load-balancing flags (moe_balance_flags.cpp): --moe-router-enable-expert-bias and
// --moe-router-bias-update-rate declared; the load-balancing types and their coefficients resolved (called by
// AddMoeFlags and ResolveMoeFlags), and what ptk has not implemented of them with parallelism refused.
void AddMoeBalanceFlags(CLI::App* app, TrainFlags* flags);
absl::Status ResolveMoeBalance(const TrainFlags& flags, GPTConfig* model, std::vector<std::string>* notes);
absl::Status RefuseMoeBalanceParallelism(const TrainFlags& flags);
absl::Status RefuseMoeDevice(const TrainFlags& flags, Device device);
// Megatron's multi-latent attention flags (mla_flags.cpp), added by AddTrainFlags; their settings into
// `model` (a usage error naming the flag for a combination ptk has not); the parallelism (tensor, context)
// and the device (CUDA) ptk's MLA layers do not run with, refused naming them.
void AddMlaFlags(CLI::App* app, TrainFlags* flags);
absl::Status ResolveMlaFlags(const TrainFlags& flags, GPTConfig* model, std::vector<std::string>* notes);
absl::Status RefuseMlaParallelismAndDevice(const TrainFlags& flags, Device device);
// Megatron's multi-token prediction flags (mtp_flags.cpp), added by AddTrainFlags; their settings into `model`;
// the parallelism, MoE, MLA and device ptk's multi-token prediction does not run with, refused naming them.
void AddMtpFlags(CLI::App* app, TrainFlags* flags);
absl::Status ResolveMtpFlags(const TrainFlags& flags, GPTConfig* model, std::vector<std::string>* notes);
absl::Status RefuseMtpCombinations(const TrainFlags& flags, Device device);
// Megatron's --window-size, --window-attn-skip-freq and --softmax-type (attention_variant_flags.cpp), added by
// AddTrainFlags; their settings into `model` (after --num-layers); the parallelism, models and device they do not
// run with, refused naming them. CanonicalAttentionVariantValue: a given --window-size or --window-attn-skip-freq
// as a checkpoint's settings write it ("W,0"; a pattern of `layers` entries, with `mtp_layers` a count as given),
// for --use-checkpoint-args.
void AddAttentionVariantFlags(CLI::App* app, TrainFlags* flags);
absl::Status ResolveAttentionVariantFlags(const TrainFlags& flags, GPTConfig* model, std::vector<std::string>* notes);
absl::Status RefuseAttentionVariantCombinations(const TrainFlags& flags, Device device);
std::string CanonicalAttentionVariantValue(const std::string& flag, const std::string& given, int64_t layers,
                                           int64_t mtp_layers = 0);
// The flags of Megatron's Llama line (llama_flags.cpp), added by AddTrainFlags.
void AddLlamaFlags(CLI::App* app, TrainFlags* flags);
// Their settings into `model` (Megatron's defaults: SwiGLU's ffn size, query groups only with
// --group-query-attention); a usage error naming the flag for a value ptk has not, or query groups
// that tensor size `tp` does not divide. Both backends train every mix.
absl::Status ResolveLlamaFlags(const TrainFlags& flags, int64_t tp, GPTConfig* model);
// Notes for the rotary flags given where they have no effect (no RoPE; a factor without its scaling).
void NoteRotaryFlags(const GPTConfig& model, std::vector<std::string>* notes);

// After parsing: refuses what ptk cannot do (one line naming the flag), collects notes for flags
// accepted without effect, and completes `flags.options` with the flags that are no setting of
// their own (the defaults that depend on other flags, the precision, the device, the
// communicator's backend). How settings go together is checked by PlanTraining.
absl::StatusOr<TrainOptions> ResolveTrainFlags(const TrainFlags& flags, std::vector<std::string>* notes);
// The model chunks of each pipeline stage the interleaved schedule's flags ask for, with
// Megatron's checks of them (arguments.py: one of the two flags, a pipeline of two or more stages,
// the layers of a stage divisible by those of a chunk) and ptk's (even stages); 1 without them, or
// when one chunk holds a stage's layers (Megatron's plain 1F1B then). A usage error otherwise.
absl::StatusOr<int> VirtualPipelineSize(const TrainFlags& flags);

// --use-checkpoint-args, after parsing and before ResolveTrainFlags: the model's flags that the
// command line leaves out are taken from the settings of --load's latest checkpoint (one line in
// `notes` lists them); one given with another value than the checkpoint's is the checkpoint's where
// Megatron forces it (kCheckpointForcedFlags, a note), else a usage error naming both.
absl::Status ApplyCheckpointArgs(const CLI::App& app, TrainFlags* flags, std::vector<std::string>* notes);
// The padded vocabulary of a model of `vocab_size` tokens on `tp` tensor ranks: Megatron's padding
// (a multiple of --make-vocab-size-divisible-by x tp); with --use-checkpoint-args, the checkpoint's
// padded_vocab_size as Megatron's load_args_from_checkpoint takes it, refused (a usage error naming
// the checkpoint, both values and what to give) where it conflicts with the vocabulary (--vocab-file's,
// or the recorded --vocab-size) or, given a --vocab-file without --finetune, where the checkpoint's
// divisor is not the command line's (Megatron's check_checkpoint_args).
absl::StatusOr<int64_t> PaddedVocabSize(const TrainFlags& flags, int64_t vocab_size, int64_t tp);

// --dry-run: the plan's options from the flags (as ResolveTrainFlags checks them, but any tensor
// and pipeline size, no device, no file but a --vocab-file that exists here) and the cluster.
absl::StatusOr<DryRunOptions> ResolveDryRunFlags(const TrainFlags& flags, const DryRunCluster& cluster,
                                                 std::vector<std::string>* notes);

// --dry-run's main: the cluster from the environment, the plan printed by rank 0 (or one process).
absl::Status PrintDryRun(const CLI::App& app, TrainFlags* flags);

// GPT-2 vocabulary size: entries of --vocab-file, or 50257 for ptk's built-in GPT-2 files.
absl::StatusOr<int64_t> Gpt2VocabSize(const std::string& vocab_file);
// The id of <|endoftext|> in a GPT-2 vocab.json (a usage error where it has none).
absl::StatusOr<int32_t> Gpt2EndOfTextId(const std::string& vocab_file);

}  // namespace ptk
