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

Interleaved runs (the virtual pipeline: V model chunks a pipeline rank) are megatron-core's whole
path, in a world of P pipeline ranks: parallel_state with V virtual stages, each chunk a GPTModel of
its vp_stage (pre_process / post_process and shared_embedding as megatron-core sets them at pipeline
size P), wrapped in DistributedDataParallel as Megatron-LM's get_model wraps them (overlap_grad_reduce
with the bucket size, disable_bucketing for chunks after the first), one DistributedOptimizer over the
chunks (get_megatron_optimizer), the parameters filled with their element numbers, and the offsets read
back from DistributedOptimizer.get_parameter_state_dp_zero's world tensors: grad buffer v is chunk v's.

Needs PyTorch >= 2.4 (torch.nn.RMSNorm; /opt/ptk-torch26) and megatron-core (0.16.1 under
/opt/ptk-pyref); CPU only (gloo; a world of one, two tensor ranks, three data ranks or two pipeline
ranks; megatron-core's few CUDA calls pointed at the CPU as make_torch_dist_distopt_fixture.py does).

Usage: /opt/ptk-torch26/bin/python tests/support/gen_distrib_layout_golden.py [/opt/ptk-pyref] \\
           > tests/data/interop/megatron_distrib_layout.txt
Each case: `case NAME FAMILY LAYERS STAGES STAGE TIED BUCKET TP DP VP CHUNK` (VP 1, CHUNK 0: a run
without chunks, the buffer built directly with BUCKET; VP > 1: model chunk CHUNK of pipeline rank STAGE,
BUCKET the run's --ddp-bucket-size under --overlap-grad-reduce, 0 for none), then `param NAME NUMEL
OFFSET` in named_parameters order (the chunk's own, layers from 0), then `total NUMEL_UNPADDED`.
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
# Interleaved: a world of 2. Buckets of 10 and 40 elements close after the 16- and 48-element norms and
# biases, whose end padding the file then leaves out: the saved offsets move.
VP_CASES = [  # family, layers, pipeline size, model chunks, tied, bucket sizes
    ("llama", 8, 2, 2, True, (None, 10)),
    ("gpt", 8, 2, 2, False, (None, 40)),
    ("gpt", 8, 2, 4, True, (None,)),
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
                           f"{dp} 1 0")
                for n, p in named:  # get_parameter_state_dp_zero: the buckets' unpadded spans concatenated
                    s, _, b = buf.param_index_map[p]
                    out.append(f"param {n} {p.numel()} {s - starts[b] + sum(unpadded[:b])}")
                out.append(f"total {buf.numel_unpadded}")
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            f.write("".join(line + "\n" for line in out))


def model_kwargs(family):
    import torch.nn.functional as F
    return dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                num_query_groups=GROUPS) if family == "llama" else {}


def interleaved(rank, stages, store, pyref, out_path):
    """Pipeline rank `rank` of `stages` (gloo over a file store): each VP case's chunks on this rank,
    laid out and saved by megatron-core's DistributedDataParallel and DistributedOptimizer; the lines
    written to out_path.RANK."""
    sys.path.insert(0, pyref)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import torch.distributed as dist
    from make_torch_dist_distopt_fixture import cpu_shims
    cpu_shims(torch)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=stages)
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
    out = []
    for family, layers, case_stages, vp, tied, buckets in VP_CASES:
        assert case_stages == stages
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, stages, virtual_pipeline_model_parallel_size=vp)
        mrandom.model_parallel_cuda_manual_seed(1234)
        llama = family == "llama"
        for bucket in buckets:
            cfg = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                    ffn_hidden_size=FFN[family], pipeline_model_parallel_size=stages,
                                    virtual_pipeline_model_parallel_size=vp, pipeline_dtype=torch.float32,
                                    use_cpu_initialization=True, **model_kwargs(family))
            spec = get_gpt_layer_local_spec(normalization="RMSNorm" if llama else "LayerNorm")
            chunks = [GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                               position_embedding_type="rope" if llama else "learned_absolute",
                               share_embeddings_and_output_weights=tied, vp_stage=v,
                               pre_process=v == 0 and rank == 0, post_process=v == vp - 1 and rank == stages - 1)
                      for v in range(vp)]
            ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                       overlap_grad_reduce=bucket is not None, bucket_size=bucket)
            # Megatron-LM's get_model: bucketing off for the chunks after the first.
            ddp = [DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=m, disable_bucketing=v > 0)
                   for v, m in enumerate(chunks)]
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0,
                                                         use_distributed_optimizer=True), ddp)
            dopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
            dopt._init_optimizer_states_with_dummy_values()  # zero gradients, no decay: nothing moves
            with torch.no_grad():  # each chunk's parameters numbered 1, 2, ... (the main params view them)
                for m in chunks:
                    n = 1
                    for _, p in m.named_parameters():
                        p.copy_(torch.arange(n, n + p.numel(), dtype=torch.float32).view(p.shape))
                        n += p.numel()
            state = dopt.get_parameter_state_dp_zero()
            assert set(state) == {"buckets_coalesced", *range(vp)}, list(state)
            for v, m in enumerate(chunks):
                (dtype, world), = state[v].items()
                assert dtype == (torch.float32, torch.float32), dtype
                out.append(f"case {family}-{layers}l-{stages}p-vp{vp}{'-tied' if tied else ''}-stage{rank}-chunk{v}-"
                           f"bucket{bucket or 'none'} {family} {layers} {stages} {rank} {int(tied)} {bucket or 0} 1 1 "
                           f"{vp} {v}")
                n = 1
                for name, p in m.named_parameters():
                    at = int((world["param"] == n).nonzero()[0])
                    assert torch.equal(world["param"][at:at + p.numel()], p.detach().flatten()), name
                    out.append(f"param {name} {p.numel()} {at}")
                    n += p.numel()
                out.append(f"total {world['numel_unpadded']}")
    dist.destroy_process_group()
    with open(f"{out_path}.{rank}", "w") as f:
        f.write("".join(line + "\n" for line in out))


def main():
    pyref = sys.argv[1] if len(sys.argv) > 1 else "/opt/ptk-pyref"
    if len(sys.argv) > 2 and sys.argv[2] == "vp":  # an interleaved run's pipeline rank: vp RANK STAGES STORE OUT
        interleaved(int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], pyref, sys.argv[6])
        return
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
        out, store = os.path.join(tmp, "vp.txt"), os.path.join(tmp, "store-vp")
        ranks = [subprocess.Popen([sys.executable, __file__, pyref, "vp", str(r), "2", store, out]) for r in range(2)]
        if any(r.wait() != 0 for r in ranks):
            raise SystemExit("the interleaved runs: a rank failed")
        for r in range(2):
            sys.stdout.write(open(f"{out}.{r}").read())

if __name__ == "__main__":
    main()
