"""Writes megatron-core 0.16.1's TopKRouter at context-parallel size 2 on the CPU: two gloo processes
(parallel_state with context size 2, tensor size 1), each rank's router given its own positions of every sample
(get_batch_on_this_cp_rank's: the sequence in 4 chunks, rank r keeping chunks r and 3 - r), and the same router at
context size 1 on all the positions. MoEAuxLossAutoScaler's scale is set as the schedule sets it (schedules.py's
forward_step_calc_loss, one micro-batch, loss scale 1): the context size, or 1 with --calculate-per-token-loss.
Per case: the router's weight, the input, the upstream gradient of the probabilities (G: the objective is
sum(probs * G), times the context size but with --calculate-per-token-loss, as the schedule scales the main loss,
plus the attached losses); per context size and rank the probabilities after the token drop, the
routing map, the tracked load_balancing_loss, seq_load_balancing_loss, global_load_balancing_loss and z_loss (each
the rank's own, before any reduction), the expert-bias token counts (local_tokens_per_expert), the input's
gradient and the router weight's gradient (a rank's own: Megatron's data x context reduction then averages them,
or with --calculate-per-token-loss sums them).

Usage (megatron-core 0.16.1 and PyTorch 2, CPU):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_moe_cp_router_golden.py \\
      > tests/data/trainer/moe_cp_router_golden.txt
Lines: "case NAME", then "context C rank R", then "NAME v v v ..." (%.9g each): pos (the rank's positions), x
(S/C, B, H) of the rank's positions in Megatron's [sequence, batch, hidden] order, probs and map (tokens, E) with
the rank's tokens in [position, sample] order, lbl, seq, global, z, counts (E), dx (like x), dw (E, H); and once
per case "weight", "bias" (E), "g" (S, B, E).
"""
import warnings

from router_golden_common import B, E, H, S, print_golden, start_router, tracked, write_rank

warnings.filterwarnings("ignore")

CASES = {
    # softmax top-2, the aux loss and the z-loss, Megatron's default loss normalisation
    "aux_z": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.03),
    # the same with --calculate-per-token-loss (the attached losses times the rank's own tokens)
    "aux_z_per_token": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                            moe_z_loss_coeff=0.03, calculate_per_token_loss=True),
    # the sequence-level aux loss and a capacity of 1 with the probs policy
    "seq_capacity": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.02,
                         moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
    # sigmoid scores with an expert bias (set, not zero), the global aux loss and the z-loss
    "sigmoid_bias_global": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01,
                                moe_z_loss_coeff=0.02),
}


def tensors(torch):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(S, B, H, generator=gen)
    w = torch.randn(E, H, generator=gen) * 0.8
    g = torch.randn(S, B, E, generator=gen)
    bias = torch.tensor([0.05, -0.1, 0.2, 0.0])
    return x, w, g, bias


def positions(rank, world):
    chunk = S // (2 * world)
    return [p for c in (rank, 2 * world - 1 - rank) for p in range(c * chunk, (c + 1) * chunk)]


def rank_main(rank, world, store, name, out):
    torch, moe_utils, router, (x, w, g, bias) = start_router(
        rank, world, store, tensors,
        lambda parallel_state: parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world),
        dict(context_parallel_size=world, **CASES[name]))
    per_token = CASES[name].get("calculate_per_token_loss", False)
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 if per_token else float(world)))
    pos = positions(rank, world)
    xr = x[pos].clone().requires_grad_(True)
    gr = g[pos].reshape(-1, E)
    moe_utils.clear_aux_losses_tracker()
    probs, routing_map = router(xr)
    # The main loss's share: times the context size as forward_step_calc_loss multiplies it (1 per token).
    ((probs * gr).sum() * (1.0 if per_token else float(world))).backward()
    counts = router.local_tokens_per_expert if router.local_tokens_per_expert is not None else torch.zeros(E)
    write_rank(out, [("pos", torch.tensor(pos)), ("x", xr), ("probs", probs), ("map", routing_map.float()),
                     ("lbl", torch.tensor([tracked(moe_utils, "load_balancing_loss")])),
                     ("seq", torch.tensor([tracked(moe_utils, "seq_load_balancing_loss")])),
                     ("global", torch.tensor([tracked(moe_utils, "global_load_balancing_loss")])),
                     ("z", torch.tensor([tracked(moe_utils, "z_loss")])), ("counts", counts), ("dx", xr.grad),
                     ("dw", router.weight.grad)])
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    print_golden(CASES, tensors, rank_main, "context")
