"""Writes tests/data/trainer/gated_NAME.{json,bin}: megatron-core's own GPT with --attention-output-gate (Qwen3-Next's
gated attention) and --qk-l2-norm (Llama 4's query and key L2 norm) trained on the CPU, the golden of ptk's CPU
attention with them (tests/trainer/gated_attention_golden_test.cpp).

megatron-core 0.16.1 (/opt/ptk-pyref) builds a tiny GPTModel from its local (non-TE) spec
(get_gpt_layer_local_spec(qk_l2_norm=...): SelfAttention whose q_layernorm and k_layernorm are L2Norm with
--qk-l2-norm) from a TransformerConfig with attention_output_gate (linear_qkv's rows per query group: the group's
query heads, their gate heads, the key and the value head; the core attention's output times sigmoid(gate) before
linear_proj) and qk_l2_norm, with and without grouped-query attention. fp32, no dropout, on one gloo rank with the
CUDA calls pointed at the CPU (make_torch_dist_distopt_fixture.cpu_shims), wrapped in megatron-core's
DistributedDataParallel and stepped by its optimizer and OptimizerParamScheduler as gen_mla_golden.py does. Written:
the initial weights (init:NAME), the first step's gradients (grad:NAME), the weights after the last step
(final:NAME), and per step the lm loss and the grad norm.

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_gated_attention_golden.py tests/data/trainer
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_golden  # noqa: E402

STEPS = 3
COMMON = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, seq_length=8,
              max_position_embeddings=8, vocab_size=40, padded_vocab_size=40, micro_batch_size=2,
              num_micro_batches=2, lr=1e-2, min_lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              adam_eps=1e-8, clip_grad=1.0, init_method_std=0.02, rotary_base=10000.0, layernorm_epsilon=1e-5)
GOLDENS = {
    # The gate alone: multi-head attention, LayerNorm, GELU, biases (linear_qkv's over the gate rows too),
    # learned absolute positions.
    "gated_mha": dict(attention_output_gate=True, qk_l2_norm=False, num_query_groups=None, normalization="LayerNorm",
                      swiglu=False, add_bias_linear=True, position_embedding_type="learned_absolute"),
    # The gate and the L2 norm with grouped-query attention (4 heads, 2 groups), RMSNorm, SwiGLU, no biases, RoPE.
    "gated_gqa_l2": dict(attention_output_gate=True, qk_l2_norm=True, num_query_groups=2, normalization="RMSNorm",
                         swiglu=True, add_bias_linear=False, position_embedding_type="rope"),
    # The L2 norm alone with grouped-query attention (one group), LayerNorm, GELU, biases, RoPE.
    "l2_gqa": dict(attention_output_gate=False, qk_l2_norm=True, num_query_groups=1, normalization="LayerNorm",
                   swiglu=False, add_bias_linear=True, position_embedding_type="rope"),
}


def build(torch, g):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    c = dict(COMMON, **g)
    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_query_groups"], ffn_hidden_size=c["ffn_hidden_size"], use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=c["add_bias_linear"],
        init_method_std=c["init_method_std"], gated_linear_unit=c["swiglu"],
        activation_func=F.silu if c["swiglu"] else F.gelu, bias_activation_fusion=False,
        normalization=c["normalization"], layernorm_epsilon=c["layernorm_epsilon"], qk_l2_norm=c["qk_l2_norm"],
        attention_output_gate=c["attention_output_gate"], apply_rope_fusion=False)
    spec = get_gpt_layer_local_spec(qk_l2_norm=c["qk_l2_norm"], normalization=c["normalization"])
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["padded_vocab_size"],
                   max_sequence_length=c["max_position_embeddings"],
                   position_embedding_type=c["position_embedding_type"], rotary_base=c["rotary_base"],
                   share_embeddings_and_output_weights=False)
    return (c, gpt) + mcore_golden.ddp_optimizer_scheduler(cfg, gpt, c)


def run(torch, name, g, out_dir):
    torch.manual_seed(1234)
    c, gpt, model, opt, sched = build(torch, g)
    blob = mcore_golden.Blob()
    steps = mcore_golden.train(torch, c, gpt, model, opt, sched, blob, STEPS)
    config = dict(c)
    config["num_query_groups"] = c["num_query_groups"] or 0
    mcore_golden.write_golden(torch, out_dir, name, "tests/support/gen_gated_attention_golden.py", config, steps,
                              blob, gpt)


def main():
    out_dir = sys.argv[1]
    with mcore_golden.one_cpu_rank() as torch:
        for name, g in GOLDENS.items():
            run(torch, name, g, out_dir)


if __name__ == "__main__":
    main()
