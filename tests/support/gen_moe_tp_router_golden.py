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
import warnings

from router_golden_common import B, E, H, S, print_golden, start_router, tracked, write_rank

warnings.filterwarnings("ignore")

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
    torch, moe_utils, router, (x, w, g, bias) = start_router(
        rank, world, store, tensors, lambda parallel_state: parallel_state.initialize_model_parallel(world, 1),
        dict(tensor_model_parallel_size=world, sequence_parallel=world > 1, **CASES[name]))
    shard = S // world
    xr = x[rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
    gr = g[rank * shard:(rank + 1) * shard].reshape(-1, E)
    moe_utils.clear_aux_losses_tracker()
    probs, routing_map = router(xr)
    (probs * gr).sum().backward()
    counts = router.local_tokens_per_expert if router.local_tokens_per_expert is not None else torch.zeros(E)
    write_rank(out, [("x", xr), ("probs", probs), ("map", routing_map.float()),
                     ("lbl", torch.tensor([tracked(moe_utils, "load_balancing_loss")])),
                     ("z", torch.tensor([tracked(moe_utils, "z_loss")])), ("counts", counts), ("dx", xr.grad),
                     ("dw", router.weight.grad)])
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    print_golden(CASES, tensors, rank_main, "tensor")
