// ptk checkpoint -> Megatron: the args Namespace, the scheduler's state, the optimizer's groups.
#include "interop/megatron_export_args.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include <fmt/core.h>

#include "interop/megatron_common.h"

namespace ptk::megatron_export {

using torchfmt::PyRef;
using torchfmt::PyValue;
using namespace megatron;  // NOLINT: the shared helpers

// A setting the ptk run recorded, as a number (fallback when absent).
double SettingNum(const TrainState& st, const std::string& flag, double fallback) {
  for (const auto& [k, v] : st.settings)
    if (k == flag) {
      char* end = nullptr;
      const double d = std::strtod(v.c_str(), &end);
      if (end != v.c_str() && *end == '\0') return d;
    }
  return fallback;
}
std::string SettingStr(const TrainState& st, const std::string& flag, const std::string& fallback) {
  for (const auto& [k, v] : st.settings)
    if (k == flag) return v;
  return fallback;
}

Hyper HyperOf(const TrainState& state) {
  Hyper h;
  h.lr = state.scheduler ? state.scheduler->max_lr : SettingNum(state, "--lr", 0);
  h.min_lr = state.scheduler ? state.scheduler->min_lr : SettingNum(state, "--min-lr", 0);
  h.wd = SettingNum(state, "--weight-decay", 0.01);
  h.b1 = SettingNum(state, "--adam-beta1", 0.9);
  h.b2 = SettingNum(state, "--adam-beta2", 0.999);
  h.eps = SettingNum(state, "--adam-eps", 1e-8);
  return h;
}

// The args Namespace: what Megatron's load checks (check_checkpoint_args) and its converter reads.
PyRef MegatronArgs(const ConvertOptions& o, const GPTConfig& c, const TrainState& state, const Hyper& h, int64_t vm,
                   const std::string& precision, int64_t vp) {
  const int64_t tp = o.target_tensor_parallel_size, pp = o.target_pipeline_parallel_size;
  PyRef ns_attrs = torchfmt::MakeDict();
  PyValue* a = ns_attrs.get();
  auto set_i = [&](const char* k, int64_t v) { torchfmt::DictSet(a, k, torchfmt::MakeInt(v)); };
  auto set_f = [&](const char* k, double v) { torchfmt::DictSet(a, k, torchfmt::MakeFloat(v)); };
  auto set_s = [&](const char* k, const std::string& v) { torchfmt::DictSet(a, k, torchfmt::MakeStr(v)); };
  auto set_b = [&](const char* k, bool v) { torchfmt::DictSet(a, k, torchfmt::MakeBool(v)); };
  auto set_none = [&](const char* k) { torchfmt::DictSet(a, k, torchfmt::MakeNone()); };
  set_i("num_layers", c.num_layers);
  set_i("hidden_size", c.hidden_size);
  set_i("ffn_hidden_size", c.ffn_hidden_size);
  set_i("num_attention_heads", c.num_attention_heads);
  set_i("kv_channels", c.head_dim());
  set_b("group_query_attention", c.query_groups() != c.num_attention_heads);
  set_i("num_query_groups", c.query_groups());
  set_i("max_position_embeddings", c.max_position_embeddings);
  set_i("seq_length", c.seq_length);
  set_s("position_embedding_type", c.rope()                                           ? "rope"
                                   : c.position_embedding == PositionEmbedding::kNone ? "none"
                                                                                      : "learned_absolute");
  set_b("add_position_embedding", c.position_embedding == PositionEmbedding::kLearnedAbsolute);
  set_f("rotary_base", c.rotary_base);
  set_f("rotary_percent", c.rotary_percent);
  set_b("rotary_interleaved", c.rotary_interleaved);
  set_b("use_rope_scaling", c.use_rope_scaling);
  set_f("rope_scaling_factor", c.rope_scaling_factor);
  // Megatron-LM's parser takes an integer factor (type=int); ptk's may be any positive number.
  if (const double f = c.rotary_seq_len_interpolation_factor; f > 0 && f == std::floor(f) && f < 1e15)
    set_i("rotary_seq_len_interpolation_factor", static_cast<int64_t>(f));
  else if (f > 0)
    set_f("rotary_seq_len_interpolation_factor", f);
  else
    set_none("rotary_seq_len_interpolation_factor");
  set_s("normalization", c.normalization == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm");
  set_f("norm_epsilon", c.layernorm_epsilon);
  set_f("layernorm_epsilon", c.layernorm_epsilon);  // the name of Megatron-LM before --norm-epsilon
  set_b("apply_layernorm_1p", c.apply_layernorm_1p);
  set_b("apply_residual_connection_post_layernorm", false);
  set_b("swiglu", c.swiglu);
  set_b("add_bias_linear", c.add_bias_linear);
  set_b("add_qkv_bias", c.qkv_bias());
  set_b("qk_layernorm", c.qk_layernorm);
  set_b("squared_relu", c.squared_relu);
  // Megatron's fused bias-GELU kernel (the tanh GELU); off: its GELU MLP runs torch's exact erf GELU, and its
  // arguments.py turns it off without biases.
  set_b("bias_gelu_fusion", c.add_bias_linear && !c.gelu_exact);
  set_b("untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights);
  set_f("hidden_dropout", c.hidden_dropout);
  set_f("attention_dropout", c.attention_dropout);
  set_f("init_method_std", c.init_method_std);
  set_b("init_method_xavier_uniform", c.init_method_xavier_uniform);
  set_i("vocab_size", c.vocab_size);
  set_i("padded_vocab_size", vm);
  set_i("make_vocab_size_divisible_by", o.make_vocab_size_divisible_by);
  set_s("tokenizer_type", "GPT2BPETokenizer");
  set_i("tensor_model_parallel_size", tp);
  set_i("pipeline_model_parallel_size", pp);
  if (vp > 1) {  // as Megatron's arguments.py derives it from --num-layers-per-virtual-pipeline-stage
    set_i("virtual_pipeline_model_parallel_size", vp);
    set_i("num_layers_per_virtual_pipeline_stage", o.target_num_layers_per_virtual_pipeline_stage);
  } else {
    set_none("virtual_pipeline_model_parallel_size");
    set_none("num_layers_per_virtual_pipeline_stage");
  }
  // Megatron-LM 0.16's args hold it always (TransformerConfig's field, --microbatch-group-size-per-virtual-
  // pipeline-stage): None unless given, TransformerConfig then taking the pipeline size. The run's group size
  // where the export is interleaved and it is not that default (a smaller one Megatron refuses); its load
  // neither takes nor checks it.
  const auto group = static_cast<int64_t>(SettingNum(state, "--microbatch-group-size-per-virtual-pipeline-stage", 0));
  if (vp > 1 && group > pp)
    set_i("microbatch_group_size_per_vp_stage", group);
  else
    set_none("microbatch_group_size_per_vp_stage");
  set_b("sequence_parallel", false);
  set_i("data_parallel_size", 1);
  set_i("world_size", tp * pp);
  SetMoeArgs(c, tp, a);  // num_experts None, or the mixture of experts' args
  SetMlaArgs(c, a);      // multi_latent_attention, and MLATransformerConfig's args
  SetMtpArgs(c, a);      // mtp_num_layers, mtp_loss_scaling_factor
  set_s("transformer_impl", o.saver_transformer_impl);
  set_s("ckpt_format", "torch");
  set_b("use_distributed_optimizer", o.target_use_distributed_optimizer);
  // The grad buffers' buckets: the layout distrib_optim.pt is written in.
  set_b("overlap_grad_reduce", o.target_ddp_bucket_size > 0);
  if (o.target_ddp_bucket_size > 0) set_i("ddp_bucket_size", o.target_ddp_bucket_size);
  set_b("accumulate_allreduce_grads_in_fp32", precision == "bf16");  // as Megatron-LM sets it under --bf16
  set_b("fp16", precision == "fp16");
  set_b("bf16", precision == "bf16");
  torchfmt::DictSet(a, "params_dtype",
                    torchfmt::MakeGlobal(precision == "bf16"   ? "torch.bfloat16"
                                         : precision == "fp16" ? "torch.float16"
                                                               : "torch.float32"));
  set_i("iteration", state.iteration);
  set_i("train_iters", static_cast<int64_t>(SettingNum(state, "--train-iters", 0)));
  set_i("micro_batch_size", static_cast<int64_t>(SettingNum(state, "--micro-batch-size", 1)));
  set_i("global_batch_size", static_cast<int64_t>(SettingNum(state, "--global-batch-size", 1)));
  set_i("consumed_train_samples", state.consumed_train_samples);
  set_i("consumed_valid_samples", state.consumed_valid_samples);
  set_i("skipped_train_samples", state.skipped_train_samples);
  set_i("seed", static_cast<int64_t>(state.seed));
  set_s("optimizer", "adam");
  set_f("lr", h.lr);
  set_f("min_lr", h.min_lr);
  set_s("lr_decay_style",
        state.scheduler ? state.scheduler->decay_style : SettingStr(state, "--lr-decay-style", "linear"));
  set_f("weight_decay", h.wd);
  set_f("adam_beta1", h.b1);
  set_f("adam_beta2", h.b2);
  set_f("adam_eps", h.eps);
  set_f("clip_grad", SettingNum(state, "--clip-grad", 1.0));
  set_b("calculate_per_token_loss", SettingStr(state, "--calculate-per-token-loss", "off") == "on");
  return torchfmt::MakeNamespace(ns_attrs);
}

// opt_param_scheduler's state_dict.
PyRef SchedulerState(const TrainState& state, const Hyper& h) {
  PyRef sched = torchfmt::MakeDict();
  const SchedulerConfig sc = state.scheduler.value_or(SchedulerConfig{});
  PyValue* d = sched.get();
  torchfmt::DictSet(d, "max_lr", torchfmt::MakeFloat(state.scheduler ? sc.max_lr : h.lr));
  // Megatron's is an int for a warm-up in iterations or samples, a float for a fraction of the decay.
  torchfmt::DictSet(d, "lr_warmup_steps",
                    sc.warmup_steps == std::floor(sc.warmup_steps)
                        ? torchfmt::MakeInt(static_cast<int64_t>(sc.warmup_steps))
                        : torchfmt::MakeFloat(sc.warmup_steps));
  torchfmt::DictSet(d, "num_steps", torchfmt::MakeInt(state.scheduler_num_steps));
  torchfmt::DictSet(d, "lr_decay_style", torchfmt::MakeStr(sc.decay_style));
  torchfmt::DictSet(d, "lr_decay_steps", torchfmt::MakeInt(sc.decay_steps));
  torchfmt::DictSet(d, "min_lr", torchfmt::MakeFloat(state.scheduler ? sc.min_lr : h.min_lr));
  torchfmt::DictSet(d, "start_wd", torchfmt::MakeFloat(sc.start_wd));
  torchfmt::DictSet(d, "end_wd", torchfmt::MakeFloat(sc.end_wd));
  torchfmt::DictSet(d, "wd_incr_style", torchfmt::MakeStr(sc.wd_incr_style));
  torchfmt::DictSet(d, "wd_incr_steps", torchfmt::MakeInt(sc.wd_incr_steps));
  return sched;
}

// One AdamW parameter group as Megatron's optimizer saves it.
PyRef AdamGroup(std::vector<PyRef> ids_list, double wd_mult, const Hyper& h) {
  PyRef g = torchfmt::MakeDict();
  PyValue* d = g.get();
  torchfmt::DictSet(d, "lr", torchfmt::MakeFloat(h.lr));
  torchfmt::DictSet(d, "betas", torchfmt::MakeTuple({torchfmt::MakeFloat(h.b1), torchfmt::MakeFloat(h.b2)}));
  torchfmt::DictSet(d, "eps", torchfmt::MakeFloat(h.eps));
  torchfmt::DictSet(d, "weight_decay", torchfmt::MakeFloat(h.wd * wd_mult));
  torchfmt::DictSet(d, "amsgrad", torchfmt::MakeBool(false));
  torchfmt::DictSet(d, "maximize", torchfmt::MakeBool(false));
  torchfmt::DictSet(d, "foreach", torchfmt::MakeNone());
  torchfmt::DictSet(d, "capturable", torchfmt::MakeBool(false));
  torchfmt::DictSet(d, "differentiable", torchfmt::MakeBool(false));
  torchfmt::DictSet(d, "fused", torchfmt::MakeNone());
  torchfmt::DictSet(d, "is_expert_parallel", torchfmt::MakeBool(false));
  torchfmt::DictSet(d, "default_config", torchfmt::MakeBool(true));
  torchfmt::DictSet(d, "wd_mult", torchfmt::MakeFloat(wd_mult));
  torchfmt::DictSet(d, "lr_mult", torchfmt::MakeFloat(1.0));
  torchfmt::DictSet(d, "is_decoupled_lr", torchfmt::MakeBool(false));
  torchfmt::DictSet(d, "max_lr", torchfmt::MakeFloat(h.lr));
  torchfmt::DictSet(d, "min_lr", torchfmt::MakeFloat(h.min_lr));
  torchfmt::DictSet(d, "params", torchfmt::MakeList(std::move(ids_list)));
  return g;
}

}  // namespace ptk::megatron_export
