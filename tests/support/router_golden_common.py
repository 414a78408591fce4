"""What the MoE router's parallel golden writers share (gen_moe_tp_router_golden.py, gen_moe_cp_router_golden.py):
the shapes, megatron-core 0.16.1's TopKRouter set up in a rank's gloo process on the CPU, a rank's lines, and the
driver that runs each case at sizes 1 and 2 (a spawned process per rank) and prints the golden.
"""
import os
import sys
import tempfile

S, B, H, E, K = 8, 2, 6, 4, 2


def line(key, t):
    """KEY and the tensor's values, %.9g each."""
    return key + " " + " ".join(f"{float(v):.9g}" for v in t.detach().reshape(-1))


def start_router(rank, world, store, tensors, parallel, config):
    """In a rank's process: gloo over the file `store`, parallel_state set by parallel(parallel_state), and
    megatron-core's TopKRouter of E experts, top K, over H (`config`: the other TransformerConfig keywords) holding
    tensors()' weight and expert bias, in training mode. Returns torch, moe_utils, the router and tensors()."""
    import torch
    import torch.distributed as dist
    from make_torch_dist_distopt_fixture import cpu_shims
    cpu_shims(torch)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not hasattr(moe_utils, "te_general_gemm"):  # the torch.mm path without Transformer Engine (mcore_golden.py)
        moe_utils.te_general_gemm = None
    parallel(parallel_state)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                            moe_router_topk=K, use_cpu_initialization=True, add_bias_linear=False, **config)
    router = TopKRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    x, w, g, bias = tensors(torch)
    with torch.no_grad():
        router.weight.copy_(w)
        if router.expert_bias is not None:
            router.expert_bias.copy_(bias)
    router.train()
    return torch, moe_utils, router, (x, w, g, bias)


def tracked(moe_utils, key):
    """The tracked loss KEY's value (its first layer's), 0 where it is not tracked."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    return float(tracker[key]["values"][0]) if key in tracker else 0.0


def write_rank(out, entries):
    """A rank's lines (KEY, tensor) into the file OUT, for the driver to print."""
    with open(out, "w") as f:
        for key, t in entries:
            f.write(line(key, t) + "\n")


def print_golden(cases, tensors, rank_main, group):
    """Per case: "case NAME", its weight, bias and g, then at sizes 1 and 2 each rank's lines after "GROUP SIZE rank
    R", rank_main(rank, world, store, name, out) writing them in a spawned process."""
    import multiprocessing as mp

    import torch
    for name in cases:
        print(f"case {name}")
        x, w, g, bias = tensors(torch)
        for key, t in (("weight", w), ("bias", bias), ("g", g)):
            print(line(key, t))
        for world in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                outs = [os.path.join(tmp, f"rank{r}") for r in range(world)]
                procs = [mp.get_context("spawn").Process(
                    target=rank_main, args=(r, world, os.path.join(tmp, "store"), name, outs[r]))
                    for r in range(world)]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                    assert p.exitcode == 0, f"a rank failed: {p.exitcode}"
                for r in range(world):
                    print(f"{group} {world} rank {r}")
                    sys.stdout.write(open(outs[r]).read())
