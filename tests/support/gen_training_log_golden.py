#!/usr/bin/env python3
"""Writes tests/data/trainer/training_log_golden.txt: what Megatron-LM core_v0.16.1 prints on its
standard output for a run (the log lines of the iterations, the evaluations, the end), for the
Azure GPT-3 tutorial's command line scaled down (04-gpt175B.sh: --train-iters, cosine decay with
--lr-warmup-fraction, train/valid/test data paths) and a sample-based WSD run with a batch-size
ramp and --log-throughput. The golden of tests/trainer/training_log_cli_test.cpp, which runs
ptk-train with each case's flags and compares its lines.

Megatron's own code decides everything that is printed:
  Megatron-LM core_v0.16.1 (source)  training_log, evaluate, evaluate_and_print_results,
                                     print_datetime, num_floating_point_operations,
                                     get_optimizer_param_scheduler, update_train_iters
                                     (megatron/training/training.py), its logging set-up
                                     (logging.basicConfig with log_handler.CustomHandler) and
                                     pretrain's prefixes of the final evaluations; taken from the
                                     source by name and run unchanged (megatron.training's package
                                     imports need more than this environment has)
  megatron-core 0.16.1 (installed)   OptimizerParamScheduler, get_canonical_lr_for_logging, the
                                     micro-batch calculators, Timers
What this script adds is train()'s loop reduced to what it logs (as gen_rampup_order_golden.py
reduces it to its data): before each iteration update_num_microbatches; the scheduler stepped by
the iteration's global batch (train_step, an update that succeeded); training_log with
is_first_iteration on the first; every --eval-interval iterations evaluate_and_print_results
('iteration N'); after the last, print_datetime('after training is done') and the validation and
test evaluations with pretrain's prefixes (verbose). A case with 'resumed_at' starts where
load_checkpoint leaves a run (args.iteration, consumed samples): at or past --train-iters, the loop runs
no iteration and only pretrain's end prints. The model is replaced by fixed losses: the
values that depend on the model (lm loss, grad norm, validation loss and PPL) and on the clock
(timestamps, times, throughput) are masked (MASKS, the test's too); everything else is compared
character for character: which lines come, the iterations, consumed samples, learning rates,
batch sizes, loss scale, skipped/nan counts, the prefixes and the 'Evaluating' lines.

Usage (a Megatron-LM checkout at core_v0.16.1, e.g. from a clone:
  git -C Megatron-LM archive core_v0.16.1 megatron/training | tar -x -C /tmp/mlm):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_training_log_golden.py \\
      --megatron-lm /tmp/mlm > tests/data/trainer/training_log_golden.txt
Output: per case a line 'case NAME', a line 'flags FLAGS' (ptk-train's, beside the tiny model and
the data paths the test adds), then the masked lines, then 'end'. Then 'unit fp16_overflow':
training_log alone over iterations an fp16 loss scaler skips (OVERFLOW), with a line 'run TRAIN_ITERS
GBS LOG_INTERVAL LR INITIAL_SCALE MIN_SCALE WINDOW HYSTERESIS', a line 'step ITERATION LOSS FOUND_INF
GRAD_NORM' per iteration ('-': None), the log lines (the clock masked), 'end'. Before it, per
SCHEDULES case 'schedule NAME', a line 'set KEY=VALUE ...' (its settings; '-': not given), a line 'ITERATION CONSUMED_BEFORE GLOBAL_BATCH LR WEIGHT_DECAY' per
iteration (repr: exact), 'end'.
"""
import argparse
import ast
import contextlib
import io
import os
import re
import socket
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# The tests' model (tests/trainer/train_cli_support.h TinyModel) and Megatron's flags of each case
# (model and data flags aside). valid/test: whether the run has a validation / test split.
CASES = {
    # 04-gpt175B.sh: --micro-batch-size 1 --global-batch-size 512 --train-iters 1500 --weight-decay 0.1
    # --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5
    # --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
    # --log-interval 10 --eval-interval 100 --eval-iters 10, train/valid/test data paths; here 12
    # iterations of 4 samples, decay over 30, a log line every 5, evaluation every 4 (fp32: the CPU).
    "azure_gpt3": dict(flags="--micro-batch-size 1 --global-batch-size 4 --train-iters 12 --weight-decay 0.1 "
                             "--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --lr 6.0e-5 "
                             "--lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 30 "
                             "--log-interval 5 --eval-interval 4 --eval-iters 2",
                       mbs=1, gbs=4, train_iters=12, train_samples=None, rampup=None, lr=6.0e-5, min_lr=6.0e-6,
                       style="cosine", warmup_fraction=0.001, warmup_iters=0, warmup_samples=0, decay_iters=30,
                       decay_samples=None, wsd_samples=None, wsd_style="exponential", weight_decay=0.1,
                       log_interval=5, eval_interval=4, eval_iters=2, valid=True, test=True, log_throughput=False),
    # Sample-based: a batch-size ramp 2 -> 4 over 8 samples, warm-up and decay in samples, WSD's
    # linear anneal over the last 12 samples, --log-throughput; no test split.
    "samples_wsd_rampup": dict(flags="--micro-batch-size 1 --global-batch-size 4 --train-samples 38 "
                                     "--rampup-batch-size 2 2 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style WSD "
                                     "--lr-wsd-decay-style linear --lr-wsd-decay-samples 12 --lr-warmup-samples 6 "
                                     "--lr-decay-samples 36 --log-interval 3 --eval-interval 5 --eval-iters 1 "
                                     "--log-throughput",
                               mbs=1, gbs=4, train_iters=None, train_samples=38, rampup=["2", "2", "8"], lr=1e-3,
                               min_lr=1e-4, style="WSD", warmup_fraction=None, warmup_iters=0, warmup_samples=6,
                               decay_iters=None, decay_samples=36, wsd_samples=12, wsd_style="linear",
                               weight_decay=0.01, log_interval=3, eval_interval=5, eval_iters=1, valid=True,
                               test=False, log_throughput=True),
}
# azure_gpt3's run resumed (--load) from its checkpoint of its last iteration: train() runs no iteration
# (its loop is `while iteration < args.train_iters`) and pretrain goes on to its end, the evaluations on the
# validation and test sets included. The test runs azure_gpt3 with --save first.
CASES["azure_gpt3_finished"] = dict(CASES["azure_gpt3"], resumed_at=12)

# Lines of the run's standard output compared (others, start-up notes, are not).
KEEP = re.compile(r"^( \[.*\] iteration |\[.*\] datetime: |training \.\.\.$| validation|-+$|Evaluating |"
                  r"INFO:megatron\.core\.timers:|    \S.*: \()")
# What depends on the model or the clock; the test applies the same.
MASKS = [
    (r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}", "<datetime>"),
    (r"(elapsed time per iteration \(ms\): )[0-9.]+", r"\1<ms>"),
    (r"(throughput per GPU \(TFLOP/s/GPU\): )[0-9.]+", r"\1<tflops>"),
    (r"(lm loss: |grad norm: |lm loss value: |lm loss PPL: )[-+0-9.eEnaif]+", r"\1<value>"),
    (r": \([0-9.]+, [0-9.]+\)$", ": (<ms>, <ms>)"),
    (r"^-+$", "<dashes>"),
]

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=32,
            padded_vocab_size=1024)


class Args(types.SimpleNamespace):
    """Megatron's args: what a case sets, else None (Megatron's default for the features not used)."""

    def __getattr__(self, name):
        return None


def source_functions(path, names, ns):
    """The top-level functions `names` of the source file `path`, compiled into namespace `ns`."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    if len(nodes) != len(names):
        raise SystemExit(f"{path}: expected {names}, found {[n.name for n in nodes]}")
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), ns)
    return tree


def final_prefixes(tree):
    """pretrain's prefixes of the evaluations after training: its `prefix = f'...'` assignments."""
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "pretrain")
    out = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "prefix"]
    if len(out) != 2:
        raise SystemExit("pretrain: expected two prefix assignments (validation, test)")
    return [compile(ast.Expression(body=v), "pretrain", "eval") for v in sorted(out, key=lambda v: v.lineno)]


def logging_setup(tree, ns):
    """training.py's module-level logging.basicConfig(handlers=[CustomHandler()], level=INFO)."""
    for n in tree.body:
        if isinstance(n, ast.Expr) and "basicConfig" in ast.dump(n):
            exec(compile(ast.Module(body=[n], type_ignores=[]), "training.py", "exec"), ns)
            return
    raise SystemExit("training.py: no logging.basicConfig")


def one_process_gloo_group(torch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def make_args(c):
    a = Args(**TINY, micro_batch_size=c["mbs"], global_batch_size=c["gbs"], data_parallel_size=1, world_size=1,
             train_iters=c["train_iters"], train_samples=c["train_samples"], rampup_batch_size=c["rampup"],
             lr=c["lr"], min_lr=c["min_lr"], lr_warmup_init=0.0, lr_decay_style=c["style"],
             lr_warmup_fraction=c["warmup_fraction"], lr_warmup_iters=c["warmup_iters"],
             lr_warmup_samples=c["warmup_samples"], lr_decay_iters=c["decay_iters"], lr_decay_samples=c["decay_samples"],
             lr_wsd_decay_samples=c["wsd_samples"], lr_wsd_decay_iters=None, lr_wsd_decay_style=c["wsd_style"],
             start_weight_decay=c["weight_decay"], end_weight_decay=c["weight_decay"], weight_decay_incr_style="constant",
             use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
             log_interval=c["log_interval"], eval_interval=c["eval_interval"], eval_iters=c["eval_iters"],
             log_throughput=c["log_throughput"], timing_log_level=0, tensorboard_log_interval=1, skipped_train_samples=0,
             consumed_train_samples=0, consumed_valid_samples=0, iteration=0, kv_channels=8, num_query_groups=4,
             group_query_attention=False, swiglu=False, is_hybrid_model=False, multi_latent_attention=False,
             hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0, moe_layer_freq=1,
             decoder_seq_length=None, empty_unused_memory_level=0, full_validation=False, multiple_validation_sets=False,
             sft=False, vision_pretraining=False, exit_duration_in_mins=None, cuda_graph_impl="none",
             cuda_graph_scope=[], do_valid=c["valid"], do_test=c["test"])
    if c.get("resumed_at"):  # load_checkpoint's iteration and data position (a fixed global batch)
        a.iteration = c["resumed_at"]
        a.consumed_train_samples = a.iteration * c["gbs"]
    return a


class Run:
    """train()'s loop and pretrain's end, reduced to what they print (see the module's docstring)."""

    def __init__(self, ns, nmc, c, args, prefixes, torch):
        self.ns, self.nmc, self.c, self.a, self.prefixes, self.torch = ns, nmc, c, args, prefixes, torch

    def forward_backward(self, num_microbatches, forward_only, **_):  # the model: fixed losses
        t = self.torch
        return [{"lm loss": t.tensor([7.0 * 32, 32.0])} for _ in range(num_microbatches)]

    def run(self):
        ns, a, t = self.ns, self.a, self.torch
        optimizer = types.SimpleNamespace(param_groups=[{"default_config": True}], is_stub_optimizer=False)
        scheduler = ns["get_optimizer_param_scheduler"](optimizer)
        ns["print_datetime"]("after dataloaders are built")
        print("training ...")
        timers = ns["get_timers"]()
        timers("interval-time", log_level=0).start(barrier=True)
        total_loss_dict, iteration, first = {}, a.iteration, True
        while iteration < a.train_iters:
            self.nmc.update_num_microbatches(a.consumed_train_samples, consistency_check=True)
            gbs = self.nmc.get_current_global_batch_size()
            scheduler.step(increment=gbs)  # train_step: the update succeeded
            iteration += 1
            a.consumed_train_samples += gbs
            loss_dict = {"lm loss": t.tensor(7.0 - 0.01 * iteration)}
            lr = ns["get_canonical_lr_for_logging"](optimizer.param_groups)
            ns["training_log"](loss_dict, total_loss_dict, lr, iteration, 1.0, False, 0, 1.5, None, None, None,
                               is_first_iteration=first)
            first = False
            if a.eval_interval and iteration % a.eval_interval == 0 and a.do_valid:
                timers("interval-time").stop()
                ns["evaluate_and_print_results"](f"iteration {iteration}", None, None, [], iteration, None,
                                                 self.config, verbose=False, write_to_tensorboard=True)
                timers("interval-time", log_level=0).start(barrier=True)
        ns["print_datetime"]("after training is done")
        for prefix, split in zip(self.prefixes, ("do_valid", "do_test")):
            if getattr(a, split):
                text = eval(prefix, {"iteration": iteration})
                ns["evaluate_and_print_results"](text, None, None, [], iteration, None, self.config, verbose=True,
                                                 write_to_tensorboard=True)


def megatron_namespace(mlm, torch, nmc, args, run_holder):
    from megatron.core import timers as core_timers
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import is_linear_attention_variant
    timers = core_timers.Timers(log_level=0, log_option="minmax")
    nothing = lambda *a, **k: None  # noqa: E731
    stub = types.SimpleNamespace
    ns = {"torch": torch, "math": math_module(), "time": __import__("time"), "logging": __import__("logging"),
          "datetime": __import__("datetime").datetime, "get_args": lambda: args, "get_timers": lambda: timers,
          "get_tensorboard_writer": lambda: None, "get_wandb_writer": lambda: None, "get_one_logger": lambda: None,
          "get_energy_monitor": lambda: None, "one_logger_utils": stub(track_app_tag=nothing, track_e2e_metrics=nothing),
          "reduce_max_stat_across_model_parallel_group": lambda v: v, "get_num_microbatches": nmc.get_num_microbatches,
          "update_num_microbatches": nmc.update_num_microbatches,
          "get_current_global_batch_size": nmc.get_current_global_batch_size,
          "print_rank_0": print, "print_rank_last": print, "is_last_rank": lambda: True, "has_rl_utils": False,
          "OptimizerParamScheduler": OptimizerParamScheduler, "get_canonical_lr_for_logging": get_canonical_lr_for_logging,
          "get_forward_backward_func": lambda: run_holder.forward_backward,
          "mpu": stub(is_pipeline_last_stage=lambda ignore_virtual=True: True,
                      get_data_parallel_group=lambda with_context_parallel=False: None),
          "get_rerun_state_machine": lambda: stub(get_mode=lambda: None, set_mode=nothing),
          "RerunMode": stub(DISABLED=None), "ft_integration": stub(on_eval_step_start=nothing, on_eval_step_end=nothing),
          "CudaGraphScope": stub(full_iteration="full_iteration"), "is_linear_attention_variant": is_linear_attention_variant}
    path = os.path.join(mlm, "megatron", "training", "training.py")
    tree = source_functions(path, ["training_log", "evaluate", "evaluate_and_print_results", "print_datetime",
                                   "num_floating_point_operations", "get_optimizer_param_scheduler",
                                   "update_train_iters"], ns)
    handler_ns = {}
    with open(os.path.join(mlm, "megatron", "training", "log_handler.py")) as f:
        exec(compile(f.read(), "log_handler.py", "exec"), handler_ns)
    ns["CustomHandler"] = handler_ns["CustomHandler"]
    return ns, tree


def math_module():
    import math
    return math


def run_case(mlm, name, c):
    import torch
    from make_torch_dist_distopt_fixture import cpu_shims
    from megatron.core import num_microbatches_calculator as nmc
    cpu_shims(torch)
    args = make_args(c)
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, c["rampup"], c["gbs"], c["mbs"], 1, False)
    holder = types.SimpleNamespace()
    ns, tree = megatron_namespace(mlm, torch, nmc, args, holder)
    run = Run(ns, nmc, c, args, final_prefixes(tree), torch)
    run.config = types.SimpleNamespace(timers=None)
    holder.forward_backward = run.forward_backward
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        import logging
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        logging_setup(tree, ns)  # its handler writes to sys.stdout as it is now: `out`
        run.run()  # get_optimizer_param_scheduler calls update_train_iters for a --train-samples run
    lines = []
    for line in out.getvalue().splitlines():
        if not KEEP.match(line):
            continue
        for pattern, repl in MASKS:
            line = re.sub(pattern, repl, line)
        lines.append(line)
    return lines


# training_log alone, over iterations an fp16 loss scaler skips (the model's numbers given, so nothing
# but the clock is masked): ITERATION, LM LOSS, FOUND_INF (the scaler found Inf/NaN: the iteration is
# skipped and its grad norm is None), GRAD NORM. Losses are multiples of 1/8 (exact in Megatron's
# float32 sums); iteration 6's loss is NaN (a nan iteration, not only a skipped one).
OVERFLOW = dict(train_iters=12, gbs=8, log_interval=3, lr=1e-4, initial_scale=65536.0, min_scale=1.0, window=3,
                hysteresis=2,
                steps=[(1, 7.0, 0, 2.5), (2, 6.875, 1, None), (3, 6.75, 0, 2.25), (4, 6.625, 1, None),
                       (5, 6.5, 1, None), (6, float("nan"), 1, None), (7, 6.375, 0, 1.5), (8, 6.25, 0, 1.25),
                       (9, 6.125, 1, None), (10, 6.0, 0, 1.0), (11, 5.875, 0, 0.875), (12, 5.75, 0, 0.75)])


def overflow_lines(mlm):
    """train()'s calls of training_log for OVERFLOW's iterations, the loss scale megatron-core 0.16.1's
    DynamicGradScaler holds after each step's update (what train() logs: optimizer.get_loss_scale())."""
    import torch
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    c = OVERFLOW
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, c["gbs"], c["gbs"], 1, False)
    args = make_args(dict(CASES["azure_gpt3"], gbs=c["gbs"], mbs=c["gbs"], train_iters=c["train_iters"],
                          log_interval=c["log_interval"]))
    ns, _ = megatron_namespace(mlm, torch, nmc, args, types.SimpleNamespace())
    scaler = DynamicGradScaler(initial_scale=c["initial_scale"], min_scale=c["min_scale"], growth_factor=2.0,
                               backoff_factor=0.5, growth_interval=c["window"], hysteresis=c["hysteresis"])
    out = io.StringIO()
    total = {}
    ns["get_timers"]()("interval-time", log_level=0).start(barrier=True)
    with contextlib.redirect_stdout(out):
        for it, loss, found_inf, norm in c["steps"]:
            scaler.update(bool(found_inf))
            args.consumed_train_samples += c["gbs"]
            ns["training_log"]({"lm loss": torch.tensor(loss)}, total, c["lr"], it, scaler.scale.item(), False,
                               found_inf, norm, None, None, None, is_first_iteration=it == 1)
    lines = []
    for line in out.getvalue().splitlines():
        for pattern, repl in MASKS[:2]:  # the clock only
            line = re.sub(pattern, repl, line)
        lines.append(line)
    return lines


# The learning rate and weight decay of every iteration, as get_optimizer_param_scheduler builds the
# scheduler from the flags and train_step steps it by each iteration's global batch (written with
# repr: compared exactly). name -> the flags (None: not given).
SCHEDULES = {
    # The Azure tutorial's: a warm-up fraction of 0.001 of a decay over 30 iterations (0.12 samples).
    "tutorial_cosine": dict(train_iters=20, train_samples=None, gbs=4, rampup=None, lr=6e-5, min_lr=6e-6, init=0.0,
                            style="cosine", fraction=0.001, warmup_iters=0, warmup_samples=0, decay_iters=30,
                            decay_samples=None, wsd_iters=None, wsd_samples=None, wsd_style="exponential",
                            start_wd=0.1, end_wd=0.1, wd_style="constant"),
    # Linear after 3 warm-up iterations from --lr-warmup-init, decay over --train-iters (the default);
    # weight decay rising linearly from 0 to 0.1 over the run.
    "linear_wd_linear": dict(train_iters=12, train_samples=None, gbs=8, rampup=None, lr=1e-3, min_lr=1e-4,
                             init=1e-5, style="linear", fraction=None, warmup_iters=3, warmup_samples=0,
                             decay_iters=None, decay_samples=None, wsd_iters=None, wsd_samples=None,
                             wsd_style="exponential", start_wd=0.0, end_wd=0.1, wd_style="linear"),
    # Inverse square root after a warm-up in samples, --train-samples; weight decay by cosine.
    "isqrt_samples_wd_cosine": dict(train_iters=None, train_samples=50, gbs=4, rampup=None, lr=2e-3, min_lr=1e-4,
                                    init=0.0, style="inverse-square-root", fraction=None, warmup_iters=0,
                                    warmup_samples=10, decay_iters=None, decay_samples=None, wsd_iters=None,
                                    wsd_samples=None, wsd_style="exponential", start_wd=0.01, end_wd=0.05,
                                    wd_style="cosine"),
    # WSD by iterations, its anneal by minus_sqrt over the last 5 of a decay longer than the run.
    "wsd_iters_minus_sqrt": dict(train_iters=16, train_samples=None, gbs=2, rampup=None, lr=1e-3, min_lr=0.0,
                                 init=0.0, style="WSD", fraction=None, warmup_iters=2, warmup_samples=0,
                                 decay_iters=18, decay_samples=None, wsd_iters=5, wsd_samples=None,
                                 wsd_style="minus_sqrt", start_wd=0.01, end_wd=0.01, wd_style="constant"),
    # A batch-size ramp: cosine over --lr-decay-samples shorter than the run (then --min-lr), a
    # warm-up in samples, weight decay rising linearly over --train-samples.
    "rampup_cosine_decay_samples": dict(train_iters=None, train_samples=40, gbs=8, rampup=["2", "2", "16"], lr=1e-3,
                                        min_lr=1e-4, init=0.0, style="cosine", fraction=None, warmup_iters=0,
                                        warmup_samples=4, decay_iters=None, decay_samples=30, wsd_iters=None,
                                        wsd_samples=None, wsd_style="exponential", start_wd=0.02, end_wd=0.08,
                                        wd_style="linear"),
    # A constant rate after a warm-up fraction of --train-samples' decay.
    "constant_fraction": dict(train_iters=None, train_samples=30, gbs=3, rampup=None, lr=5e-4, min_lr=0.0, init=0.0,
                              style="constant", fraction=0.25, warmup_iters=0, warmup_samples=0, decay_iters=None,
                              decay_samples=None, wsd_iters=None, wsd_samples=None, wsd_style="exponential",
                              start_wd=0.01, end_wd=0.01, wd_style="constant"),
}


def schedule_lines(mlm, c):
    """Per iteration: the samples consumed before it, its global batch, the rate and weight decay it
    logs (after the scheduler's step, as training_log's learning rate)."""
    import torch
    from megatron.core import num_microbatches_calculator as nmc
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, c["rampup"], c["gbs"], 1, 1, False)
    args = Args(train_iters=c["train_iters"], train_samples=c["train_samples"], global_batch_size=c["gbs"],
                micro_batch_size=1, rampup_batch_size=c["rampup"], lr=c["lr"], min_lr=c["min_lr"],
                lr_warmup_init=c["init"], lr_decay_style=c["style"], lr_warmup_fraction=c["fraction"],
                lr_warmup_iters=c["warmup_iters"], lr_warmup_samples=c["warmup_samples"],
                lr_decay_iters=c["decay_iters"], lr_decay_samples=c["decay_samples"],
                lr_wsd_decay_iters=c["wsd_iters"], lr_wsd_decay_samples=c["wsd_samples"],
                lr_wsd_decay_style=c["wsd_style"], start_weight_decay=c["start_wd"], end_weight_decay=c["end_wd"],
                weight_decay_incr_style=c["wd_style"], use_checkpoint_opt_param_scheduler=False,
                override_opt_param_scheduler=False)
    ns, _ = megatron_namespace(mlm, torch, nmc, args, types.SimpleNamespace())
    optimizer = types.SimpleNamespace(param_groups=[{"default_config": True}])
    with contextlib.redirect_stdout(io.StringIO()):  # update_train_iters' line
        sched = ns["get_optimizer_param_scheduler"](optimizer)
    consumed, out = 0, []
    for it in range(1, args.train_iters + 1):
        nmc.update_num_microbatches(consumed, consistency_check=True)
        gbs = nmc.get_current_global_batch_size()
        sched.step(increment=gbs)
        g = optimizer.param_groups[0]
        out.append(f"{it} {consumed} {gbs} {g['lr']!r} {g['weight_decay']!r}")
        consumed += gbs
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout at core_v0.16.1")
    args = ap.parse_args()
    import torch
    one_process_gloo_group(torch)
    for name, c in CASES.items():
        print(f"case {name}")
        print(f"flags {c['flags']}")
        for line in run_case(args.megatron_lm, name, c):
            print(line)
        print("end")
    for name, c in SCHEDULES.items():
        print(f"schedule {name}")
        print("set " + " ".join(f"{k}={'-' if v is None else ','.join(v) if isinstance(v, list) else repr(v) if isinstance(v, float) else v}"
                                 for k, v in c.items()))
        for line in schedule_lines(args.megatron_lm, c):
            print(line)
        print("end")
    c = OVERFLOW
    print("unit fp16_overflow")
    print("run {} {} {} {!r} {!r} {!r} {} {}".format(c["train_iters"], c["gbs"], c["log_interval"], c["lr"],
                                                    c["initial_scale"], c["min_scale"], c["window"], c["hysteresis"]))
    for it, loss, found_inf, norm in c["steps"]:
        print("step {} {!r} {} {}".format(it, loss, found_inf, "-" if norm is None else repr(norm)))
    for line in overflow_lines(args.megatron_lm):
        print(line)
    print("end")


if __name__ == "__main__":
    main()
