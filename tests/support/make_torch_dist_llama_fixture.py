"""Writes the committed torch_dist checkpoints of Megatron's Llama line under tests/data/torch_dist_llama/ with
megatron-core itself: a tiny GPTModel of the Llama line (local spec, 2 layers, hidden 16, 4 heads in 2 query
groups, SwiGLU, RMSNorm, RoPE, untied, no biases) trained 3 steps on random tokens at tensor-parallel size 2
(two gloo processes on the CPU), then saved as Megatron-LM's save_checkpoint saves `--ckpt-format torch_dist`:
dist_checkpointing.save of {args, iteration, model: model.sharded_state_dict(metadata=M), optimizer:
optimizer.sharded_state_dict(model_sd, metadata=M), opt_param_scheduler, ...}, where M is what Megatron-LM's
_build_sharded_state_dict_metadata gives (singleton_local_shards False: SwiGLU's linear_fc1 is one key whose
rows are every rank's gate, then every rank's up; distrib_optim_sharding_type dp_reshardable).

The directories:
  plain_bf16_tp2, plain_bf16_tp1    a --bf16 run's plain optimizer (Float16OptimizerWithFloat16Params: the
                                    model in bf16, optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>)
  distopt_tp2, distopt_tp1          an fp32 run's distributed optimizer in dp_reshardable (Megatron-LM's
                                    default: one grad buffer per tensor-parallel rank, keys
                                    optimizer.distributed.dp_group_idx_<rank>.gbuf_idx_0...bucket_idx_0.*)
  distopt_tp2_dp_zero               the same TP 2 state in dp_zero_gather_scatter (an object per rank)
  distopt_tp2_fs_model_space        a TP 2 run's distributed optimizer in fully_sharded_model_space (megatron-core
                                    <= 0.13's default, written by megatron-core 0.13.1: 0.16.1 no longer saves it;
                                    optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>, each rank's flattened
                                    shard, the global shape [X/x, Y/y, ..., x*y*...]); its TP 1 reshard (by 0.13.1,
                                    from this save) gives expected.json and is not kept
  vpp_plain_bf16, vpp_distopt        an interleaved run's: 4 layers trained 3 steps at pipeline size 1, loaded
                                    by megatron-core into pipeline size 2 with 2 model chunks of 1 layer per
                                    stage (Megatron-LM's --num-layers-per-virtual-pipeline-stage 1; two gloo
                                    processes; a DDP per chunk, the chunks after the first without buckets, as
                                    Megatron-LM's get_model builds them) and saved from there with the chunks as
                                    model0, model1 (the distributed optimizer: a grad buffer per chunk,
                                    gbuf_idx_0 and gbuf_idx_1, on each of dp_group_idx_0 and dp_group_idx_1);
                                    expected.json: the pipeline-size-1 run's state
  tied_pp2_distopt                  the same for tied embeddings over pipeline stages: 2 layers trained at pipeline
                                    size 1 with share_embeddings_and_output_weights, loaded by megatron-core into
                                    pipeline size 2 (the embedding on stage 0, the output layer's copy of it on stage
                                    1, each in its stage's grad buffer) and saved in dp_reshardable
                                    (dp_group_idx_0 and dp_group_idx_1); expected.json: the pipeline-size-1 run's
                                    state
  tied_tp2_pp2_distopt              the same at tensor size 2 x pipeline size 2 (four gloo processes), with 4 layers:
                                    with 2, megatron-core 0.16.1's own dp_reshardable save fails on stage 0 (its
                                    bucket of 1088 elements, 64-aligned but not 128-aligned, is padded to 1152 and
                                    sharded_param_state_dp_reshardable writes the end padding past numel_unpadded:
                                    torch's planner refuses the plan, "Failed to validate global plan")
The *_tp1 checkpoint is the *_tp2 one resharded by megatron-core: a tensor-parallel-size-1 model and
optimizer load the TP 2 checkpoint with dist_checkpointing.load (for the distributed optimizer, from a
fully_reshardable save of the same state, since dp_reshardable only reshards over data parallelism), then
save it. Both directories' expected.json hold what that TP 1 model and optimizer hold: per ptk tensor name (the
local-spec GPTModel's named_parameters), the SHA-256 and first values of the fp32 main param (the plain
optimizer's fp32_from_float16 copy; the distributed optimizer's _get_main_param_and_optimizer_states), exp_avg
and exp_avg_sq, Adam's step and the optimizer's settings. So megatron-core's own resharding, not this script,
decides how the TP 2 shards (SwiGLU's gate and up halves, the query groups) make the whole tensors.

megatron-core runs on the CPU as in make_torch_dist_distopt_fixture.py (its cpu_shims). Usage (PyTorch 2.6, which
dp_reshardable needs; megatron-core 0.16.1 in /opt/ptk-pyref; 0.13.1 for distopt_fsms):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/make_torch_dist_llama_fixture.py \\
      tests/data/torch_dist_llama
  /opt/ptk-torch26/bin/python -m pip install --no-deps --target /tmp/mcore013 megatron-core==0.13.1
  PYTHONPATH=/tmp/mcore013 /opt/ptk-torch26/bin/python tests/support/make_torch_dist_llama_fixture.py \\
      tests/data/torch_dist_llama --kinds distopt_fsms
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_torch_dist_distopt_fixture import cpu_shims  # noqa: E402

ITERATION = 3
ARGS = dict(layers=2, hidden=16, heads=4, groups=2, ffn=24, vocab=30, divisible=8, seq=8, positions=16, micro=2,
            lr=3e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, clip_grad=1.0, rotary_base=10000, eps_norm=1e-5)


def padded_vocab(tp):
    m = ARGS["divisible"] * tp
    return (ARGS["vocab"] + m - 1) // m * m


def megatron_args(tp, bf16, distopt, pp=1, vp=None, layers=None, tied=False):
    a = dict(ARGS, layers=layers or ARGS["layers"])
    import torch
    return argparse.Namespace(
        num_layers=a["layers"], hidden_size=a["hidden"], ffn_hidden_size=a["ffn"], num_attention_heads=a["heads"],
        kv_channels=a["hidden"] // a["heads"], group_query_attention=True, num_query_groups=a["groups"],
        max_position_embeddings=a["positions"], seq_length=a["seq"], position_embedding_type="rope",
        add_position_embedding=False, rotary_base=a["rotary_base"], rotary_percent=1.0, use_rope_scaling=False,
        rotary_interleaved=False, normalization="RMSNorm", norm_epsilon=a["eps_norm"], apply_layernorm_1p=False,
        swiglu=True, add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=not tied,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, vocab_size=a["vocab"],
        padded_vocab_size=padded_vocab(tp), make_vocab_size_divisible_by=a["divisible"],
        tokenizer_type="NullTokenizer", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_per_virtual_pipeline_stage=a["layers"] // (pp * vp) if vp else None, data_parallel_size=1,
        transformer_impl="local",
        ckpt_format="torch_dist", use_distributed_optimizer=distopt, overlap_grad_reduce=False, fp16=False,
        bf16=bf16, accumulate_allreduce_grads_in_fp32=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        micro_batch_size=a["micro"], global_batch_size=a["micro"], consumed_train_samples=a["micro"] * ITERATION,
        consumed_valid_samples=0, seed=1234, lr=a["lr"], min_lr=a["lr"], lr_decay_style="constant",
        lr_warmup_iters=0, weight_decay=a["weight_decay"], adam_beta1=a["beta1"], adam_beta2=a["beta2"],
        adam_eps=a["eps"], clip_grad=a["clip_grad"], optimizer="adam", train_iters=100, num_experts=None,
        iteration=ITERATION)


def build(tp, bf16, distopt, pp=1, vp=None, layers=None, tied=False, init=True):
    """megatron-core's model, optimizer and scheduler of the run, on this process's tensor-parallel rank (with a
    pipeline size `pp` and `vp` model chunks per stage: the chunks' GPTModels and DDPs as lists; `tied`: the output
    layer shares the embedding, on the last stage a copy of it that megatron-core keeps equal; `init` False: a second
    model in this process, parallel_state and the seeds as the first one set them)."""
    import torch
    import torch.nn.functional as F
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    a = ARGS
    mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
    if init:
        parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
        mrandom.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(num_layers=layers or a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
                            num_query_groups=a["groups"], ffn_hidden_size=a["ffn"], kv_channels=a["hidden"] // a["heads"],
                            normalization="RMSNorm", layernorm_epsilon=a["eps_norm"], gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vp, pipeline_dtype=dtype if pp > 1 else None,
                            use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, bf16=bf16, params_dtype=dtype)
    gpts, models = [], []
    for v in range(vp or 1):  # as Megatron-LM's get_model builds an interleaved run's chunks
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                       vocab_size=padded_vocab(tp), max_sequence_length=a["positions"], position_embedding_type="rope",
                       rotary_base=a["rotary_base"], share_embeddings_and_output_weights=tied,
                       pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v if vp else None),
                       post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v if vp else None),
                       vp_stage=v if vp else None)
        gpts.append(gpt)
        models.append(DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=distopt, grad_reduce_in_fp32=bf16),
            module=Float16Module(cfg, gpt) if bf16 else gpt, disable_bucketing=v > 0))
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=a["lr"], min_lr=a["lr"], weight_decay=a["weight_decay"], adam_beta1=a["beta1"],
        adam_beta2=a["beta2"], adam_eps=a["eps"], clip_grad=a["clip_grad"], use_distributed_optimizer=distopt,
        bf16=bf16, params_dtype=dtype), models)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=a["lr"], min_lr=a["lr"], lr_warmup_steps=0,
                                    lr_decay_steps=100 * a["micro"], lr_decay_style="constant",
                                    start_wd=a["weight_decay"], end_wd=a["weight_decay"],
                                    wd_incr_steps=100 * a["micro"], wd_incr_style="constant")
    if vp or pp > 1:
        return gpts, models, opt, sched
    return gpts[0], models[0], opt, sched


def train(model, opt, sched, iterations=ITERATION):
    import torch
    a = ARGS
    gen = torch.Generator().manual_seed(7)
    for _ in range(iterations):
        tokens = torch.randint(0, a["vocab"], (a["micro"], a["seq"] + 1), generator=gen)
        pos = torch.arange(a["seq"]).unsqueeze(0).expand(a["micro"], a["seq"])
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
        sched.step(increment=a["micro"])


def sd_metadata(sharding):
    """What Megatron-LM's _build_sharded_state_dict_metadata passes (megatron-core > 0.13.1)."""
    from megatron.core import parallel_state
    return {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def save(gpt, opt, sched, out, tp, bf16, distopt, sharding, pp=1, vp=None, layers=None, tied=False):
    """As Megatron-LM's save_checkpoint: `gpt` one model ('model') or an interleaved run's chunks ('model0', ...)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    if dist.get_rank() == 0 and os.path.exists(out):
        shutil.rmtree(out)
    dist.barrier()
    iter_dir = os.path.join(out, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(iter_dir)
    dist.barrier()
    md = sd_metadata(sharding)
    state = {"args": megatron_args(tp, bf16, distopt, pp, vp, layers, tied), "checkpoint_version": 3.0,
             "iteration": ITERATION, "opt_param_scheduler": sched.state_dict(),
             "num_floating_point_operations_so_far": 0}
    if isinstance(gpt, list):
        models = {f"model{v}": g.sharded_state_dict(metadata=md) for v, g in enumerate(gpt)}
        state.update(models)
        state["optimizer"] = opt.sharded_state_dict(models, metadata=md)
    else:
        state["model"] = gpt.sharded_state_dict(metadata=md)
        state["optimizer"] = opt.sharded_state_dict(state["model"], metadata=md)
    dist_checkpointing.save(state, iter_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(ITERATION))


def main_states(gpt, opt, distopt):
    """Per named parameter: the optimizer's fp32 main param, exp_avg and exp_avg_sq."""
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    out = {}
    if distopt:
        for name, p in gpt.named_parameters():
            st = inner._get_main_param_and_optimizer_states(p)
            out[name] = (st["param"], st["exp_avg"], st["exp_avg_sq"])
        return out
    main_of = {}
    for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups):
        for p, m in zip(model_group, main_group):
            main_of[id(p)] = m
    for name, p in gpt.named_parameters():
        m = main_of[id(p)]
        st = inner.optimizer.state[m]
        out[name] = (m, st["exp_avg"], st["exp_avg_sq"])
    return out


def entry(v, shape):
    v = v.detach().float().reshape(shape).contiguous()
    return {"shape": list(v.shape), "sha256": hashlib.sha256(v.numpy().astype("<f4").tobytes()).hexdigest(),
            "first": [float(x) for x in v.flatten()[:3]]}


# What each kind trained at tensor size 2 saves: (directory, distrib_optim_sharding_type).
TP2_SAVES = {
    "plain_bf16": [("plain_bf16_tp2", "dp_reshardable")],
    "distopt": [("distopt_tp2", "dp_reshardable"),
                ("distopt_tp2_dp_zero", "dp_zero_gather_scatter")],  # an object per model-parallel rank
    # megatron-core <= 0.13's default (0.16.1 refuses to save it: its ShardedTensor has no flattened_range), so
    # written by megatron-core 0.13.1: each rank's flattened shard of each parameter, the global shape
    # [X/x, Y/y, ..., x*y*...]; SwiGLU's linear_fc1 through the same factory. It reshards over tensor
    # parallelism itself, so the TP 1 optimizer loads it (0.13.1 has no fully_reshardable).
    "distopt_fsms": [("distopt_tp2_fs_model_space", "fully_sharded_model_space")],
}
# The format a TP 1 optimizer loads each kind's TP 2 save from: (directory, sharding, whether it is a temporary).
TP1_SOURCES = {
    "plain_bf16": ("plain_bf16_tp2", "fully_reshardable", False),
    "distopt": ("distopt_tp2_fully_reshardable", "fully_reshardable", True),  # dp_reshardable reshards over DP only
    "distopt_fsms": ("distopt_tp2_fs_model_space", "fully_sharded_model_space", False),
}


def tp2_worker(rank, store, out, kind):
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    bf16, distopt = kind == "plain_bf16", kind.startswith("distopt")
    gpt, model, opt, sched = build(2, bf16, distopt)
    train(model, opt, sched)
    for name, sharding in TP2_SAVES[kind]:
        save(gpt, opt, sched, os.path.join(out, name), 2, bf16, distopt, sharding)
    source, sharding, temporary = TP1_SOURCES[kind]
    if temporary:  # what the TP 1 optimizer loads
        save(gpt, opt, sched, os.path.join(out, source), 2, bf16, distopt, sharding)
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def step_shim():
    """Without Apex or Transformer Engine, megatron-core's DistributedOptimizer.load_state_dict puts torch Adam's
    `step` in each parameter's state before load_parameter_state_from_fully_reshardable copies every key of that
    state from the checkpoint's, which has no `step` (KeyError): the step is kept where load_state_dict put it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def with_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            tensors = dict(tensors, step=state["step"].clone())
        return original(self, model_param, tensors)
    DistributedOptimizer._set_main_param_and_optimizer_states = with_step


def tp1_reshard(out, kind, tmp):
    """The TP 2 checkpoint loaded by a TP 1 model and optimizer, saved at TP 1; expected.json of both."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, package_info
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store1-{kind}", rank=0, world_size=1)
    bf16, distopt = kind == "plain_bf16", kind.startswith("distopt")
    gpt, model, opt, sched = build(1, bf16, distopt)
    # The optimizer's state must exist before it is loaded into (megatron-core's DistributedOptimizer.state_dict
    # reads Adam's step from it without Apex or Transformer Engine): one step, all of which the load replaces.
    train(model, opt, sched, iterations=1)
    if distopt:
        step_shim()
    source, sharding, temporary = TP1_SOURCES[kind]
    src = os.path.join(out, source)
    md = sd_metadata(sharding)
    model_sd = gpt.sharded_state_dict(metadata=md)
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=md)
    state = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd,
                                     "opt_param_scheduler": sched.state_dict()},
                                    os.path.join(src, f"iter_{ITERATION:07d}"))
    gpt.load_state_dict(state["model"], strict=False)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["opt_param_scheduler"])
    if temporary:
        shutil.rmtree(src)
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    steps = {int(st["step"]) for st in inner.optimizer.state.values()}
    assert steps == {ITERATION}, steps  # the loaded Adam step, not the throwaway one
    a = ARGS
    expected = {"bf16": bf16, "iteration": ITERATION, "adam_step": ITERATION,
                "megatron_core": package_info.__version__, "torch": torch.__version__, "lr": a["lr"],
                "weight_decay": a["weight_decay"], "betas": [a["beta1"], a["beta2"]], "eps": a["eps"],
                "model": {k: v for k, v in a.items()}, "tensors": {}}
    for name, (w, m1, m2) in main_states(gpt, opt, distopt).items():
        shape = dict(gpt.named_parameters())[name].shape
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            shape = (a["vocab"] + a["divisible"] - 1) // a["divisible"] * a["divisible"], shape[1]
            w, m1, m2 = (t.reshape(-1, shape[1])[:shape[0]] for t in (w, m1, m2))
        expected["tensors"][name] = {"weight": entry(w, shape), "exp_avg": entry(m1, shape),
                                     "exp_avg_sq": entry(m2, shape)}
    outputs = [(2, name, sharding) for name, sharding in TP2_SAVES[kind]]
    if kind in ("plain_bf16", "distopt"):
        save(gpt, opt, sched, os.path.join(out, f"{kind}_tp1"), 1, bf16, distopt, "dp_reshardable")
        outputs.insert(0, (1, f"{kind}_tp1", "dp_reshardable"))
    for tp, name, sharding in outputs:
        with open(os.path.join(out, name, "expected.json"), "w") as fh:
            json.dump(dict(expected, tensor_parallel=tp,
                           optimizer=f"distributed ({sharding})" if distopt else "plain (--bf16)"), fh,
                      indent=1, sort_keys=True)
            fh.write("\n")
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    print(f"wrote {out}/{kind}_tp{{1,2}} (megatron-core {package_info.__version__}, torch {torch.__version__})",
          file=sys.stderr)


VPP_LAYERS = 4  # two stages of two model chunks of one layer each


def init_optimizer_state(opt):
    """Zero moments and Adam's step 0 where the optimizer has no state yet (its load replaces them all; megatron-core
    reads the step without Apex or Transformer Engine)."""
    import torch
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                st = inner.optimizer.state[p]
                if not st:
                    st.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), step=torch.tensor(0.0))


# The runs trained at pipeline size 1 and loaded by megatron-core into another parallel layout, saved from there.
RESHARDS = {
    # an interleaved run: 4 layers, pipeline size 2, two model chunks of one layer per stage
    "vpp_plain_bf16": dict(bf16=True, distopt=False, tp=1, pp=2, vp=2, layers=VPP_LAYERS, tied=False),
    "vpp_distopt": dict(bf16=False, distopt=True, tp=1, pp=2, vp=2, layers=VPP_LAYERS, tied=False),
    # tied embeddings over two pipeline stages: the embedding on the first, the output layer's copy of it on the
    # last (a grad buffer entry of its own there); at tensor size 1 and 2
    "tied_pp2_distopt": dict(bf16=False, distopt=True, tp=1, pp=2, vp=None, layers=2, tied=True),
    "tied_tp2_pp2_distopt": dict(bf16=False, distopt=True, tp=2, pp=2, vp=None, layers=4, tied=True),
}


def reshard_source(out, kind, tmp):
    """The run at pipeline size 1 (3 steps): saved where the resharded run loads it from, and the values
    expected.json records."""
    import torch
    import torch.distributed as dist
    from megatron.core import package_info
    k = RESHARDS[kind]
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-src-{kind}", rank=0, world_size=1)
    gpt, model, opt, sched = build(1, k["bf16"], k["distopt"], layers=k["layers"], tied=k["tied"])
    train(model, opt, sched)
    save(gpt, opt, sched, os.path.join(tmp, f"{kind}-source"), 1, k["bf16"], k["distopt"],
         "fully_reshardable" if k["distopt"] else "dp_reshardable", layers=k["layers"], tied=k["tied"])
    a = ARGS
    expected = {"bf16": k["bf16"], "iteration": ITERATION, "adam_step": ITERATION,
                "megatron_core": package_info.__version__, "torch": torch.__version__, "lr": a["lr"],
                "weight_decay": a["weight_decay"], "betas": [a["beta1"], a["beta2"]], "eps": a["eps"],
                "model": dict(a, layers=k["layers"]), "tensor_parallel": k["tp"], "pipeline_parallel": k["pp"],
                "optimizer": "distributed (dp_reshardable)" if k["distopt"] else "plain (--bf16)", "tensors": {}}
    if k["vp"]:
        expected["virtual_pipeline_parallel"] = k["vp"]
    if k["tied"]:
        expected["tied"] = True
    for name, (w, m1, m2) in main_states(gpt, opt, k["distopt"]).items():
        shape = dict(gpt.named_parameters())[name].shape
        expected["tensors"][name] = {"weight": entry(w, shape), "exp_avg": entry(m1, shape),
                                     "exp_avg_sq": entry(m2, shape)}
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return expected


def load_into(gpts, opt, sharding, iter_dir, vp):
    """dist_checkpointing.load of `iter_dir` into the chunks and the optimizer, as Megatron-LM's load_checkpoint."""
    from megatron.core import dist_checkpointing
    md = sd_metadata(sharding)
    model_sd = ({f"model{v}": g.sharded_state_dict(metadata=md) for v, g in enumerate(gpts)} if vp else
                {"model": gpts[0].sharded_state_dict(metadata=md)})
    state = dist_checkpointing.load(dict(model_sd, optimizer=opt.sharded_state_dict(model_sd, is_loading=True,
                                                                                   metadata=md)), iter_dir)
    for v, g in enumerate(gpts):
        g.load_state_dict(state[f"model{v}" if vp else "model"], strict=False)
    opt.load_state_dict(state["optimizer"])
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    steps = {int(st["step"]) for st in inner.optimizer.state.values()}
    assert steps == {ITERATION}, steps


def reshard_worker(rank, store, out, kind, tmp):
    """The source loaded by the run of RESHARDS[kind] (one process per tensor and pipeline rank) and saved."""
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    k = RESHARDS[kind]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=k["tp"] * k["pp"])
    gpts, models, opt, sched = build(k["tp"], k["bf16"], k["distopt"], pp=k["pp"], vp=k["vp"], layers=k["layers"],
                                     tied=k["tied"])
    init_optimizer_state(opt)
    if k["distopt"]:
        step_shim()
    load_into(gpts, opt, "fully_reshardable", os.path.join(tmp, f"{kind}-source", f"iter_{ITERATION:07d}"), k["vp"])
    for _ in range(ITERATION):
        sched.step(increment=ARGS["micro"])
    save(gpts if k["vp"] else gpts[0], opt, sched, os.path.join(out, kind), k["tp"], k["bf16"], k["distopt"],
         "dp_reshardable", pp=k["pp"], vp=k["vp"], layers=k["layers"], tied=k["tied"])
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--kinds", nargs="+", help="distopt_fsms needs megatron-core 0.13.1 (the module's docstring)",
                    default=["plain_bf16", "distopt", *RESHARDS])
    o = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    cpu_shims(torch)
    for kind in o.kinds:
        with tempfile.TemporaryDirectory() as tmp:
            if kind in RESHARDS:
                expected = reshard_source(o.out, kind, tmp)
                mp.spawn(reshard_worker, args=(f"{tmp}/store2", o.out, kind, tmp),
                         nprocs=RESHARDS[kind]["tp"] * RESHARDS[kind]["pp"], join=True)
                with open(os.path.join(o.out, kind, "expected.json"), "w") as fh:
                    json.dump(expected, fh, indent=1, sort_keys=True)
                    fh.write("\n")
                continue
            mp.spawn(tp2_worker, args=(f"{tmp}/store2", o.out, kind), nprocs=2, join=True)
            tp1_reshard(o.out, kind, tmp)


if __name__ == "__main__":
    main()
