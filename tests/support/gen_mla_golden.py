"""Writes tests/data/trainer/mla_NAME.{json,bin}: megatron-core's own multi-latent attention GPT trained on
the CPU, the golden of ptk's CPU MLA layers (tests/trainer/mla_model_golden_test.cpp).

megatron-core 0.16.1 (/opt/ptk-pyref) builds a tiny GPTModel from its local (non-TE) spec with
multi_latent_attention (get_gpt_layer_local_spec(multi_latent_attention=True): MLASelfAttention with
ColumnParallelLinear projections, DotProductAttention, q_layernorm / kv_layernorm only with qk_layernorm)
from an MLATransformerConfig. That spec does not build as shipped: MLA hands its core attention k_channels
and v_channels, which only TE's attention takes (the local DotProductAttention raises TypeError), and the
local one views its output as kv_channels x heads. The golden's core attention is therefore
DotProductAttention taking those arguments and viewing its output as v_head_dim x heads (MlaCoreAttention):
the local attention's own math (scores scaled by MLA's softmax_scale, causal softmax, probabilities x
values), what TE's attention computes. Else fp32, no dropout, without the fused RoPE (apply_rope_fusion False: the fused
MLA RoPE is a Triton kernel), on one gloo rank with the CUDA calls pointed at the CPU
(make_torch_dist_distopt_fixture.cpu_shims). It is wrapped in megatron-core's DistributedDataParallel and
stepped by its optimizer (get_megatron_optimizer: Adam with decoupled weight decay, clipping) and
OptimizerParamScheduler, each micro-batch's loss the masked mean over its tokens divided by the number of
micro-batches, as megatron-core's schedules do (gen_moe_golden.py's loop). Written: the initial weights
(init:NAME), the first step's gradients (grad:NAME, the DDP buffer's main_grad before the update), the
weights after the last step (final:NAME), and per step the lm loss and the grad norm.

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_mla_golden.py tests/data/trainer
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_golden  # noqa: E402

STEPS = 3
COMMON = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, seq_length=8,
              max_position_embeddings=8, vocab_size=40, padded_vocab_size=40, micro_batch_size=2,
              num_micro_batches=2, lr=1e-2, min_lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              adam_eps=1e-8, clip_grad=1.0, init_method_std=0.02, kv_lora_rank=6, qk_head_dim=4,
              qk_pos_emb_head_dim=4, v_head_dim=6, rotary_base=10000.0, rotary_scaling_factor=1.0, mscale=1.0,
              mscale_all_dim=0.0)
GOLDENS = {
    # Queries through a latent of 8 with --qk-layernorm (q_layernorm and kv_layernorm), RMSNorm, SwiGLU, no
    # biases, RoPE positions only (--position-embedding-type rope), plain rope.
    "mla_lora": dict(q_lora_rank=8, qk_layernorm=True, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                     position_embedding_type="rope", rope_type="rope"),
    # linear_q_proj (no q_lora_rank), no latent norms (the local spec's IdentityOp), LayerNorm, GELU, biases
    # (linear_proj's: the MLA projections have none), learned absolute positions beside MLA's rope.
    "mla_plain": dict(q_lora_rank=None, qk_layernorm=False, normalization="LayerNorm", swiglu=False,
                      add_bias_linear=True, position_embedding_type="learned_absolute", rope_type="rope"),
    # mla_lora's model with YaRN (scaling factor 4; at Megatron-LM's original context of 4096 the 8 rotary
    # channels' correction range is pairs 1 to 3, so the inverse frequencies are the interpolated, the ramped
    # and the original ones), mscale and mscale_all_dim (the concentration factor on cos/sin, the softmax
    # scale), LayerNorm.
    "mla_yarn": dict(q_lora_rank=8, qk_layernorm=True, normalization="LayerNorm", swiglu=True, add_bias_linear=False,
                     position_embedding_type="rope", rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.7,
                     mscale_all_dim=0.9, qk_pos_emb_head_dim=8),
}


def mla_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MlaCoreAttention(DotProductAttention):
        """The local DotProductAttention with MLA's k_channels and v_channels (module docstring)."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # Attention.__init__ builds one without them first; MLA replaces it
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MlaCoreAttention


def build(torch, g):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    c = dict(COMMON, **g)
    cfg = MLATransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["ffn_hidden_size"], use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=c["add_bias_linear"], init_method_std=c["init_method_std"], gated_linear_unit=c["swiglu"],
        activation_func=F.silu if c["swiglu"] else F.gelu, bias_activation_fusion=False,
        normalization=c["normalization"], qk_layernorm=c["qk_layernorm"],
        multi_latent_attention=True, q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_head_dim"], qk_pos_emb_head_dim=c["qk_pos_emb_head_dim"],
        v_head_dim=c["v_head_dim"], rope_type=c["rope_type"], rotary_base=c["rotary_base"],
        rotary_scaling_factor=c["rotary_scaling_factor"], mscale=c["mscale"], mscale_all_dim=c["mscale_all_dim"],
        apply_rope_fusion=False)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=c["qk_layernorm"],
                                    normalization=c["normalization"])
    spec.submodules.self_attention.submodules.core_attention = mla_core_attention()
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["padded_vocab_size"],
                   max_sequence_length=c["max_position_embeddings"],
                   position_embedding_type=c["position_embedding_type"], share_embeddings_and_output_weights=False)
    return (c, gpt) + mcore_golden.ddp_optimizer_scheduler(cfg, gpt, c)


def run(torch, name, g, out_dir):
    torch.manual_seed(1234)
    c, gpt, model, opt, sched = build(torch, g)
    blob = mcore_golden.Blob()
    steps = mcore_golden.train(torch, c, gpt, model, opt, sched, blob, STEPS)
    config = dict(c)
    config["q_lora_rank"] = c["q_lora_rank"] or 0
    mcore_golden.write_golden(torch, out_dir, name, "tests/support/gen_mla_golden.py", config, steps, blob, gpt,
                              softmax_scale=gpt.decoder.layers[0].self_attention.softmax_scale)


def main():
    out_dir = sys.argv[1]
    # mla: multi_latent_attention's TE imports half succeed without TE; the module set to its no-TE path.
    with mcore_golden.one_cpu_rank(mla=True) as torch:
        for name, g in GOLDENS.items():
            run(torch, name, g, out_dir)


if __name__ == "__main__":
    main()
