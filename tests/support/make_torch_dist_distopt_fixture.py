"""Writes the committed torch_dist checkpoints of megatron-core's distributed optimizer under
tests/data/torch_dist_distopt/ with megatron-core itself: a tiny GPTModel (local spec, 2 layers, hidden 16,
untied, fp32; with --bf16, Megatron-LM's --bf16 model: bf16 weights, the optimizer's fp32 main params) wrapped in megatron-core's DistributedDataParallel, its DistributedOptimizer (AdamW, what
`--use-distributed-optimizer` builds) stepped 3 times on random tokens, then saved as Megatron-LM's
save_checkpoint saves `--ckpt-format torch_dist`: dist_checkpointing.save of {args, iteration, model:
model.sharded_state_dict(), optimizer: optimizer.sharded_state_dict(model_sd, metadata=
{'distrib_optim_sharding_type': FORMAT}), opt_param_scheduler, ...} (the unsharded part goes to common.pt).

FORMAT is each of
  dp_zero_gather_scatter     the DP-zero state as one object (optimizer.distributed.dp_group_idx_0.param_state:
                             the world tensors distrib_optim.pt holds); the param groups in another object
  fully_sharded_model_space  optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>, each rank's flattened shard
                             (global shape reformulated to [X/x, Y/y, ..., x*y]); megatron-core <= 0.13 only,
                             what Megatron-LM saved by default until then (--ckpt-fully-parallel-save)
  fully_reshardable          optimizer.state.{param,exp_avg,exp_avg_sq}.<key> in the model's shapes
  dp_reshardable             optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(...).bucket_idx_B.{param,exp_avg,
                             exp_avg_sq}: each grad-buffer bucket's unpadded span; Megatron-LM's default since
                             megatron-core 0.14 (with PyTorch >= 2.6; below, Megatron-LM falls back to the two above)

Beside each, expected.json: per ptk tensor name (a local-spec GPTModel's named_parameters), the SHA-256 and
first values of the optimizer's fp32 main param, exp_avg and exp_avg_sq as megatron-core holds them
(DistributedOptimizer._get_main_param_and_optimizer_states), Adam's step and the optimizer's settings.

megatron-core runs here on CPU (gloo, world size 1): the few CUDA calls it makes (device='cuda', the CUDA RNG
tracker, tensor.type() naming torch.cuda.* types) are pointed at the CPU; nothing it writes depends on the
device. numpy 2 lacks numpy.product, which megatron-core 0.13 calls: aliased to numpy.prod.

The four fp32 ones hold the same trained state (same seeds, same arithmetic). Usage, in private venvs (V: PyTorch 2.5.1,
W: PyTorch 2.6.0, each with numpy and psutil; megatron-core 0.16.1 is /opt/ptk-pyref):
  V/bin/python tests/support/make_torch_dist_distopt_fixture.py tests/data/torch_dist_distopt \\
      --megatron-core /opt/ptk-pyref dp_zero_gather_scatter fully_reshardable
  V/bin/pip install --no-deps --target /tmp/mcore013 megatron-core==0.13.1
  V/bin/python tests/support/make_torch_dist_distopt_fixture.py tests/data/torch_dist_distopt \\
      --megatron-core /tmp/mcore013 fully_sharded_model_space
  W/bin/python tests/support/make_torch_dist_distopt_fixture.py tests/data/torch_dist_distopt \\
      --megatron-core /opt/ptk-pyref dp_reshardable
  W/bin/python tests/support/make_torch_dist_distopt_fixture.py tests/data/torch_dist_distopt \\
      --megatron-core /opt/ptk-pyref --bf16 dp_reshardable        # dp_reshardable_bf16: a --bf16 run
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

ITERATION = 3
ARGS = dict(layers=2, hidden=16, heads=4, ffn=64, vocab=50, divisible=8, seq=8, positions=16, micro=2, lr=3e-3,
            min_lr=3e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, clip_grad=1.0)


def cpu_shims(torch):
    """megatron-core's CUDA calls pointed at the CPU (see the module's docstring)."""
    import numpy
    if not hasattr(numpy, "product"):
        numpy.product = numpy.prod
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    tensor_type = torch.Tensor.type

    def cuda_type(self, *a, **k):  # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor', as on a GPU
        t = tensor_type(self, *a, **k)
        if not a and not k and isinstance(t, str) and not t.startswith("torch.cuda."):
            return "torch.cuda." + t[len("torch."):]
        return t
    torch.Tensor.type = cuda_type
    from torch.overrides import TorchFunctionMode

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            return func(*args, **kwargs)
    CudaOnCpu().__enter__()


def megatron_args(a, padded_vocab, params_dtype):
    bf16 = str(params_dtype) == "torch.bfloat16"
    return argparse.Namespace(
        num_layers=a["layers"], hidden_size=a["hidden"], ffn_hidden_size=a["ffn"], num_attention_heads=a["heads"],
        kv_channels=a["hidden"] // a["heads"], group_query_attention=False, num_query_groups=a["heads"],
        max_position_embeddings=a["positions"], seq_length=a["seq"], position_embedding_type="learned_absolute",
        add_position_embedding=True, normalization="LayerNorm", layernorm_epsilon=1e-5, apply_layernorm_1p=False,
        swiglu=False, add_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, vocab_size=a["vocab"], padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=a["divisible"], tokenizer_type="NullTokenizer", tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, data_parallel_size=1,
        transformer_impl="local", ckpt_format="torch_dist", use_distributed_optimizer=True,
        overlap_grad_reduce=False, fp16=False, bf16=bf16, accumulate_allreduce_grads_in_fp32=bf16,
        params_dtype=params_dtype, micro_batch_size=a["micro"],
        global_batch_size=a["micro"], consumed_train_samples=a["micro"] * ITERATION, consumed_valid_samples=0,
        seed=1234, lr=a["lr"], min_lr=a["min_lr"], lr_decay_style="constant", lr_warmup_iters=0,
        weight_decay=a["weight_decay"], adam_beta1=a["beta1"], adam_beta2=a["beta2"], adam_eps=a["eps"],
        clip_grad=a["clip_grad"], optimizer="adam", train_iters=100, num_experts=None, iteration=ITERATION)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--megatron-core", required=True, help="the directory holding the megatron package")
    ap.add_argument("--bf16", action="store_true", help="a --bf16 run (bf16 weights, fp32 main params); "
                    "the directories named FORMAT_bf16")
    ap.add_argument("formats", nargs="+")
    o = ap.parse_args()
    sys.path.insert(0, o.megatron_core)
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    a = ARGS
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core import dist_checkpointing, package_info, parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig
        mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
        mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
        parallel_state.initialize_model_parallel(1, 1)
        mrandom.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        padded = (a["vocab"] + a["divisible"] - 1) // a["divisible"] * a["divisible"]
        cfg = TransformerConfig(num_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
                                ffn_hidden_size=a["ffn"], use_cpu_initialization=True, hidden_dropout=0.0,
                                attention_dropout=0.0, bf16=o.bf16,
                                params_dtype=torch.bfloat16 if o.bf16 else torch.float32)
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=padded,
                       max_sequence_length=a["positions"], position_embedding_type="learned_absolute",
                       share_embeddings_and_output_weights=False)
        # As Megatron-LM builds a --bf16 model: Float16Module (the weights in bf16) inside DDP, the gradients
        # reduced in fp32.
        model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=o.bf16),
            module=Float16Module(cfg, gpt) if o.bf16 else gpt)
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=a["lr"], min_lr=a["min_lr"], weight_decay=a["weight_decay"],
            adam_beta1=a["beta1"], adam_beta2=a["beta2"], adam_eps=a["eps"], clip_grad=a["clip_grad"],
            use_distributed_optimizer=True, bf16=o.bf16, params_dtype=torch.bfloat16 if o.bf16 else torch.float32),
            [model])
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=a["lr"], min_lr=a["min_lr"], lr_warmup_steps=0,
                                        lr_decay_steps=100 * a["micro"], lr_decay_style="constant",
                                        start_wd=a["weight_decay"], end_wd=a["weight_decay"],
                                        wd_incr_steps=100 * a["micro"], wd_incr_style="constant")
        gen = torch.Generator().manual_seed(7)
        for _ in range(ITERATION):
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

        dopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
        expected = {"bf16": o.bf16, "iteration": ITERATION, "adam_step": ITERATION, "megatron_core": package_info.__version__,
                    "torch": torch.__version__, "lr": a["lr"], "weight_decay": a["weight_decay"],
                    "betas": [a["beta1"], a["beta2"]], "eps": a["eps"], "tensors": {}}
        for name, p in gpt.named_parameters():
            st = dopt._get_main_param_and_optimizer_states(p)
            entry = {}
            for which, key in (("weight", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                v = st[key].detach().float().reshape(p.shape).contiguous()
                entry[which] = {"shape": list(v.shape),
                                "sha256": hashlib.sha256(v.numpy().astype("<f4").tobytes()).hexdigest(),
                                "first": [float(x) for x in v.flatten()[:3]]}
            expected["tensors"][name] = entry
        for fmt in o.formats:
            out = os.path.join(o.out, fmt + ("_bf16" if o.bf16 else ""))
            if os.path.exists(out):
                shutil.rmtree(out)
            iter_dir = os.path.join(out, f"iter_{ITERATION:07d}")
            os.makedirs(iter_dir)
            model_sd = gpt.sharded_state_dict()
            state = {"args": megatron_args(a, padded, cfg.params_dtype), "checkpoint_version": 3.0, "iteration": ITERATION,
                     "model": model_sd,
                     "optimizer": opt.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": fmt}),
                     "opt_param_scheduler": sched.state_dict(), "num_floating_point_operations_so_far": 0}
            dist_checkpointing.save(state, iter_dir)
            with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
                fh.write(str(ITERATION))
            with open(os.path.join(out, "expected.json"), "w") as fh:
                json.dump(dict(expected, format=fmt), fh, indent=1, sort_keys=True)
                fh.write("\n")
            print(f"wrote {out} (megatron-core {package_info.__version__}, torch {torch.__version__})",
                  file=sys.stderr)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
