"""Writes where megatron-core's distributed optimizer keeps each parameter of a pipeline stage in
distrib_optim.pt's world tensors, for the models of tests/interop/megatron_distrib_layout_test.cpp:
megatron-core's own GPTModel (local layer spec) and _ParamAndGradBuffer with
use_distributed_optimizer, read from its param_index_map and buckets as
DistributedOptimizer.get_parameter_state_dp_zero concatenates them (each bucket's unpadded span).

Models: the Llama line (RMSNorm without bias, SwiGLU with fc1 = [gate; up], no linear biases,
grouped-query attention, RoPE, untied output layer) and GPT-3's (LayerNorm, GELU, biases, learned
positions), tied or not; each as one stage or as the two stages of a pipeline of 2 (GPTModel with
pre_process / post_process, the stage's layers numbered from 0, as Megatron names them); the Llama
line also at tensor size 2 (two processes: each tensor rank's shards, laid out by tensor rank 0) and
at data-parallel size 3 (three processes: buckets padded to lcm(3, 128), which the file leaves out). A tied
pipeline's embedding and its last stage's copy carry shared_embedding, set here as
LanguageModule.setup_embeddings_and_output_layer sets it at pipeline size > 1 (a world of one
cannot build such a pipeline). Bucket sizes: none (one bucket) and a few hundred elements.

Needs PyTorch >= 2.4 (torch.nn.RMSNorm; a private venv) and megatron-core (0.16.1 under
/opt/ptk-pyref); CPU only (gloo; a world of one, two tensor ranks or three data ranks).

Usage: V/bin/python tests/support/gen_distrib_layout_golden.py [/opt/ptk-pyref] \\
           > tests/data/interop/megatron_distrib_layout.txt
Each case: `case NAME FAMILY LAYERS STAGES STAGE TIED BUCKET TP DP`, then `param NAME NUMEL OFFSET` in
named_parameters order, then `total NUMEL_UNPADDED`.
"""
import os
import sys
import tempfile
import types

# The models (tests/interop/megatron_distrib_layout_test.cpp builds the same in ptk).
HIDDEN, HEADS, GROUPS, VOCAB, SEQ = 16, 4, 2, 64, 16
FFN = {"llama": 24, "gpt": 64}
CASES = [  # family, layers, stages, tied, bucket sizes, tensor size, data-parallel size
    ("llama", 4, 1, False, (None, 300), 1, 1),
    ("llama", 4, 2, False, (None, 300), 1, 1),
    ("llama", 4, 2, True, (None, 300), 1, 1),
    ("gpt", 4, 2, True, (None, 700), 1, 1),
    ("llama", 4, 2, True, (None, 300), 2, 1),
    # Buckets padded to lcm(3, 128) = 384 elements: the padding moves, the saved layout does not.
    ("llama", 4, 2, True, (None, 300), 1, 3),
]


def layouts(rank, tp, dp, store, pyref, out_path):
    """Rank `rank` of tp x dp (gloo over a file store): every case of those sizes, its lines written
    to out_path by rank 0 (the other tensor ranks hold shards of the same sizes)."""
    sys.path.insert(0, pyref)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    torch.cuda.current_device = lambda: "cpu"  # the buffers' device: CPU here
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp * dp)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(tp, 1)
    groups = types.SimpleNamespace(tp=parallel_state.get_tensor_model_parallel_group(),
                                   dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True))
    out = []
    for family, layers, stages, tied, buckets, case_tp, case_dp in CASES:
        if (case_tp, case_dp) != (tp, dp):
            continue
        llama = family == "llama"
        for stage in range(stages):
            pre, post = stage == 0, stage == stages - 1
            kw = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                      add_bias_linear=False, num_query_groups=GROUPS) if llama else {}
            cfg = TransformerConfig(num_layers=layers // stages, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                    ffn_hidden_size=FFN[family], tensor_model_parallel_size=tp,
                                    use_cpu_initialization=True, **kw)
            spec = get_gpt_layer_local_spec(normalization="RMSNorm" if llama else "LayerNorm")
            model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                             position_embedding_type="rope" if llama else "learned_absolute",
                             share_embeddings_and_output_weights=tied, pre_process=pre, post_process=post)
            named = list(model.named_parameters())
            if tied and stages > 1:  # setup_embeddings_and_output_layer at pipeline size > 1
                model.shared_embedding_or_output_weight().shared_embedding = True
            for bucket in buckets:
                ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=bucket)
                params = [p for _, p in named]
                buf = _ParamAndGradBuffer(ddp, torch.float32, torch.float32, params,
                                          parallel_state.get_data_parallel_group(), bucket,
                                          {p: n for n, p in named}, 1.0, list(range(len(params))), False, groups)
                starts = [s for s, _ in buf.bucket_indices]
                unpadded = [b.numel_unpadded for b in buf.buckets]
                out.append(f"case {family}-{layers}l-{stages}p{'-tied' if tied else ''}-tp{tp}-dp{dp}-stage{stage}-"
                           f"bucket{bucket or 'none'} {family} {layers} {stages} {stage} {int(tied)} {bucket or 0} {tp} "
                           f"{dp}")
                for n, p in named:  # get_parameter_state_dp_zero: the buckets' unpadded spans concatenated
                    s, _, b = buf.param_index_map[p]
                    out.append(f"param {n} {p.numel()} {s - starts[b] + sum(unpadded[:b])}")
                out.append(f"total {buf.numel_unpadded}")
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            f.write("".join(line + "\n" for line in out))


def main():
    pyref = sys.argv[1] if len(sys.argv) > 1 else "/opt/ptk-pyref"
    if len(sys.argv) > 2:  # a rank: RANK TP DP STORE OUT
        layouts(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], pyref, sys.argv[6])
        return
    import subprocess
    with tempfile.TemporaryDirectory() as tmp:
        for tp, dp in sorted({c[-2:] for c in CASES}):
            out, store = os.path.join(tmp, f"tp{tp}dp{dp}.txt"), os.path.join(tmp, f"store{tp}x{dp}")
            ranks = [subprocess.Popen([sys.executable, __file__, pyref, str(r), str(tp), str(dp), store, out])
                     for r in range(tp * dp)]
            if any(r.wait() != 0 for r in ranks):
                raise SystemExit(f"tensor size {tp}, data-parallel size {dp}: a rank failed")
            sys.stdout.write(open(out).read())

if __name__ == "__main__":
    main()
