"""Writes the committed Megatron `torch_dist` checkpoints under tests/data/torch_dist/ with
PyTorch's own torch.distributed.checkpoint.save (PyTorch >= 2.1; Debian's 1.13 has none of it), laid
out as megatron-core's dist_checkpointing (0.16) saves a GPT model with --ckpt-format torch_dist:

  <out>/latest_checkpointed_iteration.txt
  <out>/iter_N/.metadata, __0_0.distcp, __0_1.distcp   (torch.distributed.checkpoint, 2 writer threads)
  <out>/iter_N/common.pt                                (torch.save: args, iteration, scheduler, ...)
  <out>/iter_N/metadata.json                            ({"sharded_backend": "torch_dist", ...})

Each tensor is a PyTorch ShardedTensor with megatron-core's sharded keys and global shapes: the layers
stacked on a leading axis (`decoder.layers.self_attention.linear_qkv.weight` is [L, 3h, h]), one
chunk per layer and tensor-parallel rank (column-parallel tensors split along their rows, row-parallel
ones along their columns), as the ranks of a TP=2 run hold them; the keys are Transformer Engine's
names for either layer spec (megatron-core maps the local spec's LayerNorms onto them); the linear
layers' `_extra_state` entries are byte items (ShardedObjects); a tied model has no `output_layer.weight`. The plain
optimizer's state (a --bf16 run) is `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>`.

Beside each checkpoint, expected.json holds, per ptk tensor name (the merged tensor as ptk holds it:
the vocabulary cut to ptk's padding), the SHA-256 of its float32 little-endian bytes and its first
values, for weights (the fp32 masters where there are some), exp_avg and exp_avg_sq.

Usage: make_torch_dist_fixture.py OUT_DIR   (under a PyTorch >= 2.1 in a private venv: python3 -m venv V &&
       V/bin/pip install torch==2.5.1 && V/bin/python tests/support/make_torch_dist_fixture.py tests/data/torch_dist)
"""
import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

LAYER_KEYS = [  # (local-spec name, TE name, split: 0 rows, 1 columns, None replicated)
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", None),
    ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias", None),
    ("self_attention.linear_qkv.weight", None, 0),
    ("self_attention.linear_qkv.bias", None, 0),
    ("self_attention.linear_proj.weight", None, 1),
    ("self_attention.linear_proj.bias", None, None),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", None),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias", None),
    ("mlp.linear_fc1.weight", None, 0),
    ("mlp.linear_fc1.bias", None, 0),
    ("mlp.linear_fc2.weight", None, 1),
    ("mlp.linear_fc2.bias", None, None),
]


def layer_shape(name, h, f):
    if "linear_qkv.weight" in name:
        return (3 * h, h)
    if "linear_qkv.bias" in name:
        return (3 * h,)
    if "linear_proj.weight" in name:
        return (h, h)
    if "linear_fc1.weight" in name:
        return (f, h)
    if "linear_fc1.bias" in name:
        return (f,)
    if "linear_fc2.weight" in name:
        return (h, f)
    return (h,)


def sharded(full, split, tp, layered):
    """A ShardedTensor of `full` (all on this one rank) chunked as megatron-core's ShardedTensors are:
    one chunk per layer (the leading axis when `layered`) and tensor-parallel rank."""
    shards = []
    layers = full.shape[0] if layered else 1
    for layer in range(layers):
        t_full = full[layer] if layered else full
        pieces = [t_full] if split is None else list(torch.chunk(t_full, tp, dim=split))
        for t, piece in enumerate(pieces):
            offs = [0] * t_full.dim()
            if split is not None:
                offs[split] = t * piece.shape[split]
            data = piece.contiguous().clone()
            if layered:
                data = data.unsqueeze(0)
                offs = [layer] + offs
            shards.append(Shard.from_tensor_and_offsets(data, offs, 0))
    meta = ShardedTensorMetadata(
        shards_metadata=[ShardMetadata(s.metadata.shard_offsets, s.metadata.shard_sizes, "rank:0/cpu")
                         for s in shards],
        size=full.shape,
        tensor_properties=TensorProperties(dtype=full.dtype, layout=torch.strided, requires_grad=False,
                                           memory_format=torch.contiguous_format, pin_memory=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, sharded_tensor_metadata=meta,
                                                                     process_group=None)


def sha(t):
    return hashlib.sha256(t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).hexdigest()


def write_checkpoint(out, *, layers, hidden, heads, ffn, vocab, divisible, tp, positions, impl, untie, bf16,
                     optimizer, iteration, seed):
    gen = torch.Generator().manual_seed(seed)
    h, f = hidden, ffn
    multiple = divisible * tp
    vp = (vocab + multiple - 1) // multiple * multiple  # Megatron's padded vocabulary at TP=tp
    ptk_vp = (vocab + divisible - 1) // divisible * divisible  # ptk's (TP 1)

    def rnd(*shape):
        return torch.randn(shape, generator=gen) * 0.02

    # The merged model under ptk's (local-spec, global-layer) names, fp32.
    full = {"embedding.word_embeddings.weight": rnd(vp, h), "embedding.position_embeddings.weight": rnd(positions, h)}
    for layer in range(layers):
        for local, _, _ in LAYER_KEYS:
            full[f"decoder.layers.{layer}.{local}"] = rnd(*layer_shape(local, h, f)) + (
                1.0 if local.endswith("layernorm.weight") else 0.0)
    full["decoder.final_layernorm.weight"] = rnd(h) + 1.0
    full["decoder.final_layernorm.bias"] = rnd(h)
    if untie:
        full["output_layer.weight"] = rnd(vp, h)
    moments = {}
    if optimizer:
        moments = {n: (rnd(*t.shape), rnd(*t.shape).abs() * 1e-3) for n, t in full.items()}

    model_dtype = torch.bfloat16 if bf16 else torch.float32
    state = {}

    def add(key, tensor_of, split, layered):
        state[key] = sharded(tensor_of(None).to(model_dtype), split, tp, layered)
        if optimizer:
            for i, which in enumerate(("exp_avg", "exp_avg_sq")):
                state[f"optimizer.state.{which}.{key}"] = sharded(tensor_of(i), split, tp, layered)
            if bf16:
                state[f"optimizer.state.fp32_param.{key}"] = sharded(tensor_of(None), split, tp, layered)

    def of(name):
        return lambda i: full[name] if i is None else moments[name][i]

    add("embedding.word_embeddings.weight", of("embedding.word_embeddings.weight"), 0, False)
    add("embedding.position_embeddings.weight", of("embedding.position_embeddings.weight"), None, False)
    for local, te_name, split in LAYER_KEYS:
        # megatron-core's sharded keys are Transformer Engine's names for either layer spec (a local-spec
        # GPTModel's sharded_state_dict maps input_layernorm.weight to
        # decoder.layers.self_attention.linear_qkv.layer_norm_weight, so that the two load each other).
        key = "decoder.layers." + (te_name or local)
        add(key, lambda i, local=local: torch.stack(
            [of(f"decoder.layers.{layer}.{local}")(i) for layer in range(layers)]), split, True)
    for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        add(name, of(name), None, False)
    if untie:
        add("output_layer.weight", of("output_layer.weight"), 0, False)
    # Transformer Engine's per-layer extra state and the RNG state: ShardedObjects (byte items).
    for module in ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]:
        for layer in range(layers):
            # A ShardedObject per layer (ShardedObject.unique_key: shard_<offset>_<shape> over the layers),
            # the tensor-parallel replicas saved once; the data a list of the objects (None: no FP8 state).
            buf = io.BytesIO()
            torch.save([None], buf)
            buf.seek(0)
            state[f"decoder.layers.{module}._extra_state/shard_{layer}_{layers}"] = buf
    buf = io.BytesIO()
    torch.save([{"random_rng_state": None}], buf)
    buf.seek(0)
    state["rng_state/shard_0.0_1.1"] = buf

    iter_dir = os.path.join(out, f"iter_{iteration:07d}")
    os.makedirs(iter_dir)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(iter_dir, thread_count=2, single_file_per_rank=True))
    args = argparse.Namespace(
        num_layers=layers, hidden_size=h, ffn_hidden_size=f, num_attention_heads=heads, kv_channels=h // heads,
        group_query_attention=False, num_query_groups=heads, max_position_embeddings=positions, seq_length=positions,
        position_embedding_type="learned_absolute", add_position_embedding=True, normalization="LayerNorm",
        layernorm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=False, add_bias_linear=True,
        untie_embeddings_and_output_weights=untie, hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
        vocab_size=vocab, padded_vocab_size=vp, make_vocab_size_divisible_by=divisible,
        tokenizer_type="NullTokenizer", tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, transformer_impl=impl, ckpt_format="torch_dist",
        use_distributed_optimizer=False, fp16=False, bf16=bf16, params_dtype=model_dtype, micro_batch_size=2,
        global_batch_size=8, consumed_train_samples=8 * iteration, consumed_valid_samples=0, seed=1234, lr=3e-4,
        min_lr=3e-5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0,
        lr_decay_style="cosine", train_iters=100, num_experts=None, iteration=iteration)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
              "opt_param_scheduler": {"max_lr": 3e-4, "lr_warmup_steps": 8, "num_steps": 8 * iteration,
                                      "lr_decay_style": "cosine", "lr_decay_steps": 800, "min_lr": 3e-5,
                                      "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
                                      "wd_incr_steps": 800},
              "num_floating_point_operations_so_far": 0}
    if optimizer:
        common["optimizer"] = {"optimizer": {"param_groups": [
            {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "wd_mult": 1.0, "step": iteration},
            {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "wd_mult": 0.0, "step": iteration},
        ]}}
    torch.save(common, os.path.join(iter_dir, "common.pt"))
    with open(os.path.join(iter_dir, "metadata.json"), "w") as fh:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, fh)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))

    expected = {"iteration": iteration, "adam_step": iteration if optimizer else 0, "tensors": {}}
    for name, t in full.items():
        rows = ptk_vp if name in ("embedding.word_embeddings.weight", "output_layer.weight") else t.shape[0]
        entry = {}
        # A --bf16 run's weights are its fp32 masters (in the optimizer); without them, the bf16 copies.
        w = t if (optimizer or not bf16) else t.to(torch.bfloat16).to(torch.float32)
        parts = [("weight", w)]
        if optimizer:
            parts += [("exp_avg", moments[name][0]), ("exp_avg_sq", moments[name][1])]
        for which, v in parts:
            v = v[:rows]
            entry[which] = {"shape": list(v.shape), "sha256": sha(v), "first": [float(x) for x in v.flatten()[:3]]}
        expected["tensors"][name] = entry
    with open(os.path.join(out, "expected.json"), "w") as fh:
        json.dump(expected, fh, indent=1, sort_keys=True)
        fh.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        if os.path.exists(a.out):
            shutil.rmtree(a.out)
        # A TP=2 Transformer Engine model, untied, fp32, saved without its optimizer.
        write_checkpoint(os.path.join(a.out, "te_untied_fp32"), layers=2, hidden=64, heads=4, ffn=64, vocab=50,
                         divisible=16, tp=2, positions=16, impl="transformer_engine", untie=True, bf16=False,
                         optimizer=False, iteration=30, seed=11)
        # A local-spec model, tied, --bf16 with the plain optimizer's fp32 masters and moments.
        write_checkpoint(os.path.join(a.out, "local_tied_bf16"), layers=2, hidden=16, heads=4, ffn=64, vocab=50,
                         divisible=8, tp=2, positions=16, impl="local", untie=False, bf16=True, optimizer=True,
                         iteration=12, seed=12)
        dist.destroy_process_group()
    print(f"wrote {a.out} with torch {torch.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
