// The rest of Megatron-LM's pretrain_gpt.py flags (tests/data/trainer/megatron_gpt_flags.txt lists them
// all, from Megatron's own parser; megatron_flag_list_test checks each is declared): those that change
// no result here (logging, tuning, kernel choice, other scripts' settings) are accepted with a note,
// those of a feature ptk lacks are refused naming what is missing. Grouped by reason.
#include <sstream>
#include <string>
#include <vector>

#include "common/cli.h"
#include "tools/train_flag_parts.h"

namespace ptk::train_flags {
namespace {

// One reason and its flags, space-separated: "--flag" takes nothing (argparse's store_true), "--flag="
// one value, "--flag=+" one or more (nargs '+' or '*').
struct Group {
  bool refuse;
  const char* why;
  const char* flags;
};
// clang-format off
constexpr Group kGroups[] = {
    {false, "ptk writes no per-layer MoE values (Megatron writes them to TensorBoard and W&B only); the iteration line "
            "has load_balancing_loss",
     "--moe-per-layer-logging"},
    {false, "this log or monitor is not kept here: ptk logs Megatron's iteration line, metrics.jsonl and the TensorBoard scalars",
     "--app-tag-run-name= --app-tag-run-version= --config-logger-dir= "
     "--disable-log-loss-scale-to-tensorboard --disable-straggler-on-startup --log-device-memory-used "
     "--log-energy --log-max-attention-logit --log-memory-interval= --log-straggler --logging-level= "
     "--memory-snapshot-path= --no-one-logger --one-logger-async --one-logger-project= "
     "--one-logger-run-name= --profile-ranks=+ --record-memory-history --run-workload-inspector-server "
     "--straggler-ctrlr-port= --straggler-minmax-count= --use-pytorch-profiler --wandb-entity= "
     "--wandb-save-dir="},
    {false, "read only by Megatron's BERT, T5, vision and retrieval scripts; pretrain_gpt.py does not use it",
     "--bert-embedder-type= --bert-load= --bert-no-binary-head --biencoder-projection-dim= "
     "--biencoder-shared-query-context-model --block-data-path= --classes-fraction= "
     "--data-per-class-fraction= --dino-bottleneck-size= --dino-freeze-last-layer= "
     "--dino-head-hidden-size= --dino-local-crops-number= --dino-local-img-size= "
     "--dino-norm-last-layer --dino-teacher-temp= --dino-warmup-teacher-temp= "
     "--dino-warmup-teacher-temp-epochs= --embedding-path= --evidence-data-path= --ict-head-size= "
     "--ict-load= --img-h= --img-w= --indexer-batch-size= --indexer-log-interval= --iter-per-epoch= "
     "--mask-factor= --mask-prob= --mask-type= --num-channels= --num-classes= --output-bert-embeddings "
     "--patch-dim= --query-in-block-prob= --relative-attention-max-distance= "
     "--relative-attention-num-buckets= --retriever-report-topk-accuracies=+ --retriever-score-scaling "
     "--short-seq-prob= --swin-backbone-type= --titles-data-path= --use-one-sent-docs "
     "--vision-backbone-type= --vision-pretraining --vision-pretraining-type="},
    {false, "a setting of Megatron's inference engine; pretraining does not read it",
     "--cache-mla-latents --decode-only-cuda-graphs --disable-chunked-prefill --enable-chunked-prefill "
     "--flash-decode --inference-batch-times-seqlen-threshold= --inference-coordinator-port= "
     "--inference-dynamic-batching --inference-dynamic-batching-block-size= "
     "--inference-dynamic-batching-buffer-size-gb= --inference-dynamic-batching-cuda-graph-max-tokens= "
     "--inference-dynamic-batching-cuda-graph-mixed-prefill-count= "
     "--inference-dynamic-batching-max-requests= --inference-dynamic-batching-max-tokens= "
     "--inference-dynamic-batching-num-cuda-graphs= "
     "--inference-dynamic-batching-paused-buffer-size-gb= "
     "--inference-dynamic-batching-track-paused-request-events "
     "--inference-dynamic-batching-unified-memory-level= --inference-fuse-tp-communication "
     "--inference-logging-step-interval= --inference-max-batch-size= --inference-max-requests= "
     "--inference-max-seq-length= --inference-rng-tracker --inference-wandb-logging "
     "--max-tokens-to-oom= --mlp-chunks-for-prefill= --nccl-all-reduce-for-prefill "
     "--no-inference-wandb-logging --symmetric-ar-type= --use-legacy-static-engine"},
    {false, "communication tuning (buckets, overlap, streams, process groups, buffer registration): ptk's collectives are its own (same results)",
     "--create-all-gather-group --ddp-average-in-collective --ddp-num-buckets= --ddp-pad-buckets-for-high-nccl-busbw "
     "--defer-embedding-wgrad-compute --delay-wgrad-compute "
     "--disable-clone-scatter-output-in-embedding --disable-gloo-process-groups "
     "--disable-symmetric-registration --distributed-timeout-seconds-after-init= "
     "--high-priority-stream-groups=+ --lazy-mpu-init= --nccl-communicator-config-path= "
     "--no-align-grad-reduce --no-align-param-gather --no-clone-scatter-output-in-embedding "
     "--no-gradient-reduce-div-fusion --overlap-param-gather-with-optimizer-step "
     "--sharp-enabled-group= --train-sync-interval= --use-nccl-ub --use-tp-pp-dp-mapping "
     "--wgrad-deferral-limit="},
    {false, "pipeline-parallel transfer tuning: ptk's point-to-point transfers are its own (same results)",
     "--no-overlap-p2p-communication --no-scatter-gather-tensors-in-pipeline "
     "--overlap-p2p-communication-warmup-flush --pipeline-model-parallel-comm-backend= "
     "--use-ring-exchange-p2p"},
    {false, "kernel choice",
     "--cross-entropy-fusion-impl= --disable-jit-fuser"},
    {false, "no CUDA graphs are captured",
     "--cuda-graph-impl= --cuda-graph-scope=+ --cuda-graph-warmup-steps= --enable-cuda-graph "
     "--external-cuda-graph"},
    {false, "the tensor-parallel collectives are not overlapped with compute",
     "--disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag "
     "--disable-tp-comm-overlap-rs --disable-tp-comm-split-ag --disable-tp-comm-split-rs "
     "--no-tp-comm-bulk-dgrad --no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag --no-tp-comm-overlap-rs "
     "--no-tp-comm-split-ag --no-tp-comm-split-rs --tp-comm-bootstrap-backend= --tp-comm-overlap-cfg= "
     "--tp-comm-overlap-rs-dgrad"},
    {false, "nothing is offloaded to the CPU: activations and optimizer state stay on the device (memory only)",
     "--cpu-offloading-num-layers= --fine-grained-activation-offloading --min-offloaded-tensor-size= "
     "--no-pin-cpu-grads --no-pin-cpu-params --offload-modules=+ --optimizer-cpu-offload "
     "--optimizer-offload-fraction= --overlap-cpu-optimizer-d2h-h2d "
     "--use-torch-optimizer-for-cpu-offload"},
    {false, "checkpoints are ptk's single-file format in Megatron's directory layout",
     "--auto-detect-ckpt-format --disable-ckpt-fully-parallel-save --dist-ckpt-format= "
     "--dist-ckpt-optim-fully-reshardable --dist-ckpt-save-pre-mcore-014 --dist-ckpt-strictness= "
     "--distrib-optim-fully-reshardable-mem-efficient --no-ckpt-fully-parallel-save --use-dist-ckpt"},
    {false, "this check is not run here (--check-for-nan-in-loss-and-grad, the default, stops on a NaN or infinite loss or gradient norm)",
     "--check-for-large-grads --check-for-spiky-loss --check-weight-hash-across-dp-replicas-interval= "
     "--rerun-mode= --result-rejected-tracker-filename= --test-mode"},
    {false, "the dataset indices are ptk's own, read through mmap (the same samples)",
     "--dataloader-defer-npy-index-mmap --dataloader-fast-cache-load "
     "--exit-signal-handler-for-dataloader --no-data-sharding"},
    {false, "dropout masks are ptk's own function of --seed and the sample's position, not drawn by Megatron's RNG trackers",
     "--te-rng-tracker"},
    {false, "the weights are the same as without it: Megatron draws each data rank's init from its own seed, then "
            "broadcasts data rank 0's weights to the others; its dropout streams then differ between data ranks, "
            "as ptk's masks always do (keyed by the sample, not the rank)",
     "--data-parallel-random-init"},
    {false, "the rank comes from the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE)",
     "--local-rank="},
    {false, "no garbage collector",
     "--disable-manual-gc-eval --no-manual-gc-eval"},
    {false, "paths are local files (no Multi-Storage Client)",
     "--disable-msc"},
    {false, "ptk recomputes the attention probabilities (selective), whatever --recompute-granularity asks",
     "--recompute-modules=+"},
    {false, "Megatron ignores it (deprecated)",
     "--disable-async-tensor-model-parallel-allreduce"},
    {false, "it only matters with fp8, which ptk does not train",
     "--disable-fp8-wgrad --no-fp8-wgrad"},
    {false, "the activation functions are ptk's own (the same functions)",
     "--use-te-activation-func"},
    {false, "only Megatron's BERT and SentencePiece tokenizers read it; its GPT2BPETokenizer, as ptk-train's, does not",
     "--vocab-extra-ids="},
    {false, "the GPT-2 tokenizer has no pad token: no token is masked as padding either way",
     "--allow-ambiguous-pad-tokens"},
    {false, "Megatron's training code does not read it",
     "--sample-rate="},
    {false, "no ONNX export here",
     "--onnx-safe="},
    {false, "only read with --optimizer sgd; ptk's optimizer is Adam",
     "--sgd-momentum="},
    {false, "no tokenizer model is read from the checkpoint (ptk-train reads GPT-2 BPE data)",
     "--disable-use-tokenizer-model-from-checkpoint-args --no-use-tokenizer-model-from-checkpoint-args"},
    {true, "this mixture-of-experts feature is not implemented: ptk's MoE is top-k routing (dropless or with an "
           "expert capacity) with softmax or sigmoid scores (no jitter), SequentialMLP experts (and shared "
           "experts), aux_loss, seq_aux_loss, global_aux_loss or none",
     "--ep-overlap-early-attn-memory-release "
     "--moe-apply-probs-on-input "
     "--moe-deepep-num-sms= --moe-enable-deepep --moe-enable-routing-replay "
     "--moe-extended-tp "
     "--moe-flex-dispatcher-backend= --moe-hybridep-num-sms= "
     "--moe-input-jitter-eps= --moe-latent-size= --moe-layer-recompute "
     "--moe-pad-experts-for-cuda-graph-inference "
     "--moe-router-force-load-balancing --moe-router-fusion "
     "--moe-router-padding-for-fp8 --moe-router-padding-for-quantization "
     "--moe-upcycling-granularity= --moe-use-legacy-grouped-gemm "
     "--moe-use-upcycling --overlap-moe-expert-parallel-comm "
     "--use-fused-weighted-squared-relu"},
    {true, "Mamba and hybrid models are not implemented",
     "--disable-mamba-mem-eff-path --hybrid-attention-ratio= --hybrid-mlp-ratio= "
     "--hybrid-override-pattern= --is-hybrid-model --mamba-head-dim= --mamba-num-groups= "
     "--mamba-num-heads= --mamba-state-dim="},
    {true, "this attention variant is not implemented; ptk's attention is Megatron's dense causal softmax attention",
     "--dsa-indexer-head-dim= --dsa-indexer-loss-coeff= --dsa-indexer-n-heads= "
     "--dsa-indexer-topk= --dsa-indexer-use-sparse-loss --experimental-attention-variant= "
     "--linear-attention-freq= --linear-conv-kernel-dim= --linear-key-head-dim= "
     "--linear-num-key-heads= --linear-num-value-heads= --linear-value-head-dim="},
    {true, "heterogeneous layer configurations are not implemented; every layer has the same shape",
     "--heterogeneous-layers-config-encoded-json= --heterogeneous-layers-config-path="},
    {true, "fp8 and fp4 training are not implemented; use --bf16 or --fp16 on a GPU",
     "--first-last-layers-bf16 --fp4-format= --fp4-param-gather --fp4-quantizer-factory= --fp4-recipe= "
     "--fp8-amax-compute-algo= --fp8-amax-history-len= --fp8-interval= --fp8-margin= "
     "--fp8-param-gather --fp8-quantizer-factory= --fp8-recipe= --num-layers-at-end-in-bf16= "
     "--num-layers-at-start-in-bf16= --reuse-grad-buf-for-mxfp8-param-ag --te-precision-config-file="},
    {true, "Megatron's reinforcement learning and SFT training are not implemented; ptk-train pretrains",
     "--grpo-clamp-eps-lower= --grpo-clamp-eps-upper= --grpo-entropy-term-weight= "
     "--grpo-filter-groups-with-same-reward --grpo-group-size= --grpo-iterations= --grpo-kl-beta= "
     "--grpo-prompts-per-step= --langrl-env-config= --langrl-external-server "
     "--langrl-inference-server-conversation-template= --langrl-inference-server-type= "
     "--no-langrl-external-server --no-rl-inference-logprobs-is-correction "
     "--no-rl-offload-inference-model-weights-when-idle --no-rl-offload-kv-cache-during-training "
     "--no-rl-partial-rollouts --no-rl-remove-kv-cache-during-training --no-rl-reset-cuda-graphs "
     "--no-rl-skip-bos-token --no-rl-training-cuda-graphs --no-rl-use-sequence-packing "
     "--no-rl-verify-model-weights-swap --perform-rl-step --refit-method= --rl-default-temperature= "
     "--rl-default-top-k= --rl-default-top-p= --rl-importance-sampling-truncation-coef= "
     "--rl-inference-expert-model-parallel-size= --rl-inference-expert-tensor-model-parallel-size= "
     "--rl-inference-logprobs-is-correction --rl-inference-model-unified-memory-level= "
     "--rl-inference-pipeline-model-parallel-size= --rl-inference-tensor-model-parallel-size= "
     "--rl-offload-inference-model-weights-when-idle --rl-offload-kv-cache-during-training "
     "--rl-offload-optimizer-during-inference --rl-parallel-generation-tasks= --rl-partial-rollouts "
     "--rl-prompts-per-eval= --rl-remove-kv-cache-during-training --rl-reset-cuda-graphs "
     "--rl-sequence-packing-algo= --rl-sequence-packing-max-sequences-per-bin= --rl-skip-bos-token "
     "--rl-training-cuda-graphs --rl-use-sequence-packing --rl-verify-model-weights-swap --sft "
     "--sft-tokenizer-prompt-format="},
    {true, "FSDP is not implemented; --use-distributed-optimizer shards the optimizer state",
     "--data-parallel-sharding-strategy= --disable-strict-fsdp-dtensor-load "
     "--enable-full-sharding-in-hsdp --fsdp-double-buffer --fsdp-manual-registration "
     "--init-model-with-meta-device --keep-fp8-transpose-cache --no-strict-fsdp-dtensor-load "
     "--outer-dp-sharding-strategy= --suggested-communication-unit-size= "
     "--torch-fsdp2-no-reshard-after-forward --use-megatron-fsdp --use-torch-fsdp2"},
    {true, "TransformerEngine's precision-aware optimizer is not implemented: ptk's Adam keeps fp32 main parameters, gradients and moments",
     "--exp-avg-dtype= --exp-avg-sq-dtype= --main-grads-dtype= --main-params-dtype= "
     "--use-precision-aware-optimizer"},
    {true, "a choice of precision for the residual connections is not implemented",
     "--fp32-residual-connection"},
    {true, "the cross-entropy is computed in fp32; an fp16 one is not implemented",
     "--fp16-lm-cross-entropy"},
    {true, "gradients are reduced in fp32; a bf16 reduction is not implemented",
     "--ddp-reduce-scatter-with-fp32-accumulation --grad-reduce-in-bf16"},
    {true, "this parallelism is not implemented (ptk has tensor, pipeline with --num-layers-per-virtual-pipeline-stage, context and data parallelism)",
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
     "--hierarchical-context-parallel-sizes=+ --hybrid-context-parallel --max-seqlen-per-dp-cp-rank= "
     "--num-distributed-optimizer-instances= --pipeline-model-parallel-layout="},
    {true, "Megatron's vision fine-tuning flag: in megatron-core 0.16.1 no parameter group reads it (every group's "
     "lr_mult stays 1.0), so it would change nothing in a GPT run; ptk's groups take --decoupled-lr",
     "--head-lr-mult="},
    {true, "the map of parameters to optimizer groups is not written (ptk's groups: docs/ptk-train.md, "
     "--decoupled-lr)",
     "--dump-param-to-param-group-map="},
    {true, "this activation is not implemented (ptk has GELU, --swiglu and --squared-relu)",
     "--activation-func-clamp-value= --glu-linear-offset= --quick-geglu"},
    {true, "this rotary-embedding variant is not implemented (ptk has RoPE with --rotary-base, --rotary-percent and --use-rope-scaling)",
     "--mrope-section=+ --no-rope-freq="},
    {true, "this checkpoint feature is not implemented (ptk saves whole checkpoints: --save, and global non-persistent ones)",
     "--replication --replication-factor= --replication-jump= --save-dgrads-interval= --save-wgrads-interval="},
    {true, "not implemented: --load restores a checkpoint whole (--no-load-optim, --no-load-rng, --finetune leave parts out; --use-checkpoint-args takes the model's flags)",
     "--load-main-params-from-ckpt --use-mp-args-from-checkpoint-args"},
    {true, "checkpoints are converted by ptk-convert, not by ptk-train",
     "--ckpt-convert-format= --ckpt-convert-save= --ckpt-convert-update-legacy-dist-opt-format"},
    {true, "ptk-train reads GPT-2 BPE data (--tokenizer-type GPT2BPETokenizer, --vocab-file); no other tokenizer is used",
     "--legacy-tokenizer --tiktoken-num-special-tokens= --tiktoken-pattern= "
     "--tiktoken-special-tokens=+ --tokenizer-hf-include-special-tokens --tokenizer-hf-use-fast "
     "--tokenizer-metadata= --tokenizer-sentencepiece-legacy --tokenizer-special-tokens=+ "
     "--trust-remote-code"},
    {true, "object storage (S3, MSC) is not read; give local files",
     "--object-storage-cache-path="},
    {true, "Megatron's fault-tolerance machinery is not implemented; --exit-signal-handler saves on SIGTERM and a relaunch with --load resumes",
     "--adlr-autoresume --adlr-autoresume-interval= --calc-ft-timeouts --enable-ft-package "
     "--error-injection-rate= --error-injection-type= --ft-num-warmup-iters= "
     "--inprocess-active-world-size= --inprocess-barrier-timeout= --inprocess-completion-timeout= "
     "--inprocess-empty-cuda-cache --inprocess-granularity= --inprocess-hard-timeout= "
     "--inprocess-heartbeat-interval= --inprocess-heartbeat-timeout= --inprocess-last-call-wait= "
     "--inprocess-max-iterations= --inprocess-monitor-process-interval= "
     "--inprocess-monitor-thread-interval= --inprocess-progress-watchdog-interval= --inprocess-restart "
     "--inprocess-soft-timeout= --inprocess-termination-grace-time="},
    {true, "a YAML configuration is not read; give its settings as flags",
     "--yaml-cfg="},
    {true, "custom module specs are not implemented; ptk's model is Megatron-core's GPT layout",
     "--spec=+"},
    {true, "Megatron's experimental features are not implemented",
     "--enable-experimental"},
    {true, "a fake process group is not implemented; give --world-size 1 or launch the ranks",
     "--fake-process-group"},
    {true, "NVIDIA Kitchen's quantized kernels are not implemented",
     "--kitchen-attention-backend= --use-kitchen-attention"},
    {true, "--batch-size is no longer valid in Megatron; use --micro-batch-size",
     "--batch-size="},
    {true, "--warmup is no longer valid in Megatron; use --lr-warmup-fraction",
     "--warmup="},
    {true, "--model-parallel-size is no longer valid in Megatron; use --tensor-model-parallel-size",
     "--model-parallel-size="},
    {true, "--checkpoint-activations is no longer valid in Megatron; use --recompute-activations",
     "--checkpoint-activations"},
    {true, "a given padded vocabulary size is not implemented: the vocabulary is padded to a multiple of --make-vocab-size-divisible-by times --tensor-model-parallel-size, as Megatron does without this flag",
     "--padded-vocab-size="},
    {true, "batch-invariant kernels are not implemented",
     "--batch-invariant-mode"},
    {true, "encoder-decoder models are not implemented; give --num-layers and --seq-length",
     "--decoder-num-layers= --decoder-seq-length= --encoder-num-layers="},
    {true, "the Muon optimizer (and its QK-clip) is not implemented; ptk's optimizer is Adam",
     "--muon-extra-scale-factor= --muon-fp32-matmul-prec= --muon-momentum= --muon-no-split-qkv "
     "--muon-num-ns-steps= --muon-scale-mode= --muon-tp-mode= --muon-use-nesterov --qk-clip "
     "--qk-clip-alpha= --qk-clip-threshold="},
};
// clang-format on

struct TableFlag {
  std::string name;
  int takes;  // 0, 1, or 2: one or more
  const Group* group;
};

std::vector<TableFlag> Flags() {
  std::vector<TableFlag> out;
  for (const Group& g : kGroups) {
    std::istringstream in(g.flags);
    for (std::string w; in >> w;) {
      const size_t eq = w.find('=');
      out.push_back({w.substr(0, eq), eq == std::string::npos ? 0 : w.size() > eq + 1 ? 2 : 1, &g});
    }
  }
  return out;
}

}  // namespace

void AddMegatronTableFlags(CLI::App* app, TrainFlags* f) {
  for (const TableFlag& t : Flags()) {
    auto* given = t.group->refuse ? &f->refused : &f->compat;
    const std::string name = t.name;
    CLI::Option* opt = nullptr;
    if (t.takes == 0) {
      opt = app->add_flag_callback(name, [given, name] { (*given)[name] = ""; });
    } else if (t.takes == 1) {
      opt = app->add_option_function<std::string>(name, [given, name](const std::string& v) { (*given)[name] = v; });
    } else {
      opt = app->add_option_function<std::vector<std::string>>(name, [given, name](const std::vector<std::string>& v) {
        std::string all;
        for (const std::string& s : v) all += (all.empty() ? "" : " ") + s;
        (*given)[name] = all;
      });
      opt->expected(1, CLI::detail::expected_max_vector_size);
    }
    if (t.group->refuse)
      opt->description(std::string("Not supported: ") + t.group->why)->group(cli::kUnsupportedGroup);
    else
      opt->description(std::string("Accepted for compatibility: ") + t.group->why);
  }
}

const char* MegatronTableReason(const std::string& name, bool refuse) {
  static const std::vector<TableFlag> flags = Flags();
  for (const TableFlag& t : flags)
    if (t.name == name) return t.group->refuse == refuse ? t.group->why : nullptr;
  return nullptr;
}

}  // namespace ptk::train_flags
