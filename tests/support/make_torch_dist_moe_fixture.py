"""Writes the committed torch_dist checkpoints of Megatron's mixture-of-experts and multi-latent attention models under
tests/data/torch_dist_moe/ with megatron-core 0.16.1 itself: tiny GPTModels from its local spec, trained 2 steps on
random tokens on the CPU (gen_moe_golden.py's and gen_mla_golden.py's builds and mcore_golden.py's loop: megatron-core's
DDP and plain fp32 optimizer), then saved as Megatron-LM's save_checkpoint saves `--ckpt-format torch_dist`:
dist_checkpointing.save of {args, iteration, model: model.sharded_state_dict(metadata=M), optimizer:
optimizer.sharded_state_dict(model_sd, metadata=M), opt_param_scheduler, ...}, M what Megatron-LM's
_build_sharded_state_dict_metadata gives (singleton_local_shards False).

  moe_tp1          SequentialMLP experts (4, SwiGLU, top-2, sigmoid scores with the expert bias), a SwiGLU shared
                   expert with its gate, layers MoE, dense, MoE (the stacked keys of each kind hold only its layers):
                   a key per layer (megatron-core's non_homogeneous_layers, as
                   for any --moe-layer-freq but 1): the experts' decoder.layers.N.mlp.experts.experts.linear_fc{1,2}
                   .weight, [E, rows, cols] with the expert axis a global offset; the router's weight and expert_bias; the shared experts'
                   keys; the plain optimizer's optimizer.state.{exp_avg,exp_avg_sq}.<key>
  moe_tp2          moe_tp1's checkpoint loaded by megatron-core into tensor size 2 (two gloo processes; the experts
                   split over the tensor ranks as the dense MLP, SwiGLU's gate and up halves too; --sequence-parallel,
                   which MoE there requires) and saved from there, nothing run
  moe_ep2          the same into expert size 2 (each rank 2 whole experts, data-parallel size 2 for the rest), the
                   model only (saved with --no-save-optim: megatron-core's ChainedOptimizer of the dense and the
                   expert optimizers refuses the TP 1 optimizer's state)
  mla_tp1          multi-latent attention (q_lora_rank 8, --qk-layernorm, RMSNorm, SwiGLU, rope): linear_q_down_proj,
                   linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, q_layernorm, kv_layernorm, linear_proj

expected.json beside each: per ptk tensor name (the local-spec GPTModel's named_parameters, and the routers'
expert_bias buffers), the SHA-256 and first values of the weight, exp_avg and exp_avg_sq (float32 little-endian) of
the TP 1 model and optimizer (for moe_tp2 and moe_ep2, moe_tp1's: the same state
resharded).

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/make_torch_dist_moe_fixture.py \\
           tests/data/torch_dist_moe
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_mla_golden  # noqa: E402
import gen_moe_golden  # noqa: E402
import mcore_golden  # noqa: E402
from make_torch_dist_distopt_fixture import cpu_shims  # noqa: E402



def no_psutil():
    """Without psutil, megatron-core's async file writer (a process of its own, which imports this module again)
    raises in _process_memory, which only logs the memory used: taken as 0 there."""
    try:
        import megatron.core.dist_checkpointing.strategies.filesystem_async as fa
    except ImportError:
        return
    if not fa.HAVE_PSUTIL:
        fa._process_memory = lambda: 0


no_psutil()
ITERATION = 2
# The TP 1 MoE checkpoint resharded by megatron-core: (tensor size, expert size) -> directory.
RESHARDS = {(2, 1): "moe_tp2", (1, 2): "moe_ep2"}
SMALL = dict(num_layers=3, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, seq_length=8,
             max_position_embeddings=8, vocab_size=40, padded_vocab_size=40, micro_batch_size=2, num_micro_batches=1)
MOE = dict(SMALL, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.0, swiglu=True,
           moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1], moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none",
           moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=1)
MLA = dict(SMALL, num_layers=2, q_lora_rank=8, qk_layernorm=True, normalization="RMSNorm", swiglu=True,
           add_bias_linear=False, position_embedding_type="rope", rope_type="rope")


def megatron_args(c, mla, tp=1, ep=1):
    moe = not mla
    a = dict(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["ffn_hidden_size"],
        num_attention_heads=c["num_attention_heads"], kv_channels=c["hidden_size"] // c["num_attention_heads"],
        group_query_attention=False, num_query_groups=c["num_attention_heads"],
        max_position_embeddings=c["max_position_embeddings"], seq_length=c["seq_length"],
        position_embedding_type="rope" if mla else "learned_absolute", add_position_embedding=not mla,
        rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False, rotary_interleaved=False,
        normalization="RMSNorm" if mla else "LayerNorm", norm_epsilon=1e-5, layernorm_epsilon=1e-5,
        apply_layernorm_1p=False, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        vocab_size=c["vocab_size"], padded_vocab_size=c["padded_vocab_size"], make_vocab_size_divisible_by=8,
        tokenizer_type="NullTokenizer", tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, data_parallel_size=1, transformer_impl="local",
        ckpt_format="torch_dist", use_distributed_optimizer=False, fp16=False, bf16=False,
        micro_batch_size=c["micro_batch_size"], global_batch_size=c["micro_batch_size"] * c["num_micro_batches"],
        consumed_train_samples=c["micro_batch_size"] * c["num_micro_batches"] * ITERATION, consumed_valid_samples=0,
        seed=1234, lr=c["lr"], min_lr=c["min_lr"], lr_decay_style="constant", lr_warmup_iters=0,
        weight_decay=c["weight_decay"], adam_beta1=c["adam_beta1"], adam_beta2=c["adam_beta2"],
        adam_eps=c["adam_eps"], clip_grad=c["clip_grad"], optimizer="adam", train_iters=100, iteration=ITERATION,
        num_experts=c["num_experts"] if moe else None, multi_latent_attention=mla)
    if moe:
        a.update(moe_router_topk=c["moe_router_topk"], moe_ffn_hidden_size=c["moe_ffn_hidden_size"],
                 moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                 moe_router_score_function=c["moe_router_score_function"], moe_router_pre_softmax=False,
                 moe_layer_freq=c["moe_layer_freq"], moe_grouped_gemm=False, expert_model_parallel_size=ep,
                 expert_tensor_parallel_size=1 if ep > 1 else tp, moe_token_dispatcher_type="allgather",
                 moe_input_jitter_eps=None, moe_router_dtype="fp32", moe_z_loss_coeff=None,
                 moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_router_group_topk=None,
                 moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
                 moe_expert_capacity_factor=None, moe_token_drop_policy="probs",
                 moe_shared_expert_intermediate_size=c["moe_shared_expert_intermediate_size"],
                 moe_shared_expert_gate=True)
    else:
        a.update(q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_head_dim"],
                 qk_pos_emb_head_dim=c["qk_pos_emb_head_dim"], v_head_dim=c["v_head_dim"], rope_type="rope",
                 qk_layernorm=True, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return argparse.Namespace(**a)


def sd_metadata():
    from megatron.core import parallel_state
    return {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def save(gpt, opt, sched, out, args, optimizer=True):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    if dist.get_rank() == 0 and os.path.exists(out):
        shutil.rmtree(out)
    dist.barrier()
    iter_dir = os.path.join(out, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(iter_dir)
    dist.barrier()
    md = sd_metadata()
    model_sd = gpt.sharded_state_dict(metadata=md)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model_sd,
             "opt_param_scheduler": sched.state_dict(), "num_floating_point_operations_so_far": 0}
    if optimizer:
        state["optimizer"] = opt.sharded_state_dict(model_sd, metadata=md)
    dist_checkpointing.save(state, iter_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(ITERATION))


def entry(v):
    v = v.detach().float().contiguous()
    return {"shape": list(v.shape), "sha256": hashlib.sha256(v.numpy().astype("<f4").tobytes()).hexdigest(),
            "first": [float(x) for x in v.flatten()[:3]]}


def expected(gpt, opt):
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    out = {"iteration": ITERATION, "adam_step": ITERATION, "tensors": {}, "buffers": {}}
    for name, p in gpt.named_parameters():
        st = inner.optimizer.state[p]
        out["tensors"][name] = {"weight": entry(p), "exp_avg": entry(st["exp_avg"]),
                                "exp_avg_sq": entry(st["exp_avg_sq"])}
    for name, b in gpt.named_buffers():
        if name.endswith("router.expert_bias"):
            out["buffers"][name] = entry(b)
    return out


def write_expected(out, e):
    with open(os.path.join(out, "expected.json"), "w") as fh:
        json.dump(e, fh, indent=1, sort_keys=True)
        fh.write("\n")


def build_moe(torch, tp=1, ep=1):
    """gen_moe_golden.build at tensor size tp x expert size ep (the experts' tensor size 1 when ep > 1)."""
    import megatron.core.transformer.transformer_config as tc
    g = dict(MOE)
    if tp > 1 or ep > 1:
        gen_moe_golden_cfg = tc.TransformerConfig

        class Parallel(gen_moe_golden_cfg):
            def __init__(self, **kw):
                super().__init__(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1 if ep > 1 else tp, sequence_parallel=tp > 1, **kw)
        tc.TransformerConfig = Parallel
        try:
            return gen_moe_golden.build(torch, g)
        finally:
            tc.TransformerConfig = gen_moe_golden_cfg
    return gen_moe_golden.build(torch, g)


def tp1(rank, out):
    """In a process of its own (mp.spawn), as the TP 2 one: dist_checkpointing's writer hangs in the main process."""
    with mcore_golden.one_cpu_rank(moe=True, mla=True) as torch:
        torch.manual_seed(1234)
        c, gpt, model, opt, sched = build_moe(torch)
        steps = mcore_golden.train(torch, c, gpt, model, opt, sched, mcore_golden.Blob(), ITERATION, moe=True)
        save(gpt, opt, sched, os.path.join(out, "moe_tp1"), megatron_args(c, False))
        e = expected(gpt, opt)
        e["lm_loss"] = [s["lm_loss"] for s in steps]
        write_expected(os.path.join(out, "moe_tp1"), e)
        torch.manual_seed(1234)
        c, gpt, model, opt, sched = gen_mla_golden.build(torch, MLA)
        steps = mcore_golden.train(torch, c, gpt, model, opt, sched, mcore_golden.Blob(), ITERATION)
        save(gpt, opt, sched, os.path.join(out, "mla_tp1"), megatron_args(c, True))
        e = expected(gpt, opt)
        e["lm_loss"] = [s["lm_loss"] for s in steps]
        write_expected(os.path.join(out, "mla_tp1"), e)


def torch_norm_without_sp_check():
    """megatron-core's torch LayerNorm (without Apex or TE) refuses --sequence-parallel, which MoE at tensor size > 1
    requires: built as without it (the norms' weights are whole on every rank either way; nothing is run)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    original = WrappedTorchNorm.__new__

    def new(cls, config, *a, **k):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            return original(cls, config, *a, **k)
        finally:
            config.sequence_parallel = sp
    WrappedTorchNorm.__new__ = staticmethod(new)


def reshard_worker(rank, store, out, tp, ep):
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import dist_checkpointing, parallel_state
    mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1 if ep > 1 else tp)
    mrandom.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    torch_norm_without_sp_check()
    c, gpt, model, opt, sched = build_moe(torch, tp=tp, ep=ep)
    # Nothing run (the optimizer's state is made by sharded_state_dict(is_loading=True), then loaded into).
    md = sd_metadata()
    model_sd = gpt.sharded_state_dict(metadata=md)
    # Expert size 2: the experts' optimizer is a second one (a ChainedOptimizer), whose load_state_dict refuses the
    # TP 1 optimizer's state ("Expected 2 entries in state dict, but got 4"): the model only, saved without it.
    with_optimizer = ep == 1
    load = {"model": model_sd, "opt_param_scheduler": sched.state_dict()}
    if with_optimizer:
        load["optimizer"] = opt.sharded_state_dict(model_sd, is_loading=True, metadata=md)
    state = dist_checkpointing.load(load, os.path.join(out, "moe_tp1", f"iter_{ITERATION:07d}"))
    gpt.load_state_dict(state["model"], strict=False)
    if with_optimizer:
        opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["opt_param_scheduler"])
    save(gpt, opt, sched, os.path.join(out, RESHARDS[(tp, ep)]), megatron_args(c, False, tp=tp, ep=ep),
         optimizer=with_optimizer)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--kinds", default="tp1,moe_tp2,moe_ep2")
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    os.makedirs(a.out, exist_ok=True)
    import torch.multiprocessing as mp
    if "tp1" in kinds:
        mp.spawn(tp1, args=(a.out,), nprocs=1)
    for (tp, ep), name in RESHARDS.items():
        if name not in kinds:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(reshard_worker, args=(f"{tmp}/store", a.out, tp, ep), nprocs=2)
        # expected.json: moe_tp1's, the state this reshards
        shutil.copy(os.path.join(a.out, "moe_tp1", "expected.json"), os.path.join(a.out, name))


if __name__ == "__main__":
    main()
