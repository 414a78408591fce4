#!/usr/bin/env python3
"""Shows what megatron-core 0.16.1 does when a run with --decoupled-lr loads its own optimizer state: it builds
the optimizer of gen_param_groups_golden.py's first case (get_megatron_optimizer, torch's AdamW, three groups:
--lr's, --decoupled-lr's, no weight decay), steps it once, takes its state_dict and loads that into an identical
optimizer. megatron-core matches the saved groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr),
which its standard overrides leave equal for --lr's group and the decoupled one (is_decoupled_lr stays False),
so the load hands the decoupled group's saved dict to --lr's group and torch refuses it ("loaded state dict
contains a parameter group that doesn't match the size of optimizer's group"). Prints the saved groups and the
outcome; docs/ptk-train.md cites it.

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/check_decoupled_resume_with_megatron_core.py
"""
import copy
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_param_groups_golden as golden  # noqa: E402
from make_torch_dist_distopt_fixture import cpu_shims  # noqa: E402


def main():
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core import parallel_state
        mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
        mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
        parallel_state.initialize_model_parallel(1, 1)
        case = dict(golden.BASE)
        case.update(golden.CASES["untied_decoupled_qk_wd"])
        gpt, _, opt, sched = golden.build(torch, case)
        for p in gpt.parameters():
            p.main_grad.fill_(0.01)
        opt.step()
        sched.step(increment=1)
        saved = copy.deepcopy(opt.state_dict())
        groups = saved.get("optimizer", saved)["param_groups"]
        print("saved groups (max_lr, wd_mult, is_decoupled_lr, parameters):",
              [(g["max_lr"], g["wd_mult"], g["is_decoupled_lr"], len(g["params"])) for g in groups])
        _, _, again, _ = golden.build(torch, case)
        try:
            again.load_state_dict(saved)
            print("loaded; groups now:", [(g["max_lr"], g["wd_mult"], len(g["params"])) for g in again.param_groups])
        except ValueError as e:
            print("load refused:", e)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
