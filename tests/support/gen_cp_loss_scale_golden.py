"""Writes megatron-core's loss normalisation under context parallelism for a loss mask that is uneven
over the context ranks: what each masked token's loss weighs in the reduced gradient, per micro-batch
and context rank, with and without --calculate-per-token-loss. Each rank is a gloo process of
megatron-core 0.16.1's parallel_state (context-parallel size 2, data-parallel size 1): its rows of the
mask are those get_batch_on_this_cp_rank keeps; its micro-batches go through the schedule's
forward_step_calc_loss (the division by the rank's own token count and by the number of
micro-batches) with a loss function returning what Megatron-LM core_v0.16.1's pretrain_gpt.py
loss_func returns (masked sum, token count, report; pretrain_gpt.py is not in the megatron-core
package, and its loss_func needs Megatron-LM's global args), then backward,
then finalize_model_grads over a DistributedDataParallel-wrapped probe (the reduction over the
data x context group and its scaling; with per-token loss, the division by the global batch's
tokens). The probe's per-token losses on rank c of micro-batch m are one weight w[m, c] each, so the
reduced gradient of w[m, c] divided by the rank's tokens is the weight of one of its tokens.

Usage (megatron-core 0.16.1 and PyTorch 2, CPU):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_cp_loss_scale_golden.py \\
      > tests/data/trainer/cp_loss_scale_golden.txt
Lines: "mask MICRO SAMPLE BITS" (the whole sample's loss mask, one 0/1 per position), then
"weight MODE MICRO RANK TOKENS WEIGHT" (MODE: mean, Megatron's default, or per-token: with
--calculate-per-token-loss; TOKENS: the rank's masked tokens; WEIGHT: a masked token's weight in the
reduced gradient, %.17g).
"""
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

SEQ, SAMPLES, MICRO, CONTEXT = 32, 2, 2, 2
# Uneven over the context ranks (rank 0 holds positions 0-7 and 24-31, rank 1 positions 8-23): an
# end of document masked at 20 in sample 0 of micro-batch 0, a hole at 4-11 and a tail from 20 in
# micro-batch 1.
ZEROS = {(0, 0): range(20, 32), (0, 1): range(0), (1, 0): range(4, 12), (1, 1): range(20, 32)}


def whole_mask(torch):
    mask = torch.ones(MICRO, SAMPLES, SEQ)
    for (m, s), positions in ZEROS.items():
        for p in positions:
            mask[m, s, p] = 0.0
    return mask


def rank_main(rank, store, per_token, out):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import torch.distributed as dist
    from make_torch_dist_distopt_fixture import cpu_shims
    cpu_shims(torch)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=CONTEXT)
    from megatron.core import parallel_state, utils
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=CONTEXT)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, context_parallel_size=CONTEXT,
                            calculate_per_token_loss=per_token, use_cpu_initialization=True)

    class Probe(MegatronModule):
        def __init__(self):
            super().__init__(config=cfg)
            self.w = torch.nn.Parameter(torch.ones(MICRO * CONTEXT))

        def forward(self, m, n):  # rank c's per-token losses of micro-batch m: w[m, c] each
            return self.w[m * CONTEXT + rank].expand(n)

    ddp = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=Probe())
    ddp.zero_grad_buffer()
    mask = whole_mask(torch)
    total, tokens = torch.zeros([], dtype=torch.int), []
    for m in range(MICRO):
        local = utils.get_batch_on_this_cp_rank({"loss_mask": mask[m].clone()})["loss_mask"]

        def loss_func(output_tensor, local=local):  # as pretrain_gpt.py's: masked sum, token count, report
            losses, flat = output_tensor.view(-1).float(), local.view(-1).float()
            loss = torch.sum(losses * flat)
            n = flat.sum().clone().detach().to(torch.int)
            return loss, n, {"lm loss": torch.cat([loss.clone().detach().view(1), n.view(1)])}

        out_tensor, n = forward_step_calc_loss(ddp, ddp(m, local.numel()), loss_func, cfg, None, False, MICRO, [],
                                               cp_group_size=CONTEXT, is_last_stage=True)
        out_tensor.backward()
        total += n
        tokens.append(int(n))
    finalize_model_grads([ddp], num_tokens=total if per_token else None)
    grad = ddp.module.w.main_grad
    with open(out, "w") as f:
        for m in range(MICRO):
            f.write(f"{m} {tokens[m]} {float(grad[m * CONTEXT + rank]) / tokens[m]:.17g}\n")
    dist.destroy_process_group()


def main():
    import torch
    import multiprocessing as mp
    for m in range(MICRO):
        for s in range(SAMPLES):
            print(f"mask {m} {s} " + "".join(str(int(v)) for v in whole_mask(torch)[m, s]))
    for mode, per_token in (("mean", False), ("per-token", True)):
        with tempfile.TemporaryDirectory() as tmp:
            outs = [os.path.join(tmp, f"rank{r}") for r in range(CONTEXT)]
            procs = [mp.get_context("spawn").Process(target=rank_main, args=(r, os.path.join(tmp, "store"), per_token,
                                                                              outs[r])) for r in range(CONTEXT)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
                assert p.exitcode == 0, f"a rank failed: {p.exitcode}"
            for r in range(CONTEXT):
                for line in open(outs[r]):
                    m, n, w = line.split()
                    print(f"weight {mode} {m} {r} {n} {w}")


if __name__ == "__main__":
    main()
