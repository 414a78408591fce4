// ptk-train's option table: Megatron's flag names, defaults and help, each numeric flag with its
// range check. ResolveTrainFlags (train_resolve.cpp) turns the parsed values into TrainOptions.
#include "tools/train_flags.h"

#include <fmt/core.h>

#include "common/cli.h"
#include "tools/train_flag_parts.h"
#include "trainer/model_limits.h"

namespace ptk {
namespace {

using train_flags::IntIn;
using train_flags::kCheckpointModelFlags;
using train_flags::kMaxCount;
using train_flags::kMaxSize;
using train_flags::NonNegative;
using train_flags::Positive;
using train_flags::Probability;
using train_flags::RealIn;

// The model's shape, and the flags of other models' refused.
void AddModelFlags(CLI::App* app, TrainFlags* f) {
  GPTConfig& m = f->options.model;
  app->add_option("--num-layers", m.num_layers, "Number of transformer layers")->required()->check(IntIn(1, kMaxSize));
  app->add_option("--hidden-size", m.hidden_size, "Transformer hidden size")->required()->check(IntIn(1, kMaxSize));
  app->add_option("--num-attention-heads", m.num_attention_heads, "Number of attention heads")
      ->required()
      ->check(IntIn(1, kMaxSize));
  app->add_option("--ffn-hidden-size", m.ffn_hidden_size, "MLP hidden size (default 4 x --hidden-size)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--kv-channels", f->kv_channels, "Head dimension (default --hidden-size / --num-attention-heads)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--seq-length", m.seq_length, "Sequence length")->required()->check(IntIn(1, kMaxSize));
  // Megatron's validate_args takes it as --seq-length when that is not given (and asserts it is not given with
  // it): its own option, so that --seq-length's help stays REQUIRED, lifting the requirement when given.
  app->add_option_function<int64_t>(
         "--encoder-seq-length",
         [app, f](const int64_t& v) {
           f->encoder_seq_length = v;
           app->get_option("--seq-length")->required(false);
         },
         "Megatron's other name for --seq-length, taken when --seq-length is not given (not with it)")
      ->check(IntIn(1, kMaxSize))
      ->trigger_on_parse();
  app->add_option("--max-position-embeddings", m.max_position_embeddings, "Position table size (default --seq-length)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--make-vocab-size-divisible-by", f->make_vocab_size_divisible_by,
                  "Pad the vocabulary to a multiple of this")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--vocab-size", m.vocab_size, "Vocabulary size (default: from --vocab-file, 50257 for GPT-2)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--layernorm-epsilon,--norm-epsilon", m.layernorm_epsilon, "LayerNorm epsilon")->check(Positive());
  app->add_option("--hidden-dropout", m.hidden_dropout, "Dropout on embeddings and block outputs")
      ->check(Probability());
  app->add_option("--attention-dropout", m.attention_dropout, "Dropout on attention probabilities")
      ->check(Probability());
  app->add_option("--init-method-std", m.init_method_std, "Standard deviation of the normal init")->check(Positive());
  app->add_option("--embedding-init-method-std", m.embedding_init_method_std,
                  "Standard deviation of the word and position embeddings' normal init (default --init-method-std's; "
                  "under --init-method-xavier-uniform, another value draws them from this normal)")
      ->check(RealIn(0, true, kGptConfigMaxInitMethodStd, false))
      ->default_str("");
  app->add_flag("--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights,
                "Separate output layer instead of the word embeddings");
  app->add_flag("--recompute-activations", m.recompute_activations,
                "Recompute attention probabilities in backward (selective)");
  app->add_option("--recompute-granularity", f->recompute_granularity,
                  "selective (as --recompute-activations); full is taken as selective, with a note (the same "
                  "results; memory only)");
  AddLlamaFlags(app, f);
  AddMoeFlags(app, f);
  AddMlaFlags(app, f);
  AddMtpFlags(app, f);
  AddAttentionVariantFlags(app, f);
  train_flags::AddModelRefusalFlags(app, f);
}

// Batch and length, optimizer and schedule.
void AddBatchAndOptimizerFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  app->add_option("--micro-batch-size", o.micro_batch_size, "Samples per micro-batch per rank")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--global-batch-size", o.global_batch_size,
                  "Samples per iteration over all ranks (default mbs x ranks)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--train-iters", o.train_iters, "Iterations to train")->check(IntIn(1, kMaxCount));
  app->add_option("--train-samples", o.train_samples, "Samples to train (instead of --train-iters)")
      ->check(IntIn(1, kMaxCount));
  // Optimizer and schedule.
  app->add_option("--optimizer", f->optimizer, "adam (AdamW, the only one ptk has)");
  app->add_option("--lr", o.schedule.max_lr, "Peak learning rate")->required()->check(NonNegative());
  app->add_option("--min-lr", o.schedule.min_lr, "Learning rate at the end of the decay")->check(NonNegative());
  app->add_option("--lr-warmup-init", o.schedule.init_lr, "Learning rate at the start of the warm-up")
      ->check(NonNegative());
  app->add_option("--lr-decay-style", o.schedule.decay_style, "constant, linear, cosine, inverse-square-root or WSD");
  app->add_option("--lr-decay-iters", o.schedule_options.lr_decay_iters,
                  "Decay length in iterations (default --train-iters)")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--lr-decay-samples", o.schedule_options.lr_decay_samples,
                  "Decay length in samples (with --train-samples)")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--lr-warmup-iters", o.schedule_options.lr_warmup_iters, "Warm-up length in iterations")
      ->check(IntIn(0, kMaxCount));
  app->add_option("--lr-warmup-samples", o.schedule_options.lr_warmup_samples, "Warm-up length in samples")
      ->check(IntIn(0, kMaxCount));
  app->add_option("--lr-warmup-fraction", o.schedule_options.lr_warmup_fraction,
                  "Warm-up as a fraction of the decay length")
      ->check(RealIn(0, false, 1, false));
  app->add_option("--lr-wsd-decay-style", o.schedule.wsd_decay_style,
                  "WSD anneal: linear, cosine, exponential or minus_sqrt");
  app->add_option("--lr-wsd-decay-iters", o.schedule_options.lr_wsd_decay_iters, "WSD anneal length in iterations")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--lr-wsd-decay-samples", o.schedule_options.lr_wsd_decay_samples, "WSD anneal length in samples")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--weight-decay", o.schedule_options.weight_decay, "AdamW weight decay (not on biases and LayerNorm)")
      ->check(NonNegative());
  app->add_option("--start-weight-decay", o.schedule_options.start_weight_decay,
                  "Weight decay at the start (only, and then needed, with a linear or cosine increment style)")
      ->check(NonNegative());
  app->add_option("--end-weight-decay", o.schedule_options.end_weight_decay,
                  "Weight decay at the end (only, and then needed, with a linear or cosine increment style)")
      ->check(NonNegative());
  app->add_option("--weight-decay-incr-style", o.schedule.wd_incr_style, "constant, linear or cosine");
  // Megatron's parameter groups (megatron-core's _get_param_groups).
  app->add_option("--decoupled-lr", o.schedule.decoupled_lr,
                  "Peak learning rate of the word embeddings and the output layer (default --lr)")
      ->check(NonNegative());
  app->add_option("--decoupled-min-lr", o.schedule.decoupled_min_lr,
                  "Final learning rate of the word embeddings and the output layer (default --min-lr; with "
                  "--decoupled-lr)")
      ->check(NonNegative());
  app->add_flag("--apply-wd-to-qk-layernorm", o.optimizer.apply_wd_to_qk_layernorm,
                "Weight decay on the query and key norms too (--qk-layernorm); other norms and biases still none");
  app->add_option("--no-weight-decay-cond-type", f->no_weight_decay_cond_type,
                  "apply_wd_to_qk_layernorm: Megatron's deprecated form of --apply-wd-to-qk-layernorm");
  app->add_option("--adam-beta1", o.optimizer.adam_beta1, "AdamW beta1")->check(RealIn(0, false, 1, true));
  app->add_option("--adam-beta2", o.optimizer.adam_beta2, "AdamW beta2")->check(RealIn(0, false, 1, true));
  app->add_option("--adam-eps", o.optimizer.adam_eps, "AdamW epsilon")->check(Positive());
  app->add_option("--clip-grad", o.optimizer.clip_grad, "Clip the global gradient norm to this (0: off)")
      ->check(NonNegative());
}

// Megatron's fill-in-the-middle dataset (GPTFIMDataset): trainer/fim_codec.h.
void AddFimFlags(CLI::App* app, FimOptions* fim) {
  app->add_flag("--fim-data", fim->enabled,
                "Fill-in-the-middle samples (Megatron's GPTFIMDataset; needs --num-workers 0, see docs/ptk-train.md)");
  app->add_option("--fim-rate", fim->rate, "--fim-data: probability that a segment becomes FIM (default 0.5)")
      ->check(RealIn(0, false, 1, false));
  app->add_option("--fim-spm-rate", fim->spm_rate,
                  "--fim-data: probability that a FIM segment is SPM instead of PSM (default 0.5)")
      ->check(RealIn(0, false, 1, false));
  app->add_option("--fim-split-sample", fim->split_sample,
                  "--fim-data: a token (vocab.json's spelling) splitting segments into fragments, each FIM'd apart");
  app->add_option("--fim-fragment-rate", fim->fragment_rate,
                  "--fim-data: probability that a fragment becomes FIM (needed with --fim-split-sample)")
      ->check(RealIn(0, false, 1, false));
  app->add_option("--fim-no-prefix", fim->no_prefix,
                  "--fim-data: leave segments whose text starts with this as they are");
  app->add_option("--fim-prefix-token", fim->prefix_token, "--fim-data: the prefix sentinel token (<fim_prefix>)");
  app->add_option("--fim-middle-token", fim->middle_token, "--fim-data: the middle sentinel token (<fim_middle>)");
  app->add_option("--fim-suffix-token", fim->suffix_token, "--fim-data: the suffix sentinel token (<fim_suffix>)");
  app->add_option("--fim-pad-token", fim->pad_token, "--fim-data: the token padding a shortened sample (<fim_pad>)");
  app->add_option("--fim-eod-token", fim->eod_token, "--fim-data: the token separating the segments (<|endoftext|>)");
}

void AddDataFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  // A list given twice: its last occurrence, as argparse (cli::Parse, for every tool).
  app->add_option("--data-path", o.data.data_path, "Dataset prefixes, optionally weighted: [W1] P1 [W2] P2 ...");
  app->add_option("--train-data-path", o.data.per_split_data_path[0], "Prefixes of the train split only");
  app->add_option("--valid-data-path", o.data.per_split_data_path[1], "Prefixes of the validation split only");
  app->add_option("--test-data-path", o.data.per_split_data_path[2], "Prefixes of the test split only");
  app->add_option("--split", o.data.split, "Train/valid/test proportions of --data-path");
  app->add_option("--seed", f->seed, "Random seed (init, data order, dropout)")->check(IntIn(0, 4294967295));
  app->add_option("--data-cache-path", f->data_cache_path, "Where the dataset index caches go");
  app->add_option("--mid-level-dataset-surplus", o.mid_level_dataset_surplus,
                  "Of a blend, each dataset builds its share of the samples times 1 + this (default 0.005)")
      ->check(RealIn(0, false, 1e6, false));
  app->add_flag("--mock-data", o.mock_data, "Synthetic data instead of --data-path");
  app->add_option("--per-dataset-sequences-path", f->per_dataset_sequences_path,
                  "Megatron's JSON of each prefix's [sequences, document indices]: checked against each .idx header, "
                  "which ptk reads (refused where they differ)");
  app->add_option("--vocab-file", o.vocab_file, "GPT-2 vocab.json (default: ptk's built-in GPT-2 files)");
  app->add_option("--merge-file", o.merge_file, "GPT-2 merges.txt (default: ptk's built-in GPT-2 files)");
  app->add_option("--tokenizer-type", f->tokenizer_type, "GPT2BPETokenizer (the only one ptk has)");
  app->add_option("--dataloader-type", f->dataloader_type, "single (Megatron's pretraining sampler)");
  app->add_flag("--eod-mask-loss", o.eod_mask_loss, "No loss on end-of-document tokens");
  app->add_flag("--calculate-per-token-loss", o.optimizer.calculate_per_token_loss,
                "Weigh every token's loss by 1 / the global batch's tokens (default: Megatron's mean over each "
                "micro-batch's tokens on each data and context rank)");
  app->add_flag("--reset-position-ids", o.reset_position_ids, "Restart positions after each end-of-document token");
  app->add_flag("--reset-attention-mask", f->reset_attention_mask,
                "Not supported: attention is causal over the whole sequence");
  AddFimFlags(app, &o.fim);
}

// Evaluation: how often, how much, Megatron's evaluation modes.
void AddEvaluationFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  app->add_option("--eval-interval", o.eval_interval, "Evaluate on the validation split every N iterations")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--eval-iters", o.eval_iters, "Global batches per evaluation (0: none)")->check(IntIn(0, kMaxCount));
  app->add_flag("--skip-train", o.skip_train,
                "Train no iteration: evaluate the weights --load restores (or the random initialization without "
                "--load) on the validation sets and the test split, as after training, then exit; nothing is saved");
  app->add_flag("--full-validation", o.full_validation,
                "Each evaluation reads one whole epoch of the validation split (every sample once, from the first) "
                "instead of --eval-iters global batches");
  app->add_flag("--multiple-validation-sets", o.multiple_validation_sets,
                "Evaluate each --valid-data-path prefix as a set of its own ('validation-0 loss at ...', TensorBoard's "
                "'lm loss validation-0'); needs --full-validation or --skip-train");
}

// Logging, checkpoints.
void AddLoggingAndCheckpointFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  app->add_option("--log-interval", o.log_interval, "Print the log line every N iterations")
      ->check(IntIn(1, kMaxCount));
  app->add_flag("--log-throughput", o.tensorboard.log_throughput,
                "Add the throughput per GPU (TFLOP/s/GPU) to the log line, as Megatron's (and write it to TensorBoard "
                "with --log-timers-to-tensorboard)");
  app->add_option("--tensorboard-dir", o.tensorboard.dir,
                  "Write TensorBoard event files (Megatron's scalars) and metrics.jsonl to this directory");
  app->add_option("--tensorboard-log-interval", o.tensorboard.log_interval,
                  "Write the per-iteration scalars every N iterations")
      ->check(IntIn(1, kMaxCount));
  app->add_flag("!--no-log-loss-scale-to-tensorboard", o.tensorboard.log_loss_scale,
                "Do not write loss-scale to TensorBoard");
  app->add_flag("--log-validation-ppl-to-tensorboard", o.tensorboard.log_validation_ppl,
                "Write the validation perplexity to TensorBoard");
  app->add_flag("--log-world-size-to-tensorboard", o.tensorboard.log_world_size,
                "Write the number of ranks to TensorBoard");
  app->add_flag("--log-timers-to-tensorboard", o.tensorboard.log_timers,
                "Write iteration-time (and throughput, with --log-throughput) and the --timing-log-level timers "
                "(<name>-time, the slowest rank's seconds per iteration) to TensorBoard");
  app->add_option("--timing-log-level", o.timing_log_level,
                  "Megatron's timers printed after each log line: 0 none (default), 1 forward-backward, the "
                  "gradient reductions and the optimizer's parts, 2 also the batch generator, forward and backward "
                  "compute and the pipeline exchanges")
      ->check(IntIn(0, kMaxTimingLogLevel));
  app->add_option_function<std::string>(
         "--timing-log-option",
         [&o](const std::string& v) { o.timing_log_option = ParseTimingLogOption(v).value_or(o.timing_log_option); },
         "The timers across ranks: minmax (default; the fastest and slowest rank), max (the slowest), all (every rank)")
      ->check(CLI::IsMember({"max", "minmax", "all"}));
  app->add_flag("!--no-barrier-with-level-1-timing", o.barrier_with_l1_time,
                "Start the level-1 timers without Megatron's barrier over all ranks (each rank's own times)");
  auto* sample_interval = app->add_option("--sample-interval", o.sample.interval,
                                          "ptk: print a continuation of --sample-prompt every N iterations (0: never)")
                              ->check(IntIn(0, kMaxCount));
  // Without --sample-interval no sample is printed: a sample flag alone is a mistake, not a no-op.
  app->add_option("--sample-prompt", o.sample.prompt_text,
                  "ptk: the text a sample continues (default: <|endoftext|>, an unconditional sample)")
      ->needs(sample_interval);
  app->add_option("--sample-length", o.sample.length, "ptk: tokens per sample (32)")
      ->check(IntIn(1, 4096))
      ->needs(sample_interval);
  app->add_option("--sample-temperature", o.sample.temperature,
                  "ptk: 0 (default) picks the likeliest token; above 0 draws, keyed by --seed and the iteration")
      ->check(RealIn(0, false, 100, false))
      ->needs(sample_interval);
  app->add_option("--metrics-file", f->metrics_file,
                  "ptk: per-iteration metrics as JSON lines (default TENSORBOARD_DIR/metrics.jsonl)");
  app->add_option("--save", o.save, "Checkpoint directory to write");
  app->add_option("--load", o.load, "Checkpoint directory to resume from");
  ptk::cli::AddLockWait(*app, &o.lock_wait);  // --save's, --tensorboard-dir's and --metrics-file's locks
  app->add_option("--save-interval,--persistent-save-interval", o.save_interval, "Save every N iterations")
      ->check(IntIn(0, kMaxCount));
  app->add_option("--exit-interval", o.exit_interval, "Save and exit when the iteration is a multiple of N")
      ->check(IntIn(0, kMaxCount));
  app->add_option("--exit-duration-in-mins", o.exit_duration_in_mins,
                  "Save and exit after this many minutes (from the process's start)")
      ->check(NonNegative());
  app->add_flag("--exit-signal-handler", f->exit_signal_handler,
                "Save and exit on SIGTERM (and SIGUSR1, for Slurm's --signal)");
  app->add_option("--exit-signal", f->exit_signal,
                  "The signal of --exit-signal-handler: SIGTERM (default), SIGUSR1 or SIGINT, which it saves on "
                  "alike; others refused");
  app->add_flag(
      "--no-load-optim", o.no_load_optim,
      "Do not restore the optimizer state (AdamW's moments and the learning-rate schedule, which starts anew)");
  app->add_flag("--no-load-rng", o.no_load_rng, "Do not restore the random seed");
  app->add_flag("--finetune", o.finetune, "Load weights only; iteration and data start at 0");
  app->add_flag("--no-initialization", o.no_initialization,
                "Skip the weights' random init: every weight comes from the checkpoint --load (or "
                "--pretrained-checkpoint) loads; refused where there is none");
  app->add_option("--pretrained-checkpoint", o.pretrained_checkpoint,
                  "Where --load holds no checkpoint: fine-tune from this directory's (as --finetune); a restart "
                  "resumes from --load's own");
  app->add_flag("--exit-on-missing-checkpoint", o.exit_on_missing_checkpoint,
                "Stop (exit 1) when --load holds no checkpoint, instead of starting from random initialization");
  app->add_option("--ckpt-step", o.ckpt_step,
                  "Load the checkpoint of this iteration from --load instead of the one its "
                  "latest_checkpointed_iteration.txt names")
      ->check(IntIn(0, kMaxCount));
  app->add_flag("--override-opt_param-scheduler,--override-opt-param-scheduler", f->override_opt_param_scheduler,
                "On resume, take the learning-rate schedule of this command line where the checkpoint's differs");
  app->add_flag("--use-checkpoint-opt_param-scheduler,--use-checkpoint-opt-param-scheduler",
                f->use_checkpoint_opt_param_scheduler,
                "On resume, keep the checkpoint's learning-rate schedule where this command line's differs (default: "
                "stop, naming what differs)");
  app->add_flag("--check-for-nan-in-loss-and-grad,!--no-check-for-nan-in-loss-and-grad",
                o.check_for_nan_in_loss_and_grad,
                "Stop when the loss or the gradient norm is NaN/Inf (default; --no-...: skip the iteration instead)");
}

// Precision, device, fp16's loss scaling.
void AddPrecisionFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  app->add_flag("--fp16", f->fp16,
                "fp16 mixed precision with dynamic loss scaling (--device cuda; fp32 master weights, moments, loss)");
  app->add_flag("--bf16", f->bf16, "bf16 mixed precision (--device cuda; fp32 master weights, moments, loss)");
  app->add_flag("--disable-bf16-reduced-precision-matmul", f->disable_bf16_reduced_precision_matmul,
                "With --bf16 (--device cuda): the products' split-K partial sums in fp32, never in bf16 (torch's "
                "allow_bf16_reduced_precision_reduction = False); without --bf16 no effect (as Megatron)");
  app->add_option("--device", f->device,
                  "ptk: cpu or cuda (default: cuda where this build has CUDA and a GPU is visible, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_flag("--ptk-profile-ops", o.backend.profile,
                "ptk: time every CUDA op with events and print the GPU time per iteration by op at the end");
  app->add_flag("--deterministic-mode", o.backend.deterministic,
                "Bitwise-reproducible kernels only: two runs give identical loss lines (the CPU backend always is)");
  app->add_option("--loss-scale", f->loss_scale, "fp16: a constant loss scale instead of dynamic scaling")
      ->check(RealIn(0, true, 1e300, false));
  app->add_option("--initial-loss-scale", f->initial_loss_scale, "fp16: the dynamic loss scale's start (2^32)")
      ->check(RealIn(0, true, 1e300, false));
  app->add_option("--min-loss-scale", f->min_loss_scale, "fp16: the dynamic loss scale's floor (1)")
      ->check(RealIn(0, true, 1e300, false));
  app->add_option("--loss-scale-window", f->loss_scale_window, "fp16: good steps before the scale doubles (1000)")
      ->check(RealIn(1, false, 1e15, false));
  app->add_option("--hysteresis", f->hysteresis, "fp16: overflows tolerated before the scale halves (2)")
      ->check(IntIn(1, kMaxSize));
}

// Parallelism (tensor, pipeline, context, data: ZeRO-1, buckets, the backend and its timeout), --dry-run, threads.
void AddParallelFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  app->add_option("--tensor-model-parallel-size", f->tensor_model_parallel_size,
                  "Tensor-parallel ranks (Megatron's layers split over adjacent ranks; gloo on the CPU, NCCL on GPUs): "
                  "WORLD_SIZE = this x data-parallel ranks x pipeline stages (1)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--pipeline-model-parallel-size", f->pipeline_model_parallel_size,
                  "Pipeline stages: the layers split over P stages, Megatron's 1F1B schedule (gloo or NCCL)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--context-parallel-size", f->context_parallel_size,
                  "Context-parallel ranks (CPU backend over gloo; CUDA over NCCL): each sample's positions "
                  "split over C ranks in 2C chunks "
                  "(Megatron's load-balanced split), attention over the whole causal context; WORLD_SIZE = T x C x "
                  "data-parallel ranks x P; with data, tensor (and --sequence-parallel) and pipeline parallelism (1)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--cp-comm-type", f->cp_comm_type,
                  "Context parallelism's attention exchange: allgather (the keys and values all-gathered over the "
                  "context ranks) or p2p (Megatron's default; ptk runs it as allgather: the same attention); a2a and "
                  "a2a+p2p are refused (p2p)")
      ->check(CLI::IsMember({"p2p", "a2a", "allgather", "a2a+p2p"}));
  app->add_option("--decoder-first-pipeline-num-layers", f->decoder_first_pipeline_num_layers,
                  "Layers of the first pipeline stage (the rest split evenly)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--decoder-last-pipeline-num-layers", f->decoder_last_pipeline_num_layers,
                  "Layers of the last pipeline stage (the rest split evenly)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--num-layers-per-virtual-pipeline-stage", f->num_layers_per_virtual_pipeline_stage,
                  "Layers of each model chunk: Megatron's interleaved 1F1B schedule over (layers / stages) / this "
                  "chunks per stage")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--num-virtual-stages-per-pipeline-rank", f->num_virtual_stages_per_pipeline_rank,
                  "Model chunks per pipeline stage: Megatron's interleaved 1F1B schedule")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--microbatch-group-size-per-virtual-pipeline-stage", f->microbatch_group_size_per_vp_stage,
                  "With model chunks: the micro-batches run in a row on one chunk before the next (default: "
                  "--pipeline-model-parallel-size); from it to the micro-batches of a step. Only the order changes")
      ->check(IntIn(1, kMaxSize));
  app->add_flag("--dry-run", f->dry_run,
                "ptk: print the plan of this run on WORLD_SIZE ranks (any tensor and pipeline size): Megatron's "
                "layout, start-up and parameter lines, memory per GPU; then exit without building the model");
  app->add_option("--gpus-per-node", f->gpus_per_node,
                  "ptk: GPUs per node for --dry-run (default LOCAL_WORLD_SIZE, else SLURM_GPUS_ON_NODE)")
      ->check(IntIn(1, 65536));
  app->add_flag("--sequence-parallel", o.backend.sequence_parallel,
                "With --tensor-model-parallel-size above 1: LayerNorm, dropout and the residual split along the "
                "sequence over the tensor ranks (all-gather before the column-parallel products, reduce-scatter "
                "after the row-parallel ones)");
  app->add_flag("--use-distributed-optimizer", o.use_distributed_optimizer,
                "ZeRO-1: each data-parallel rank keeps and updates its shard of the optimizer state (AdamW's "
                "moments); gradients reduce-scattered, parameters all-gathered");
  app->add_option("--distributed-backend", f->distributed_backend,
                  "nccl (one process per GPU) or gloo (CPU ranks; GPUs through host memory); default: nccl with "
                  "--device cuda, gloo on the CPU")
      // The Neuron tutorial's xla (Trainium) was "xla not in {nccl,gloo}; did you mean gloo?": no CPU
      // backend is what a Trainium user meant.
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            return v == "xla" ? "xla (AWS Neuron's torch-xla, Trainium) is not implemented: ptk trains on "
                                "NVIDIA GPUs (--device cuda, nccl) or on CPUs (gloo)"
                              : "";
          },
          "", "not xla"))
      ->check(CLI::IsMember({"nccl", "gloo"}));
  app->add_flag("--overlap-grad-reduce", o.optimizer.overlap_grad_reduce,
                "Reduce the gradients in buckets while the last micro-batch's backward still runs (the same sums as "
                "after backward)");
  app->add_option("--ddp-bucket-size", o.optimizer.ddp_bucket_size,
                  "Elements per bucket of --overlap-grad-reduce (default: Megatron's max(40M, 1M x data-parallel "
                  "size))")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--distributed-timeout-minutes", f->distributed_timeout_minutes,
                  "Rendezvous and collective timeout: a rank that waits longer for the others fails (ptk's default 5; "
                  "Megatron's 10)")
      ->check(RealIn(0, true, 1e6, false));
  app->add_option("--threads", f->threads,
                  "ptk: CPU threads per rank (default: this process's CPUs, its affinity mask capped by its cgroup CPU "
                  "quota; when it may use the whole machine, its cores, or the quota, split among the ranks on this "
                  "node)")
      ->check(IntIn(0, 65536));
}

// The flags of Megatron's logging, batch ramp, data files and profiling, and --help's required
// flags shown without a default.
void AddMoreTrainFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  app->add_flag("--log-params-norm", o.log_params_norm,
                "Log the L2 norm of the weights (log line 'params norm:', TensorBoard params-norm)");
  app->add_flag("--log-num-zeros-in-grad", o.log_num_zeros_in_grad,
                "Log the number of zeros among the gradients (log line 'num zeros:', TensorBoard num-zeros)");
  app->add_option("--rampup-batch-size", o.rampup_batch_size,
                  "START INCR SAMPLES: grow the global batch from START by INCR up to --global-batch-size over "
                  "SAMPLES samples (Megatron's ramp; with --train-samples)")
      ->expected(3)
      ->check(IntIn(1, kMaxCount))
      ->default_str("");
  app->add_option("--iterations-to-skip", o.iterations_to_skip,
                  "Iterations whose global batch is read and dropped (no step; after a loss spike from bad data): N "
                  "is the step that starts with N iterations done, the one whose log line would say N + 1; the "
                  "counter and consumed samples advance, the learning-rate schedule does not (Megatron's)")
      ->check(IntIn(-kMaxCount, kMaxCount))
      ->default_str("");
  app->add_option("--phase-transition-iterations", f->phase_transition_iterations,
                  "Comma-separated iterations where training phases end: save and exit there; each phase reads its "
                  "own training split (from one transition to the next, in global batches) from its first sample, "
                  "so the relaunch may give the next phase's data (Megatron's; with --train-samples)");
  app->add_flag("--decrease-batch-size-if-needed", o.decrease_batch_size_if_needed,
                "Where --micro-batch-size x data-parallel size does not divide --global-batch-size, train each "
                "iteration on its largest multiple within it and count the rest as skipped samples (Megatron's; "
                "not with --rampup-batch-size)");
  app->add_flag_callback(
         "--use-checkpoint-args",
         [app, f] {
           f->use_checkpoint_args = true;
           // The model's shape comes from --load's checkpoint: its flags are no longer required
           // (callbacks run before CLI11 checks the required options).
           for (const char* name : kCheckpointModelFlags) app->get_option(name)->required(false);
         },
         "Take the model's flags from --load's latest checkpoint (one given otherwise: the checkpoint's where "
         "Megatron forces it, else refused)")
      ->trigger_on_parse();
  app->add_option("--data-args-path", f->data_args_path,
                  "A file holding the --data-path arguments ([W1] P1 [W2] P2 ..., whitespace-separated)");
  app->add_option("--per-split-data-args-path", f->per_split_data_args_path,
                  "A JSON file {\"train\": [...], \"valid\": [...], \"test\": [...]} of per-split data paths");
  app->add_flag("--profile", f->profile,
                "Profile the run: ptk's per-op CUDA timing, printed at the end (as --ptk-profile-ops)");
  // A required flag's help says REQUIRED, with no default that does not exist (the value the
  // variable happens to hold before parsing).
  for (CLI::Option* opt : app->get_options())
    if (opt->get_required()) opt->default_str("");
}

}  // namespace

absl::Status ResolveFimFlags(const TrainFlags& f, const TrainOptions& o) {
  if (!o.fim.enabled) return absl::OkStatus();
  if (o.mock_data)
    return UsageError("--fim-data with --mock-data: Megatron's FIM dataset reads --data-path (refused, as Megatron)");
  auto workers = f.compat.find("--num-workers");
  if (workers == f.compat.end() || workers->second != "0")
    return UsageError(fmt::format(
        "--fim-data needs --num-workers 0 (given: {}): Megatron's loader workers (2 by default) each draw FIM from "
        "their own copy of the dataset's RNG, and ptk's one loader draws in Megatron's order with 0 workers only",
        workers == f.compat.end() ? "none, Megatron's default 2" : workers->second));
  return MakeFimConfig(o.fim, o.vocab_file, o.merge_file).status();  // the tokens, now, before any model is made
}

void AddTrainFlags(CLI::App* app, TrainFlags* f) {
  // As argparse: a flag given twice takes the last value (scripts append overrides); cli::Parse
  // makes every option of every tool so, lists too.
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  AddModelFlags(app, f);
  AddBatchAndOptimizerFlags(app, f);
  AddDataFlags(app, f);
  AddEvaluationFlags(app, f);
  AddLoggingAndCheckpointFlags(app, f);
  train_flags::AddCheckpointKeepingFlags(app, f);
  AddPrecisionFlags(app, f);
  AddParallelFlags(app, f);
  train_flags::AddCompatFlags(app, f);
  train_flags::AddMegatronTableFlags(app, f);
  AddMoreTrainFlags(app, f);
}

cli::UnknownFlagHints LauncherFlagHints() {
  // What TrainingRanksFromEnv (common/slurm_env.h) reads: torchrun's variables, else srun's.
  const std::string start =
      "start the ranks with torchrun (torchrun --no-python --nproc-per-node N ptk-train ...) or srun";
  cli::UnknownFlagHints hints = {
      {"--rank",
       "ptk-train, as Megatron, reads its rank from the launcher's environment: RANK with WORLD_SIZE "
       "(torchrun sets both), or srun's SLURM_PROCID with SLURM_STEP_NUM_TASKS; " +
           start},
      {"--world-size",
       "ptk-train, as Megatron, reads the number of ranks from the launcher's environment: "
       "WORLD_SIZE with RANK (torchrun sets both), or srun's SLURM_STEP_NUM_TASKS; " +
           start},
  };
  for (const char* flag : {"--master-addr", "--master-port"})
    hints[flag] =
        "torchrun's flag, not the program's: give it to torchrun before the program; ptk-train, as Megatron, reads "
        "MASTER_ADDR and MASTER_PORT from the environment (torchrun sets them; under srun, the step's first node "
        "and a port from SLURM_JOB_ID)";
  // torchrun's own flags (torch 2.6's --help): its launch's, and its workers' logs (--log-dir, --tee).
  for (const char* flag : {"--nnodes",           "--nproc-per-node",
                           "--node-rank",        "--rdzv-endpoint",
                           "--rdzv-backend",     "--rdzv-id",
                           "--rdzv-conf",        "--standalone",
                           "--max-restarts",     "--no-python",
                           "--log-dir",          "--tee",
                           "--redirects",        "--local-ranks-filter",
                           "--logs-specs",       "--role",
                           "--monitor-interval", "--start-method",
                           "--run-path",         "--local-addr"})
    hints[flag] =
        "torchrun's flag, not the program's: give it to torchrun before the program (torchrun --no-python "
        "--nproc-per-node 8 ptk-train ...), which starts each rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
        "MASTER_PORT set";
  return hints;
}

}  // namespace ptk
