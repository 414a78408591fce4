"""Writes a Megatron-LM checkpoint in its `torch` format (--ckpt-format torch) the way Megatron's
training loop saves one, with PyTorch's own torch.save: <out>/latest_checkpointed_iteration.txt and
<out>/iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt per tensor- and pipeline-parallel rank, each a dict
of args (argparse.Namespace), checkpoint_version 3.0, iteration, model (megatron-core's GPT state dict
of that rank: Transformer Engine or local layer names, layers renumbered per pipeline stage,
column-parallel tensors split along their rows, row-parallel ones along their columns, the
vocabulary padded to a multiple of make_vocab_size_divisible_by x TP), optimizer (a real
torch.optim.Adam's state_dict after two steps, with Megatron's two parameter groups: weight decay,
then the 1-D parameters with wd_mult 0; --bf16/--fp16 wraps it as Float16OptimizerWithFloat16Params does,
with the fp32 masters, and --fp16's loss scaler), opt_param_scheduler and rng_state (Python, numpy and torch generator states). --distributed-optimizer
writes the optimizer as DistributedOptimizer.state_dict leaves it, beside each rank's distrib_optim.pt
(save_parameter_state's: one grad buffer per model chunk, keys 0 .. V-1).

Beside it, <out>/reference.pt holds the merged full tensors (weights: fp32 masters; exp_avg,
exp_avg_sq) under ptk's (local) names, for the test to compare against.

Usage: gen_megatron_checkpoint.py OUT --tp T --pp P [--vp V] [--impl transformer_engine|local] [--bf16|--fp16]
       [--untie] [--layers L] [--hidden H] [--heads N] [--vocab V] [--iteration I]
       [--decoupled-lr LR [--decoupled-min-lr LR]]
"""
import argparse
import collections
import io
import math
import os
import random

import numpy
import torch


def megatron_names(layers, untie, impl, bias_linear=True):
    """Megatron-core's GPTModel parameters in named_parameters order (under their local layer spec
    names) with their split: 0 column-parallel (rows), 1 row-parallel (columns), None replicated.
    Attention builds linear_proj before SelfAttention builds linear_qkv, so linear_proj comes before
    linear_qkv, and with Transformer Engine before the input LayerNorm too (linear_qkv holds it), as
    a local-spec GPTModel's named_parameters lists them (megatron-core 0.16.1)."""
    out = [("embedding.word_embeddings.weight", 0), ("embedding.position_embeddings.weight", None)]
    for layer in range(layers):
        p = f"decoder.layers.{layer}."
        ln = [(p + "input_layernorm.weight", None), (p + "input_layernorm.bias", None)]
        proj = [(p + "self_attention.linear_proj.weight", 1), (p + "self_attention.linear_proj.bias", None)]
        out += (proj + ln if impl == "transformer_engine" else ln + proj) + [
            (p + "self_attention.linear_qkv.weight", 0), (p + "self_attention.linear_qkv.bias", 0),
            (p + "pre_mlp_layernorm.weight", None), (p + "pre_mlp_layernorm.bias", None),
            (p + "mlp.linear_fc1.weight", 0), (p + "mlp.linear_fc1.bias", 0),
            (p + "mlp.linear_fc2.weight", 1), (p + "mlp.linear_fc2.bias", None),
        ]
    out += [("decoder.final_layernorm.weight", None), ("decoder.final_layernorm.bias", None)]
    if untie:
        out.append(("output_layer.weight", 0))
    if not bias_linear:  # --disable-bias-linear: no bias on QKV, proj, fc1, fc2 (the norms keep theirs)
        out = [(n, s) for n, s in out if not any(n.endswith(x + ".bias") for x in
                                                   ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))]
    return out


TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def dist_opt_offsets(params, shared, bucket_size, dp=1):
    """Where megatron-core's distributed optimizer keeps each parameter in distrib_optim.pt's world
    tensors (get_parameter_state_dp_zero): _ParamAndGradBuffer lays the parameters out in reverse
    order, each start padded to 64 elements, a bucket closed once it holds `bucket_size` elements and
    around a shared embedding, bucket ends padded to lcm(dp, 128); the world tensor is the buckets'
    unpadded spans concatenated. `params`: [(name, numel)] in named_parameters order."""
    def pad(n, d):
        return -(-n // d) * d
    divisor = 128 * dp // math.gcd(128, dp)
    offsets, spans = {}, []  # spans: (bucket start, unpadded end)
    param_start = bucket_start = 0
    in_bucket = 0
    param_end = 0

    def close(end):
        nonlocal bucket_start, in_bucket
        spans.append((bucket_start, end))
        bucket_start = pad(end, divisor)
        in_bucket = 0
        return bucket_start

    starts = {}
    for name, numel in params[::-1]:
        param_start = pad(param_start, 64)
        if name in shared and in_bucket > 0:
            param_start = close(param_start)
        param_end = param_start + numel
        starts[name] = (param_start, len(spans))
        in_bucket += 1
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or name in shared:
            param_start = close(param_end)
        else:
            param_start = param_end
    if in_bucket > 0:
        close(param_end)
    base, bases = 0, []
    for s, e in spans:
        bases.append(base - s)
        base += e - s
    for name, (start, bucket) in starts.items():
        offsets[name] = start + bases[bucket]
    return offsets, base


def padded(vocab, divisible, tp):
    multiple = divisible * tp
    return (vocab + multiple - 1) // multiple * multiple


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--impl", default="transformer_engine", choices=["transformer_engine", "local"])
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--distributed-optimizer", action="store_true",
                    help="the optimizer as DistributedOptimizer.state_dict leaves it in model_optim_rng.pt (groups "
                         "without their parameters, no state) beside the distrib_optim.pt its "
                         "save_parameter_state writes (the fp32 params and moments in grad-buffer order)")
    ap.add_argument("--ddp-bucket-size", type=int, default=None,
                    help="--ddp-bucket-size of the run (with --overlap-grad-reduce): several buckets")
    ap.add_argument("--vp", type=int, default=1,
                    help="virtual pipeline stages (the interleaved schedule): each rank file holds model0, model1, "
                         "...; chunk v of stage p is virtual stage v*pp + p, its layers numbered from 0; with "
                         "--distributed-optimizer, distrib_optim.pt holds one grad buffer per chunk")
    ap.add_argument("--untie", action="store_true")
    ap.add_argument("--no-bias-gelu-fusion", action="store_true",
                    help="args.bias_gelu_fusion False (Megatron's unfused MLP: the exact erf GELU)")
    ap.add_argument("--disable-bias-linear", action="store_true",
                    help="args.add_bias_linear False: no linear biases (Megatron's GELU MLP then runs unfused: the "
                         "exact erf GELU)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--positions", type=int, default=16)
    ap.add_argument("--divisible", type=int, default=8)
    ap.add_argument("--iteration", type=int, default=20)
    ap.add_argument("--decoupled-lr", type=float, default=None,
                    help="args.decoupled_lr (and --decoupled-min-lr's args.decoupled_min_lr): the run's flags only, its "
                         "optimizer's groups stay the two")
    ap.add_argument("--decoupled-min-lr", type=float, default=None)
    a = ap.parse_args()
    tp, pp, h, f = a.tp, a.pp, a.hidden, 4 * a.hidden
    vp = padded(a.vocab, a.divisible, tp)
    gen = torch.Generator().manual_seed(1234 + 7 * tp + pp)

    # The full model, and two steps of full gradients (split across ranks like the tensors).
    names = megatron_names(a.layers, a.untie, a.impl, not a.disable_bias_linear)
    shapes = {}
    for name, _ in names:
        if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
            shapes[name] = (vp, h)
        elif name.endswith("position_embeddings.weight"):
            shapes[name] = (a.positions, h)
        elif "linear_qkv.weight" in name:
            shapes[name] = (3 * h, h)
        elif "linear_qkv.bias" in name:
            shapes[name] = (3 * h,)
        elif "linear_proj.weight" in name:
            shapes[name] = (h, h)
        elif "linear_fc1.weight" in name:
            shapes[name] = (f, h)
        elif "linear_fc1.bias" in name:
            shapes[name] = (f,)
        elif "linear_fc2.weight" in name:
            shapes[name] = (h, f)
        else:
            shapes[name] = (h,)
    full = {n: torch.randn(shapes[n], generator=gen) * 0.02 for n, _ in names}
    for n in full:
        if n.endswith("layernorm.weight"):
            full[n] += 1.0
    grads = [{n: torch.randn(shapes[n], generator=gen) for n, _ in names} for _ in range(2)]
    split = dict(names)
    vpp = a.vp
    per_stage = a.layers // (pp * vpp)  # layers per (virtual) stage

    def shard(t, s, rank):
        if s is None:
            return t.clone()
        return torch.chunk(t, tp, dim=s)[rank].clone()

    args = argparse.Namespace(
        num_layers=a.layers, hidden_size=h, ffn_hidden_size=f, num_attention_heads=a.heads,
        kv_channels=h // a.heads, group_query_attention=False, num_query_groups=a.heads,
        max_position_embeddings=a.positions, seq_length=a.seq, position_embedding_type="learned_absolute",
        add_position_embedding=True, normalization="LayerNorm", layernorm_epsilon=1e-5, apply_layernorm_1p=False,
        swiglu=False, add_bias_linear=not a.disable_bias_linear, untie_embeddings_and_output_weights=a.untie, hidden_dropout=0.1,
        attention_dropout=0.1, init_method_std=0.02, vocab_size=a.vocab, padded_vocab_size=vp,
        make_vocab_size_divisible_by=a.divisible, tokenizer_type="NullTokenizer",
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=per_stage if vpp > 1 else None, transformer_impl=a.impl, ckpt_format="torch",
        use_distributed_optimizer=a.distributed_optimizer, fp16=a.fp16, bf16=a.bf16,
        params_dtype=torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32, micro_batch_size=2, global_batch_size=8,
        consumed_train_samples=8 * a.iteration, consumed_valid_samples=16, seed=1234, lr=3e-4,
        min_lr=3e-5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0,
        lr_decay_style="cosine", train_iters=100, num_experts=None, iteration=a.iteration,
        data_parallel_size=1, ddp_bucket_size=a.ddp_bucket_size, overlap_grad_reduce=a.ddp_bucket_size is not None,
        bias_gelu_fusion=not a.no_bias_gelu_fusion and not a.disable_bias_linear, decoupled_lr=a.decoupled_lr,
        decoupled_min_lr=a.decoupled_min_lr)
    sched = {"max_lr": 3e-4, "lr_warmup_steps": 80, "num_steps": 8 * a.iteration, "lr_decay_style": "cosine",
             "lr_decay_steps": 800, "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
             "wd_incr_steps": 800}

    iter_dir = os.path.join(a.out, f"iter_{a.iteration:07d}")
    reference = {"weight": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for p in range(pp):
        first, last = p == 0, p == pp - 1
        # (chunk, global name, local name) in named_parameters order, chunk after chunk (the order
        # megatron-core's _get_param_groups walks the model chunks in).
        stage = []
        for v in range(vpp):
            vs = v * pp + p  # the virtual stage: Megatron's offset v * (L / V) + p * (L / (P * V))
            vfirst, vlast = vs == 0, vs == pp * vpp - 1
            for n, _ in names:
                if n.startswith("embedding."):
                    if vfirst:
                        stage.append((v, n, n))
                elif n.startswith("decoder.layers."):
                    layer = int(n.split(".")[2])
                    if layer // per_stage == vs:
                        rest = n.split(".", 3)[3]
                        loc = f"decoder.layers.{layer - vs * per_stage}."
                        stage.append((v, n, loc + (TE_NAMES.get(rest, rest) if a.impl == "transformer_engine"
                                                   else rest)))
                elif vlast:
                    stage.append((v, n, n))
            if vlast and not a.untie and pp * vpp > 1:
                stage.append((v, "embedding.word_embeddings.weight", "output_layer.weight"))
        for t in range(tp):
            params = collections.OrderedDict()
            for v, gname, lname in stage:
                params[v, lname] = torch.nn.Parameter(shard(full[gname], split.get(gname, 0), t))
            decay = [params[v, l] for v, g, l in stage if params[v, l].dim() > 1]
            no_decay = [params[v, l] for v, g, l in stage if params[v, l].dim() == 1]
            groups = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
                       "is_decoupled_lr": False, "default_config": True, "max_lr": 3e-4, "min_lr": 3e-5},
                      {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False,
                       "is_decoupled_lr": False, "default_config": True, "max_lr": 3e-4, "min_lr": 3e-5}]
            groups = [g for g in groups if g["params"]]
            opt = torch.optim.Adam(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            for step in range(2):
                for v, gname, lname in stage:
                    params[v, lname].grad = shard(grads[step][gname], split.get(gname, 0), t)
                opt.step()
            models = [collections.OrderedDict() for _ in range(vpp)]
            for v, gname, lname in stage:
                model = models[v]
                w = params[v, lname].detach()
                model[lname] = w.to(torch.bfloat16) if a.bf16 else w.to(torch.float16) if a.fp16 else w.clone()
                for linear in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
                    if lname.endswith(linear + ".bias"):
                        if a.impl == "transformer_engine" and linear == "linear_proj":
                            model[lname[: -len("linear_proj.bias")] + "core_attention._extra_state"] = None
                        # Transformer Engine's extra state: None, an io.BytesIO (older TE) or an empty
                        # uint8 tensor (newer TE), as different versions save it.
                        extra = None
                        if a.impl == "transformer_engine" and linear == "linear_qkv":
                            extra = io.BytesIO(b"fp8 meta")
                        elif a.impl == "transformer_engine" and linear == "linear_fc1":
                            extra = torch.empty(0, dtype=torch.uint8)
                        model[lname[: -len(".bias")] + "._extra_state"] = extra
            if last:
                models[-1]["output_layer._extra_state"] = None
            opt_sd = opt.state_dict()
            if a.distributed_optimizer:
                inner = {k: v for k, v in opt_sd.items() if k != "state"}
                for g in inner["param_groups"]:
                    del g["params"]
                    g["step"] = 2  # Adam's step, as DistributedOptimizer.state_dict moves it there
                optimizer = {"optimizer": inner}
                if a.fp16:
                    optimizer["grad_scaler"] = {"scale": torch.tensor([65536.0]), "growth_tracker": 3,
                                                "hysteresis_tracker": 2}
            elif a.bf16 or a.fp16:
                optimizer = {"optimizer": opt_sd,
                             "fp32_from_fp16_params": [[p_.detach().clone() for p_ in g["params"]] for g in groups]}
                if a.fp16:  # DynamicGradScaler.state_dict
                    optimizer["grad_scaler"] = {"scale": torch.tensor([65536.0]), "growth_tracker": 3,
                                                "hysteresis_tracker": 2}
            else:
                optimizer = opt_sd
            rng_state = [{"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
                          "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
                          "rng_tracker_states": {}}]
            state_dict = {"args": args, "checkpoint_version": 3.0, "iteration": a.iteration}
            if vpp == 1:
                state_dict["model"] = models[0]
            else:  # Megatron's save_checkpoint: one state dict per model chunk
                for v in range(vpp):
                    state_dict[f"model{v}"] = models[v]
            state_dict.update({"optimizer": optimizer, "opt_param_scheduler": sched, "rng_state": rng_state,
                          "num_floating_point_operations_so_far": 12345})
            rank = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            os.makedirs(os.path.join(iter_dir, rank), exist_ok=True)
            torch.save(state_dict, os.path.join(iter_dir, rank, "model_optim_rng.pt"))
            if a.distributed_optimizer:
                # DistributedOptimizer.save_parameter_state: one grad buffer per model chunk (keys 0 .. V-1 in
                # chunk order; the model's dtype, fp32 grads), its fp32 params and Adam moments as flat world
                # tensors. Only chunk 0 is bucketed (Megatron-LM's get_model: disable_bucketing for the rest).
                state = {"buckets_coalesced": True}
                for v in range(vpp):
                    vs = v * pp + p
                    shared = set()
                    if pp * vpp > 1 and not a.untie:
                        shared = {"embedding.word_embeddings.weight"} if vs == 0 else {"output_layer.weight"} \
                            if vs == pp * vpp - 1 else set()
                    chunk = [(g, l) for v_, g, l in stage if v_ == v]
                    numels = [(l, params[v, l].numel()) for g, l in chunk]
                    offsets, total = dist_opt_offsets(numels, shared,
                                                      a.ddp_bucket_size if p == 0 and v == 0 else None)
                    world = {k: torch.zeros(total) for k in ("param", "exp_avg", "exp_avg_sq")}
                    for g, l in chunk:
                        st = opt.state[params[v, l]]
                        for k, x in (("param", params[v, l].detach()), ("exp_avg", st["exp_avg"]),
                                     ("exp_avg_sq", st["exp_avg_sq"])):
                            world[k][offsets[l]:offsets[l] + x.numel()] = x.flatten()
                    world["numel_unpadded"] = total
                    dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
                    state[v] = {(dtype, torch.float32): world}
                torch.save(state, os.path.join(iter_dir, rank, "distrib_optim.pt"))
            # The merged reference: each rank's piece of every tensor it owns.
            for v, gname, lname in stage:
                if lname == "output_layer.weight" and gname != "output_layer.weight":
                    continue
                st = opt.state[params[v, lname]]
                for key, val in (("weight", params[v, lname].detach()), ("exp_avg", st["exp_avg"]),
                                 ("exp_avg_sq", st["exp_avg_sq"])):
                    reference[key].setdefault(gname, {})[t] = val.clone()
    merged = {k: {} for k in reference}
    for key, per in reference.items():
        for gname, pieces in per.items():
            s = split.get(gname, 0)
            merged[key][gname] = pieces[0] if s is None else torch.cat([pieces[t] for t in range(tp)], dim=s)
    torch.save(merged, os.path.join(a.out, "reference.pt"))
    with open(os.path.join(a.out, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(a.iteration))


if __name__ == "__main__":
    main()
