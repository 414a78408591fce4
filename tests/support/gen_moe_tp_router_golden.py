"""Writes megatron-core 0.16.1's TopKRouter at tensor-parallel size 2 with sequence parallelism on the CPU: two
gloo processes (parallel_state with tensor size 2), each rank's router given its own positions [r*S/2, (r+1)*S/2)
of every sample (the sequence-parallel shard MoELayer routes), and the same router at tensor size 1 on all the
positions. Per case: the router's weight, the input, the upstream gradient of the probabilities (G: the
objective is sum(probs * G) plus the attached losses); per tensor size and rank the probabilities after the token
drop, the routing map, the tracked load_balancing_loss and z_loss (each loss over its coefficient, the rank's own:
before any reduction), the expert-bias token counts (local_tokens_per_expert), the input's gradient and the router
weight's gradient (a rank's own: Megatron sums them over the tensor group after backward).

Usage (megatron-core 0.16.1 and PyTorch 2, CPU):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_moe_tp_router_golden.py \\
      > tests/data/trainer/moe_tp_router_golden.txt
Lines: "case NAME", then "tensor T rank R", then "NAME v v v ..." (%.9g each): x (S, B, H) of the rank's positions
in Megatron's [sequence, batch, hidden] order, probs and map (tokens, E) with the rank's tokens in [position, sample]
order, lbl, z, counts (E), dx (like x), dw (E, H); and once per case "weight", "bias" (E), "g" (S, B, E).
"""
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

S, B, H, E, K = 8, 2, 6, 4, 2
CASES = {
    # softmax top-2, the aux loss and the z-loss, a capacity of 1 with the probs policy
    "softmax": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.03,
                    moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
    # sigmoid scores with an expert bias (set, not zero), the z-loss, a capacity of 1 with the probs policy (the
    # position policy is torch.topk over the 0/1 routing map, whose ties CPU torch breaks in no fixed order)
    "sigmoid_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.02,
                         moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
}


def tensors(torch):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(S, B, H, generator=gen)
    w = torch.randn(E, H, generator=gen) * 0.8
    g = torch.randn(S, B, E, generator=gen)
    bias = torch.tensor([0.05, -0.1, 0.2, 0.0])
    return x, w, g, bias


def rank_main(rank, world, store, name, out):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
    parallel_state.initialize_model_parallel(world, 1)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                            moe_router_topk=K, tensor_model_parallel_size=world, sequence_parallel=world > 1,
                            use_cpu_initialization=True, add_bias_linear=False, **CASES[name])
    router = TopKRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    x, w, g, bias = tensors(torch)
    with torch.no_grad():
        router.weight.copy_(w)
        if router.expert_bias is not None:
            router.expert_bias.copy_(bias)
    router.train()
    shard = S // world
    xr = x[rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
    gr = g[rank * shard:(rank + 1) * shard].reshape(-1, E)
    moe_utils.clear_aux_losses_tracker()
    probs, routing_map = router(xr)
    (probs * gr).sum().backward()
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()

    def tracked(key):
        return float(tracker[key]["values"][0]) if key in tracker else 0.0
    counts = router.local_tokens_per_expert if router.local_tokens_per_expert is not None else torch.zeros(E)
    with open(out, "w") as f:
        def put(key, t):
            f.write(key + " " + " ".join(f"{float(v):.9g}" for v in t.detach().reshape(-1)) + "\n")
        put("x", xr)
        put("probs", probs)
        put("map", routing_map.float())
        put("lbl", torch.tensor([tracked("load_balancing_loss")]))
        put("z", torch.tensor([tracked("z_loss")]))
        put("counts", counts)
        put("dx", xr.grad)
        put("dw", router.weight.grad)
    dist.destroy_process_group()


def main():
    import torch
    import multiprocessing as mp
    for name in CASES:
        print(f"case {name}")
        x, w, g, bias = tensors(torch)
        for key, t in (("weight", w), ("bias", bias), ("g", g)):
            print(key + " " + " ".join(f"{float(v):.9g}" for v in t.reshape(-1)))
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
                    print(f"tensor {world} rank {r}")
                    sys.stdout.write(open(outs[r]).read())


if __name__ == "__main__":
    main()
