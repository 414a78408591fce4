"""Writes tests/data/trainer/mtp_NAME.{json,bin}: megatron-core's own GPT with multi-token prediction trained on
the CPU, the golden of ptk's CPU multi-token prediction (tests/trainer/mtp_model_golden_test.cpp).

megatron-core 0.16.1 (/opt/ptk-pyref) builds a tiny dense GPTModel from its local (non-TE) spec with
mtp_block_spec = get_gpt_mtp_block_spec(config, layer spec, use_transformer_engine=False) (MultiTokenPredictionBlock:
enorm, hnorm, eh_proj, a transformer layer and final_layernorm per depth), fp32, no dropout, on one gloo rank with
the CUDA calls pointed at the CPU (gen_moe_golden.py's setup). It is wrapped in megatron-core's
DistributedDataParallel and stepped by its optimizer and OptimizerParamScheduler; each micro-batch's loss is the
masked mean over its tokens divided by the micro-batches (or with --calculate-per-token-loss the masked sum, the
gradients divided by the global batch's tokens in finalize_model_grads), with MTPLossAutoScaler's scale set as
megatron-core's schedules set it (1 / micro-batches; 1 per token). Written: the initial weights (init:NAME), the
first step's gradients (grad:NAME, main_grad before the update), the weights after the last step (final:NAME), and
per step the lm loss, the grad norm and each depth's mtp loss as Megatron-LM's training_log computes it
(MTPLossLoggingHelper's per-micro-batch values x 1 / micro-batches; one rank, so its average over the data ranks is
the value itself).

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_mtp_golden.py tests/data/trainer [NAME ...]
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
              adam_eps=1e-8, clip_grad=1.0, init_method_std=0.02, calculate_per_token_loss=False)
GOLDENS = {
    # Two depths, tied embeddings (the depths' embedding and output layer are the word embeddings), learned
    # positions (rolled with the tokens), GELU MLP with biases, LayerNorm; factor 0.3.
    "mtp_tied": dict(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, untie=False),
    # One depth, untied output layer, --calculate-per-token-loss with a quarter of the tokens masked; Megatron's
    # default factor 0.1.
    "mtp_per_token": dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.1, untie=True, calculate_per_token_loss=True),
}


def build(torch, g):
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig
    c = dict(COMMON)
    c.update(g)
    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["ffn_hidden_size"], use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=True, init_method_std=c["init_method_std"], activation_func=F.gelu,
        bias_activation_fusion=False, calculate_per_token_loss=c["calculate_per_token_loss"],
        mtp_num_layers=c["mtp_num_layers"], mtp_loss_scaling_factor=c["mtp_loss_scaling_factor"])
    spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["padded_vocab_size"],
                   max_sequence_length=c["max_position_embeddings"], position_embedding_type="learned_absolute",
                   share_embeddings_and_output_weights=not c["untie"], mtp_block_spec=mtp_spec)
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
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
    torch.manual_seed(1234)
    MTPLossLoggingHelper.tracker.clear()
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
    per_token = c["calculate_per_token_loss"]
    mask = ((torch.rand(STEPS * m, b, s, generator=torch.Generator().manual_seed(11)) > 0.25).float() if per_token
            else torch.ones(STEPS * m, b, s))
    put("loss_mask", mask)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    N = c["mtp_num_layers"]
    steps = []
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        lm, total = 0.0, float(mask[step * m:(step + 1) * m].sum())
        for k in range(m):
            x, mk = tokens[step * m + k], mask[step * m + k]
            # schedules.py sets the scale before the backward; the MTP losses' gradients are made in backward.
            MTPLossAutoScaler.set_loss_scale(torch.ones(1) if per_token else torch.ones(1) / m)
            losses = model(x[:, :-1], pos, None, labels=x[:, 1:], loss_mask=mk).float()
            loss = (losses * mk).sum() if per_token else (losses * mk).sum() / mk.sum() / m
            loss.backward()
            lm += float(loss) / total if per_token else float(loss)
        finalize_model_grads([model], num_tokens=torch.tensor(total) if per_token else None)
        if step == 0:
            for n, p in gpt.named_parameters():
                put("grad:" + n, p.main_grad.float())
        ok, grad_norm, _ = opt.step()
        assert ok
        sched.step(increment=b * m)
        values = MTPLossLoggingHelper.tracker["values"]
        mtp = [float(v) / m for v in values]  # track_mtp_metrics' loss_scale 1 / micro-batches
        values.zero_()
        steps.append({"lm_loss": lm, "grad_norm": float(grad_norm), "mtp_losses": mtp})
    for n, p in gpt.named_parameters():
        put("final:" + n, p.float())
    from megatron.core import package_info
    config = {k: v for k, v in c.items()}
    meta = {"generator": "tests/support/gen_mtp_golden.py", "megatron_core": package_info.__version__,
            "torch": torch.__version__, "config": config, "steps": steps, "tensors": tensors,
            "param_order": [n for n, _ in gpt.named_parameters()]}
    assert len(meta["steps"][0]["mtp_losses"]) == N
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
        for name in sys.argv[2:] or list(GOLDENS):
            run(torch, name, GOLDENS[name], out_dir)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
