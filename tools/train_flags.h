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
#include "trainer/training.h"

namespace ptk::trainer {

struct TrainFlags {
  // model
  int64_t num_layers = 0, hidden_size = 0, num_attention_heads = 0, ffn_hidden_size = 0, seq_length = 0,
          max_position_embeddings = 0, make_vocab_size_divisible_by = 128, vocab_size = 0, kv_channels = 0;
  double layernorm_epsilon = 1e-5, hidden_dropout = 0.1, attention_dropout = 0.1, init_method_std = 0.02;
  bool untie = false, recompute_activations = false;
  std::string recompute_granularity, position_embedding_type = "learned_absolute", normalization = "LayerNorm";
  // batch and length
  int64_t micro_batch_size = 1, global_batch_size = 0, train_iters = 0, train_samples = 0;
  // optimizer and schedule
  std::string optimizer = "adam";
  double lr = 0, min_lr = 0, lr_warmup_init = 0, weight_decay = 0.01, adam_beta1 = 0.9, adam_beta2 = 0.999,
         adam_eps = 1e-8, clip_grad = 1.0;
  std::optional<double> lr_warmup_fraction, start_weight_decay, end_weight_decay;
  std::string lr_decay_style = "linear", lr_wsd_decay_style = "exponential", weight_decay_incr_style = "constant";
  int64_t lr_decay_iters = 0, lr_decay_samples = 0, lr_warmup_iters = 0, lr_warmup_samples = 0, lr_wsd_decay_iters = 0,
          lr_wsd_decay_samples = 0;
  // data
  std::vector<std::string> data_path, train_data_path, valid_data_path, test_data_path;
  std::string split = "969, 30, 1", data_cache_path, vocab_file, merge_file, tokenizer_type = "GPT2BPETokenizer";
  std::string dataloader_type = "single";
  bool mock_data = false, eod_mask_loss = false, reset_position_ids = false, reset_attention_mask = false;
  int64_t seed = 1234;
  // eval, logging, checkpoints
  int64_t eval_interval = 1000, eval_iters = 100, log_interval = 100, save_interval = 0, exit_interval = 0;
  double exit_duration_in_mins = 0;
  std::string save, load, tensorboard_dir, metrics_file;
  int64_t tensorboard_log_interval = 1;
  bool log_loss_scale_to_tensorboard = true, log_validation_ppl_to_tensorboard = false,
       log_world_size_to_tensorboard = false, log_timers_to_tensorboard = false;
  // ptk: text samples (the caller tokenizes the prompt)
  int64_t sample_interval = 0, sample_length = 32;
  std::string sample_prompt;
  double sample_temperature = 0;
  bool exit_signal_handler = false, no_load_optim = false, no_load_rng = false, finetune = false;
  bool override_opt_param_scheduler = false, use_checkpoint_opt_param_scheduler = false;
  bool check_for_nan_in_loss_and_grad = true;
  // precision, parallelism, device
  bool fp16 = false, bf16 = false, deterministic_mode = false, profile_ops = false;
  std::string device;  // "": cuda where the build has CUDA and a GPU is visible, else cpu
  // Megatron's loss scaling (fp16): --loss-scale fixes the scale; else dynamic from --initial-loss-scale.
  std::optional<double> loss_scale;
  double initial_loss_scale = 4294967296.0, min_loss_scale = 1.0, loss_scale_window = 1000;
  int64_t hysteresis = 2;
  int64_t tensor_model_parallel_size = 1, pipeline_model_parallel_size = 1, context_parallel_size = 1;
  int64_t threads = 0;  // ptk: CPU threads per rank (0: all cores of this rank's share)
  double distributed_timeout_minutes = 5;
  bool use_distributed_optimizer = false, overlap_grad_reduce = false;
  std::string distributed_backend;  // "": nccl with --device cuda, else gloo
  int64_t ddp_bucket_size = 0;      // 0: Megatron's default
  // Flags accepted only for compatibility, by name -> value given ("" for a bare flag).
  std::map<std::string, std::string> compat;
  // Megatron's flags for other models than ptk's, given: refused saying why.
  std::map<std::string, std::string> refused;
};

// Adds every flag to `app`, writing into `flags`. Every numeric flag carries its range check here,
// where it is declared: a value out of range (or NaN, or not a number) is a usage error.
void AddTrainFlags(CLI::App* app, TrainFlags* flags);

// After parsing: refuses what ptk cannot do (one line naming the flag), collects notes for flags
// accepted without effect, and fills TrainOptions (data-parallel size from the caller).
absl::StatusOr<TrainOptions> ResolveTrainFlags(const TrainFlags& flags, std::vector<std::string>* notes);

// GPT-2 vocabulary size: entries of --vocab-file, or 50257 for ptk's built-in GPT-2 files.
absl::StatusOr<int64_t> Gpt2VocabSize(const std::string& vocab_file);

}  // namespace ptk::trainer
