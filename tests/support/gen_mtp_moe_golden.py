"""Writes tests/data/trainer/mtp_NAME.{json,bin} for multi-token prediction with mixture-of-experts layers,
multi-latent attention and the attention variants (sliding window, softmax offsets, output gate, query and key L2
norm): megatron-core's own GPT trained on the CPU, the golden of ptk's CPU MTP with them
(tests/trainer/mtp_moe_golden_test.cpp). The variants go to the TransformerConfig, so the depths' layers have them as
the decoder's; the json's window_layers is is_layer_window_attention of layer numbers 1 .. num_layers +
mtp_num_layers (a depth's layer is numbered after the decoder's).

megatron-core 0.16.1 (/opt/ptk-pyref) builds the decoder from get_gpt_decoder_block_spec(config,
use_transformer_engine=False) (its local spec: MoE layers by moe_layer_freq, SequentialMLP experts behind the
allgather dispatcher, shared experts, MLA with gen_mla_golden.py's core attention) and the MTP block from
get_gpt_mtp_block_spec(config, that block spec, ...), whose transformer layer is the block's last layer's spec: an MoE
layer when the decoder's last layer is one, a dense one otherwise (mtp_moe_dense_last). MTP layer k's router is
layer num_layers + k + 1 of the aux-loss tracker (its values num_layers + mtp_num_layers long). Everything else is
gen_mtp_golden.py's loop (DDP, optimizer, scheduler, MTPLossAutoScaler's and MoEAuxLossAutoScaler's scale
1 / micro-batches) with gen_moe_golden.py's logging: per step the lm loss, grad norm, each mtp_K loss (x 1 /
micro-batches) and the load-balancing loss as Megatron-LM's training_log passes it to track_moe_metrics
(num_layers, moe_layer_freq, mtp_num_layers: the tracker's sum x 1 / micro-batches over the MoE layers of the
pattern plus mtp_num_layers), and with expert bias each router's buffer after each step (expert_bias:STEP:NAME).

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_mtp_moe_golden.py tests/data/trainer [NAME ...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_golden  # noqa: E402
from gen_mla_golden import mla_core_attention  # noqa: E402

STEPS = 3
COMMON = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, seq_length=8,
              max_position_embeddings=8, vocab_size=40, padded_vocab_size=40, micro_batch_size=2,
              num_micro_batches=2, lr=1e-2, min_lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              adam_eps=1e-8, clip_grad=1.0, init_method_std=0.02, mtp_loss_scaling_factor=0.3, mla=False,
              num_experts=0, moe_layer_freq=1, moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05,
              moe_router_score_function="softmax", moe_shared_expert_intermediate_size=0,
              moe_router_enable_expert_bias=False, moe_router_bias_update_rate=0.01, swiglu=False,
              normalization="LayerNorm", position_embedding_type="learned_absolute", q_lora_rank=8,
              qk_layernorm=True, kv_lora_rank=6, qk_head_dim=4, qk_pos_emb_head_dim=4, v_head_dim=6,
              num_query_groups=None, window_size=None, window_attn_skip_freq=None, softmax_type="vanilla",
              attention_output_gate=False, qk_l2_norm=False)
GOLDENS = {
    # Two depths; layers dense, MoE (top-2 of 4 GELU experts, aux loss), so the depths' layers are MoE layers; a
    # shared expert of width 8.
    "mtp_moe": dict(mtp_num_layers=2, num_experts=4, moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=8),
    # Layers MoE, dense: the depth's layer is dense (the block's last layer's spec), the load-balancing loss still
    # logged over the MoE layers plus the depth (Megatron-LM's track_moe_metrics).
    "mtp_moe_dense_last": dict(mtp_num_layers=1, num_experts=4, moe_layer_freq=[1, 0]),
    # One depth of multi-latent attention (queries through a latent of 8, latent norms), RMSNorm, SwiGLU, RoPE.
    "mtp_mla": dict(mtp_num_layers=1, mla=True, normalization="RMSNorm", swiglu=True, position_embedding_type="rope"),
    # DeepSeek-V3's shape: MLA, every layer MoE with a sigmoid router and aux-loss-free expert bias (rate 0.01)
    # beside the aux loss, a shared expert, RMSNorm, SwiGLU, RoPE; one depth, an MoE + MLA layer.
    "mtp_moe_mla": dict(mtp_num_layers=1, mla=True, normalization="RMSNorm", swiglu=True,
                        position_embedding_type="rope", num_experts=4, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=8),
    # The attention variants in the depths' layers (the decoder's attention config; Megatron numbers depth k's layer
    # num_layers + k + 1 for is_layer_window_attention). Two depths after two layers, a window of 2 keys with skip
    # frequency 3 (layers 1 and 2 windowed, depth 1's layer 3 full, depth 2's layer 4 windowed), the learnable
    # softmax offset (each depth's own core_attention.softmax_offset), grouped-query attention; a larger init std
    # so that the offsets weigh in the softmax (gen_swa_golden.py's).
    "mtp_swa_learnable": dict(mtp_num_layers=2, window_size=(2, 0), window_attn_skip_freq=3,
                              softmax_type="learnable", num_query_groups=2, init_method_std=0.5),
    # The output gate and the query and key L2 norm in the depth's layer: grouped-query attention, RMSNorm, SwiGLU,
    # RoPE.
    "mtp_gated_l2": dict(mtp_num_layers=1, attention_output_gate=True, qk_l2_norm=True, num_query_groups=2,
                         normalization="RMSNorm", swiglu=True, position_embedding_type="rope"),
    # Multi-latent attention (its core attention is DotProductAttention's: the window and the softmax offset apply
    # to it) with a window of 3 on the layers skip frequency 2 names (layer 1 and depth 1's layer 3), the learnable
    # softmax offset; MLA has no output gate (MLATransformerConfig raises) nor L2 norm (its specs assert).
    "mtp_mla_swa_learnable": dict(mtp_num_layers=1, mla=True, normalization="RMSNorm", swiglu=True,
                                  position_embedding_type="rope", window_size=(3, 0), window_attn_skip_freq=2,
                                  softmax_type="learnable", init_method_std=0.5),
}


def build(torch, g):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    c = dict(COMMON)
    c.update(g)
    kw = dict(num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
              ffn_hidden_size=c["ffn_hidden_size"], use_cpu_initialization=True, hidden_dropout=0.0,
              attention_dropout=0.0, add_bias_linear=False, init_method_std=c["init_method_std"],
              gated_linear_unit=c["swiglu"], activation_func=F.silu if c["swiglu"] else F.gelu,
              bias_activation_fusion=False, normalization=c["normalization"], mtp_num_layers=c["mtp_num_layers"],
              mtp_loss_scaling_factor=c["mtp_loss_scaling_factor"], num_query_groups=c["num_query_groups"],
              window_size=c["window_size"], window_attn_skip_freq=c["window_attn_skip_freq"],
              softmax_type=c["softmax_type"], attention_output_gate=c["attention_output_gate"],
              qk_l2_norm=c["qk_l2_norm"], apply_rope_fusion=False)
    if c["num_experts"]:
        kw.update(num_moe_experts=c["num_experts"], moe_router_topk=c["moe_router_topk"],
                  moe_ffn_hidden_size=c["moe_ffn_hidden_size"], moe_aux_loss_coeff=c["moe_aux_loss_coeff"],
                  moe_router_load_balancing_type="aux_loss", moe_router_pre_softmax=False,
                  moe_token_dispatcher_type="allgather", moe_router_score_function=c["moe_router_score_function"],
                  moe_grouped_gemm=False, moe_layer_freq=c["moe_layer_freq"], moe_router_dtype="fp32",
                  moe_router_enable_expert_bias=c["moe_router_enable_expert_bias"],
                  moe_router_bias_update_rate=c["moe_router_bias_update_rate"],
                  moe_shared_expert_intermediate_size=c["moe_shared_expert_intermediate_size"] or None)
    if c["mla"]:
        kw.update(multi_latent_attention=True, qk_layernorm=c["qk_layernorm"], q_lora_rank=c["q_lora_rank"],
                  kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_head_dim"],
                  qk_pos_emb_head_dim=c["qk_pos_emb_head_dim"], v_head_dim=c["v_head_dim"], rope_type="rope",
                  rotary_base=10000.0, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
                  apply_rope_fusion=False)
    cfg = (MLATransformerConfig if c["mla"] else TransformerConfig)(**kw)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, qk_l2_norm=c["qk_l2_norm"])
    for layer in spec.layer_specs:
        if c["mla"]:
            layer.submodules.self_attention.submodules.core_attention = mla_core_attention()
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["padded_vocab_size"],
                   max_sequence_length=c["max_position_embeddings"],
                   position_embedding_type=c["position_embedding_type"], share_embeddings_and_output_weights=False,
                   mtp_block_spec=mtp_spec)
    return (c, gpt) + mcore_golden.ddp_optimizer_scheduler(cfg, gpt, c)


def moe_pattern(c):
    f = c["moe_layer_freq"]
    if not c["num_experts"]:
        return [0] * c["num_layers"]
    return list(f) if isinstance(f, list) else [1 if i % f == 0 else 0 for i in range(c["num_layers"])]


def run(torch, name, g, out_dir):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    torch.manual_seed(1234)
    MTPLossLoggingHelper.tracker.clear()
    get_moe_layer_wise_logging_tracker().clear()
    c, gpt, model, opt, sched = build(torch, g)
    m = c["num_micro_batches"]
    pattern = moe_pattern(c)
    moe_layers = sum(pattern) + c["mtp_num_layers"]  # track_moe_metrics' num_moe_layers with mtp_num_layers
    blob = mcore_golden.Blob()

    def log_mtp_moe(step, record):
        values = MTPLossLoggingHelper.tracker["values"]
        record["mtp_losses"] = [float(v) / m for v in values]
        values.zero_()
        tracker = get_moe_layer_wise_logging_tracker()
        lbl = tracker["load_balancing_loss"]["values"] if "load_balancing_loss" in tracker else None
        record["load_balancing_loss"] = float((lbl * (1.0 / m)).sum() / moe_layers) if lbl is not None else 0.0
        record["load_balancing_loss_layers"] = [float(v) / m for v in lbl] if lbl is not None else []
        if c["moe_router_enable_expert_bias"]:
            for n, buf in gpt.named_buffers():
                if n.endswith("router.expert_bias"):
                    blob.put(f"expert_bias:{step}:{n}", buf.float())

    # moe and mtp: MoEAuxLossAutoScaler's and MTPLossAutoScaler's scale 1 / micro-batches, the aux losses'
    # tracker cleared before each step, the loss mask passed to the forward.
    steps = mcore_golden.train(torch, c, gpt, model, opt, sched, blob, STEPS, moe=True, mtp=True,
                               on_step=log_mtp_moe)
    from megatron.core.transformer.utils import is_layer_window_attention
    config = {k: v for k, v in c.items() if k != "moe_layer_freq"}
    config["moe_layer_pattern"] = pattern
    config["window_size"] = list(c["window_size"]) if c["window_size"] else None
    config["num_query_groups"] = c["num_query_groups"] or 0
    # Per decoder and depth layer (1-based numbers 1 .. num_layers + mtp_num_layers), whether it has the window.
    config["window_layers"] = [is_layer_window_attention(c["window_size"], c["window_attn_skip_freq"], n + 1)
                               for n in range(c["num_layers"] + c["mtp_num_layers"])]
    config["untie"] = True
    config["expert_bias_keys"] = [n for n, _ in gpt.named_buffers() if n.endswith("router.expert_bias")]
    mcore_golden.write_golden(torch, out_dir, name, "tests/support/gen_mtp_moe_golden.py", config, steps, blob, gpt)

def main():
    out_dir = sys.argv[1]
    # moe: moe_utils' te_general_gemm (gen_moe_golden.py); mla: multi_latent_attention without TE (gen_mla_golden.py).
    with mcore_golden.one_cpu_rank(moe=True, mla=True) as torch:
        for name in sys.argv[2:] or list(GOLDENS):
            run(torch, name, GOLDENS[name], out_dir)

if __name__ == "__main__":
    main()
