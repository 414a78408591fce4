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
import json
import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_torch_dist_distopt_fixture import cpu_shims  # noqa: E402

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
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
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
    model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=c["lr"], min_lr=c["min_lr"], weight_decay=c["weight_decay"], adam_beta1=c["adam_beta1"],
        adam_beta2=c["adam_beta2"], adam_eps=c["adam_eps"], clip_grad=c["clip_grad"]), [model])
    gbs = c["micro_batch_size"] * c["num_micro_batches"]
    sched = OptimizerParamScheduler(opt, init_lr=c["lr"], max_lr=c["lr"], min_lr=c["min_lr"], lr_warmup_steps=0,
                                    lr_decay_steps=100 * gbs, lr_decay_style="constant",
                                    start_wd=c["weight_decay"], end_wd=c["weight_decay"], wd_incr_steps=100 * gbs,
                                    wd_incr_style="constant")
    return c, gpt, model, opt, sched


def run(torch, name, g, out_dir):
    from megatron.core.distributed import finalize_model_grads
    torch.manual_seed(1234)
    c, gpt, model, opt, sched = build(torch, g)
    blob = bytearray()
    tensors = {}

    def put(key, t, fmt="<f"):
        flat = t.detach().flatten().tolist()
        tensors[key] = {"shape": list(t.shape), "offset": len(blob)}
        blob.extend(struct.pack(f"<{len(flat)}{fmt[-1]}", *flat))

    for n, p in gpt.named_parameters():
        put("init:" + n, p.float())
    gen = torch.Generator().manual_seed(7)
    b, s, m = c["micro_batch_size"], c["seq_length"], c["num_micro_batches"]
    tokens = torch.randint(0, c["vocab_size"], (STEPS * m, b, s + 1), generator=gen)
    put("tokens", tokens[:, :, :-1].to(torch.int32), "<i")
    put("labels", tokens[:, :, 1:].to(torch.int32), "<i")
    mask = torch.ones(STEPS * m, b, s)
    put("loss_mask", mask)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    steps = []
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        lm = 0.0
        for k in range(m):
            x, mk = tokens[step * m + k], mask[step * m + k]
            losses = model(x[:, :-1], pos, None, labels=x[:, 1:]).float()
            loss = (losses * mk).sum() / mk.sum() / m  # pretrain_gpt's loss_func and the schedule's scaling
            loss.backward()
            lm += float(loss)
        finalize_model_grads([model])
        if step == 0:
            for n, p in gpt.named_parameters():
                put("grad:" + n, p.main_grad.float())
        ok, grad_norm, _ = opt.step()
        assert ok
        sched.step(increment=b * m)
        steps.append({"lm_loss": lm, "grad_norm": float(grad_norm)})
    for n, p in gpt.named_parameters():
        put("final:" + n, p.float())
    from megatron.core import package_info
    config = dict(c)
    config["q_lora_rank"] = c["q_lora_rank"] or 0
    meta = {"generator": "tests/support/gen_mla_golden.py", "megatron_core": package_info.__version__,
            "torch": torch.__version__, "config": config, "steps": steps, "tensors": tensors,
            "softmax_scale": gpt.decoder.layers[0].self_attention.softmax_scale,
            "param_order": [n for n, _ in gpt.named_parameters()]}
    with open(os.path.join(out_dir, name + ".json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.write("\n")
    with open(os.path.join(out_dir, name + ".bin"), "wb") as fh:
        fh.write(bytes(blob))
    print(f"wrote {name}: {steps}", file=sys.stderr)


def main():
    out_dir = sys.argv[1]
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core import parallel_state
        mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
        mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
        import megatron.core.transformer.multi_latent_attention as mla
        # Its TE imports half succeed without TE (HAVE_TE True, TELinear None): the fp8 check on linear_proj
        # then calls isinstance(x, None). Without TE, as the module means it.
        mla.HAVE_TE = False
        parallel_state.initialize_model_parallel(1, 1)
        mrandom.model_parallel_cuda_manual_seed(1234)
        for name, g in GOLDENS.items():
            run(torch, name, g, out_dir)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
