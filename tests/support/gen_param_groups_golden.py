#!/usr/bin/env python3
"""Writes tests/data/trainer/param_groups.json: megatron-core 0.16.1's optimizer parameter groups and their
schedules, the golden of tests/trainer/param_groups_golden_test.cpp (--decoupled-lr, --decoupled-min-lr,
--apply-wd-to-qk-layernorm).

For each case a tiny megatron-core GPTModel (local spec, LayerNorm, --qk-layernorm, learned positions; tied or
untied embeddings) is wrapped in megatron-core's DistributedDataParallel and given to get_megatron_optimizer
(torch's AdamW underneath, as Megatron falls back to without Transformer Engine or Apex) with an
OptimizerConfig carrying the case's decoupled_lr, decoupled_min_lr and apply_wd_to_qk_layernorm, and to an
OptimizerParamScheduler (warm-up from init_lr, then the case's decay and weight-decay increment), stepped by one
sample per iteration. Recorded:
  groups   per parameter name, its group's max_lr, min_lr and wd_mult (megatron-core's _get_param_groups)
  rates    per iteration, every group's lr and weight_decay as the scheduler set them for that update
  final    every parameter after the last update (float32 values), from the start and gradients below
Parameters and gradients are a formula both sides compute (no random numbers, no files of inputs): element i of
the k-th name in sorted order starts at 0.05 * sin(0.37 * i + 1.3 * k) and its gradient at iteration s is
0.01 * cos(0.21 * i + 0.9 * k + 0.5 * s), each computed in double and rounded to float32. Gradient clipping is
off (clip_grad 0) so every update is the optimizer's alone.

megatron-core runs on the CPU as make_torch_dist_distopt_fixture.py runs it (gloo, world size 1).
Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_param_groups_golden.py
"""
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_torch_dist_distopt_fixture import cpu_shims  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "trainer", "param_groups.json")

MODEL = dict(layers=1, hidden=8, heads=2, ffn=16, vocab=16, positions=8)
BASE = dict(lr=1e-3, min_lr=1e-4, init_lr=1e-5, warmup=2, decay=7, decay_style="cosine", iterations=9,
            start_wd=0.1, end_wd=0.1, wd_style="constant", wd_steps=9, beta1=0.9, beta2=0.95, eps=1e-8)
CASES = {
    # Both decoupled rates; the query and key norms decay (Qwen3-Next's rule).
    "untied_decoupled_qk_wd": dict(tied=False, decoupled_lr=3e-3, decoupled_min_lr=3e-4, apply_wd_qk=True),
    # Tied embeddings: one decoupled tensor, its minimum --min-lr's; a linear decay and weight-decay increment.
    "tied_decoupled_lr_only": dict(tied=True, decoupled_lr=2e-3, decoupled_min_lr=None, apply_wd_qk=False,
                                   decay_style="linear", start_wd=0.05, end_wd=0.15, wd_style="linear"),
    # No decoupled rate: Megatron's two groups by weight decay (the default run).
    "untied_default_groups": dict(tied=False, decoupled_lr=None, decoupled_min_lr=None, apply_wd_qk=False,
                                  decay_style="WSD"),
}


def build(torch, case):
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig
    mrandom.model_parallel_cuda_manual_seed(1234)
    m = MODEL
    cfg = TransformerConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
                            ffn_hidden_size=m["ffn"], use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, qk_layernorm=True)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True),
                   vocab_size=m["vocab"], max_sequence_length=m["positions"],
                   position_embedding_type="learned_absolute", share_embeddings_and_output_weights=case["tied"])
    model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=case["lr"], min_lr=case["min_lr"], decoupled_lr=case["decoupled_lr"],
        decoupled_min_lr=case["decoupled_min_lr"], apply_wd_to_qk_layernorm=case["apply_wd_qk"],
        weight_decay=case["start_wd"], adam_beta1=case["beta1"], adam_beta2=case["beta2"], adam_eps=case["eps"],
        clip_grad=0.0), [model])
    sched = OptimizerParamScheduler(
        opt, init_lr=case["init_lr"], max_lr=case["lr"], min_lr=case["min_lr"], lr_warmup_steps=case["warmup"],
        lr_decay_steps=case["decay"], lr_decay_style=case["decay_style"], start_wd=case["start_wd"],
        end_wd=case["end_wd"], wd_incr_steps=case["wd_steps"], wd_incr_style=case["wd_style"],
        wsd_decay_steps=3 if case["decay_style"] == "WSD" else None,
        lr_wsd_decay_style="cosine" if case["decay_style"] == "WSD" else None)
    return gpt, model, opt, sched


def start_value(k, i):
    return 0.05 * math.sin(0.37 * i + 1.3 * k)


def grad_value(k, i, s):
    return 0.01 * math.cos(0.21 * i + 0.9 * k + 0.5 * s)


def run_case(torch, case):
    gpt, model, opt, sched = build(torch, case)
    named = dict(gpt.named_parameters())
    names = sorted(named)
    with torch.no_grad():
        for k, n in enumerate(names):
            p = named[n]
            flat = torch.tensor([start_value(k, i) for i in range(p.numel())], dtype=torch.float64)
            p.copy_(flat.to(torch.float32).view_as(p))
    name_of = {id(p): n for n, p in named.items()}
    groups = {}
    for g in opt.param_groups:
        for p in g["params"]:
            groups[name_of[id(p)]] = dict(max_lr=g["max_lr"], min_lr=g["min_lr"], wd_mult=g["wd_mult"])
    rates = []
    for s in range(1, case["iterations"] + 1):
        with torch.no_grad():
            for k, n in enumerate(names):
                p = named[n]
                flat = torch.tensor([grad_value(k, i, s) for i in range(p.numel())], dtype=torch.float64)
                p.main_grad.copy_(flat.to(torch.float32).view_as(p))
        rates.append([dict(max_lr=g["max_lr"], min_lr=g["min_lr"], wd_mult=g["wd_mult"], lr=g["lr"],
                           weight_decay=g["weight_decay"]) for g in opt.param_groups])
        ok, _, _ = opt.step()
        assert ok
        sched.step(increment=1)
    # Each float32 as its shortest decimal that reads back to the same float32 (numpy's repr).
    final = {n: [float(str(x)) for x in named[n].detach().reshape(-1).numpy()] for n in names}
    return dict(names=names, groups=groups, rates=rates, final=final)


def main():
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    out = dict(model=MODEL, cases={})
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core import package_info, parallel_state
        mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
        mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
        parallel_state.initialize_model_parallel(1, 1)
        out["megatron_core"] = package_info.__version__
        out["torch"] = torch.__version__
        for name, over in CASES.items():
            case = dict(BASE)
            case.update(over)
            result = run_case(torch, case)
            out["cases"][name] = dict(settings=case, **result)
        dist.destroy_process_group()
    with open(OUT + ".tmp", "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    os.replace(OUT + ".tmp", OUT)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
