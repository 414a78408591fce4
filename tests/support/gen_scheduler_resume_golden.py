#!/usr/bin/env python3
"""Writes tests/data/trainer/scheduler_resume.json: what megatron-core 0.16.1's OptimizerParamScheduler
does when a run resumes from a checkpoint whose scheduler settings may differ from the command line's:
its load_state_dict / _check_and_set under Megatron's three choices (neither flag: every value its
state_dict holds must match, else an AssertionError naming the first; --use-checkpoint-opt_param-scheduler:
the checkpoint's values; --override-opt_param-scheduler: the command line's). The golden of
tests/trainer/scheduler_resume_test.cpp.

Each case is a pair of schedulers in samples, as megatron/training/training.py's
get_optimizer_param_scheduler builds them: `saved` (the run that wrote the checkpoint, stepped to
num_steps and its state_dict() taken) and `here` (this command line's). The state_dict holds max_lr,
min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd, end_wd, wd_incr_steps and
wd_incr_style; not init_lr (--lr-warmup-init) nor the WSD anneal (wsd_decay_steps, lr_wsd_decay_style),
which therefore always come from the command line. Recorded per case and choice: whether the load
stops (and the name Megatron's assertion gives first), every name whose values differ (each pair
through _check_and_set on its own), and for a load that goes on the scheduler's values and its
learning rate and weight decay at a few steps.

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_scheduler_resume_golden.py
"""
import json
import os
import sys
import types

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "tests", "data", "trainer", "scheduler_resume.json")

BASE = dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_steps=16, lr_decay_style="linear",
            start_wd=0.1, end_wd=0.1, wd_incr_steps=16, wd_incr_style="constant", wsd_decay_steps=None,
            lr_wsd_decay_style=None)


def cfg(**kw):
    c = dict(BASE)
    c.update(kw)
    return c


# name -> (here, saved, the saved scheduler's num_steps)
CASES = {
    "same": (cfg(), cfg(), 8),
    # A longer --train-iters: the decay (lr_decay_iters defaults to train_iters) and Megatron's weight-decay
    # increment (always train_iters x global batch) both grow.
    "longer_train_iters": (cfg(lr_decay_steps=32, wd_incr_steps=32), cfg(), 8),
    # Constant rate and constant weight decay: Megatron still compares every value it saved.
    "constant_longer_train_iters": (cfg(lr_decay_style="constant", lr_decay_steps=32, wd_incr_steps=32),
                                    cfg(lr_decay_style="constant"), 8),
    "constant_other_min_lr": (cfg(lr_decay_style="constant", min_lr=0.0), cfg(lr_decay_style="constant"), 8),
    # Only --lr-decay-iters longer, --train-iters the same.
    "longer_decay_only": (cfg(lr_decay_steps=24), cfg(), 8),
    "other_peak_and_style": (cfg(max_lr=2e-3, lr_decay_style="cosine"), cfg(), 8),
    "other_weight_decay": (cfg(start_wd=0.05, end_wd=0.05), cfg(), 8),
    "weight_decay_increment": (cfg(start_wd=0.0, end_wd=0.1, wd_incr_style="linear"),
                               cfg(start_wd=0.01, end_wd=0.1, wd_incr_style="cosine"), 6),
    "warmup_fraction": (cfg(lr_warmup_steps=0.1 * 24, lr_decay_steps=24), cfg(lr_warmup_steps=0.1 * 16), 1),
    # Not in the state_dict: the command line's, whatever the checkpoint's run had.
    "other_warmup_init": (cfg(init_lr=1e-5), cfg(init_lr=0.0), 2),
    "other_wsd_anneal": (cfg(lr_decay_style="WSD", wsd_decay_steps=8, lr_wsd_decay_style="linear"),
                         cfg(lr_decay_style="WSD", wsd_decay_steps=4, lr_wsd_decay_style="cosine"), 10),
    "wsd_longer_train_iters": (
        cfg(lr_decay_style="WSD", wsd_decay_steps=8, lr_wsd_decay_style="linear", lr_decay_steps=32, wd_incr_steps=32),
        cfg(lr_decay_style="WSD", wsd_decay_steps=8, lr_wsd_decay_style="linear"), 10),
}

MODES = {"check": (False, False), "use_checkpoint": (True, False), "override": (False, True)}

# The state_dict's keys and the names _check_and_set gives them, in load_state_dict's order.
CHECKED = [("max_lr", "learning rate"), ("min_lr", "minimum learning rate"), ("lr_warmup_steps", "warmup iterations"),
           ("lr_decay_steps", "total number of iterations"), ("lr_decay_style", "learning rate decay style"),
           ("start_wd", "start weight decay"), ("end_wd", "end weight decay"),
           ("wd_incr_steps", "total number of weight decay iterations"),
           ("wd_incr_style", "weight decay incr style")]
VALUES = [k for k, _ in CHECKED] + ["init_lr", "wsd_decay_steps", "lr_wsd_decay_style"]


def make(c, use_checkpoint=False, override=False):
    opt = types.SimpleNamespace(param_groups=[{}])
    return OptimizerParamScheduler(opt, use_checkpoint_opt_param_scheduler=use_checkpoint,
                                   override_opt_param_scheduler=override, **c)


def run_case(here, saved, num_steps):
    s = make(saved)
    s.step(num_steps)
    sd = s.state_dict()
    out = {"here": here, "saved": saved, "num_steps": num_steps, "state_dict": sd}
    # Each pair on its own: which values differ for Megatron.
    probe = make(here)
    out["mismatches"] = []
    for key, name in CHECKED:
        try:
            probe._check_and_set(getattr(probe, key), sd[key], name)
        except AssertionError:
            out["mismatches"].append(name)
    for mode, (use_ck, override) in MODES.items():
        r = make(here, use_ck, override)
        try:
            r.load_state_dict(sd)
        except AssertionError as e:
            out[mode] = {"stops": True, "message": str(e)}
            continue
        points = sorted({r.num_steps, r.num_steps + 3, int(r.lr_decay_steps) - 2, int(r.lr_decay_steps) + 1})
        rates = []
        for n in points:
            r.num_steps = n
            rates.append([n, r.get_lr({}), r.get_wd()])
        out[mode] = {"stops": False, "values": {k: getattr(r, k) for k in VALUES}, "rates": rates}
    return out


def main():
    golden = {name: run_case(h, s, n) for name, (h, s, n) in CASES.items()}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".tmp", "w") as f:
        json.dump(golden, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(OUT + ".tmp", OUT)
    print(f"wrote {OUT}: {len(golden)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
