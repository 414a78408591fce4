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
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
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
    config["num_query_groups"] = c["num_query_groups"] or 0
    meta = {"generator": "tests/support/gen_gated_attention_golden.py", "megatron_core": package_info.__version__,
            "torch": torch.__version__, "config": config, "steps": steps, "tensors": tensors,
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
        parallel_state.initialize_model_parallel(1, 1)
        mrandom.model_parallel_cuda_manual_seed(1234)
        for name, g in GOLDENS.items():
            run(torch, name, g, out_dir)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
