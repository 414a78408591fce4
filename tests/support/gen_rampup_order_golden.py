#!/usr/bin/env python3
"""Writes tests/data/trainer/rampup_order.json: the training and validation samples, iteration by
iteration, that a Megatron-LM run takes for a few batch settings (--train-iters or --train-samples,
with and without --rampup-batch-size START INCR SAMPLES, evaluation intervals, a resume mid-ramp),
from the datasets Megatron builds for them. The golden of tests/trainer/rampup_order_test.cpp.

Megatron's own code decides everything that is Megatron's:
  megatron-core 0.16.1 (installed)     RampupBatchsizeNumMicroBatchesCalculator / the constant one
                                       (init_num_microbatches_calculator, update_num_microbatches),
                                       BlendedMegatronDatasetBuilder, GPTDataset, BlendedDataset
  Megatron-LM core_v0.16.1 (source)    update_train_iters and get_train_valid_test_num_samples
                                       (megatron/training/training.py) and MegatronPretrainingSampler
                                       (megatron/training/datasets/data_samplers.py), taken from the
                                       source file by name and run unchanged (megatron.training is
                                       not on PyPI, and importing it needs a GPU stack)
What this script adds is the loop of megatron/training/training.py's train() and evaluate() reduced
to their data: before each iteration update_num_microbatches(consumed samples); each data-parallel
rank draws get_num_microbatches() micro-batches from its sampler; consumed samples grow by the
current global batch; every --eval-interval iterations, and once after the last, --eval-iters
global batches (the full --global-batch-size, as evaluate()) from the validation sampler, and after
the last that many from the test split's start. A resume
rebuilds the samplers from the consumed train and validation samples, as
build_train_valid_test_data_loaders does after load_checkpoint.

A sample is written as its fingerprint: its first four tokens and the sum of its seq_length + 1
tokens (the tokens and the last label). Each case also records the cache file names
BlendedMegatronDatasetBuilder wrote (they hash each dataset's description, num_samples included)
and whether the samples would differ had the training split been sized by the samples the run
consumes instead of Megatron's num_samples (the corner ptk got wrong).

Usage (a Megatron-LM checkout at core_v0.16.1, e.g. from a clone:
  git -C Megatron-LM archive core_v0.16.1 megatron/training | tar -x -C /tmp/mlm):
  PYTHONPATH=/opt/ptk-pyref /usr/bin/python3 tests/support/gen_rampup_order_golden.py --megatron-lm /tmp/mlm
Debian's python3 (numpy 1.24, torch 1.13), as gen_gpt_dataset_goldens.py: the data code runs on it
through megatron_shim, and Megatron's GPT2BPETokenizer needs transformers' AutoTokenizer, which the
/opt/ptk-torch26 venv cannot import (no `requests`). The datasets are tests/data/gpt_dataset/gpt_data
(gen_gpt_dataset_goldens.py writes them).
"""
import argparse
import ast
import json
import os
import shutil
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_shim  # noqa: E402
import ref_env  # noqa: E402

GPT_DATA = os.path.join(ref_env.ROOT, "tests", "data", "gpt_dataset", "gpt_data")
OUT = os.path.join(ref_env.ROOT, "tests", "data", "trainer", "rampup_order.json")

# name -> the run's data and batch flags. train_iters / train_samples: one of the two (0: unset);
# rampup: --rampup-batch-size or None; resume_at: the run stops after this iteration (its checkpoint)
# and a second run resumes from it (0: one run).
CASES = {
    # One prefix (Megatron builds a GPTDataset): the ramp's iterations consume 44 of --train-samples
    # 46; 46 samples take the ninth epoch's five samples whole, 44 only three of them (below 80% of an
    # epoch: a separately shuffled last epoch).
    "tiny_ramp": dict(blend=["gpt_data/tiny"], split="1,0,0", seq=4, mbs=2, dp=1, gbs=8, train_iters=0,
                      train_samples=46, rampup=[2, 2, 16], eval_interval=1000, eval_iters=0, resume_at=0),
    # The same stopped mid-ramp (iteration 4: 10 samples consumed, batch 4) and resumed.
    "tiny_ramp_resume": dict(blend=["gpt_data/tiny"], split="1,0,0", seq=4, mbs=2, dp=1, gbs=8, train_iters=0,
                             train_samples=46, rampup=[2, 2, 16], eval_interval=1000, eval_iters=0, resume_at=4),
    # A weighted blend (BlendedDataset, sized exactly), two data-parallel ranks, validation every 3
    # iterations and the test split at the end, resumed mid-ramp at iteration 3.
    "blend_ramp_eval": dict(blend=["0.5", "gpt_data/B", "0.5", "gpt_data/C"], split="85,10,5", seq=32, mbs=2,
                            dp=2, gbs=12, train_iters=0, train_samples=75, rampup=[4, 4, 16], eval_interval=3,
                            eval_iters=2, resume_at=3),
    # No ramp, --train-samples not a multiple of the global batch.
    "tiny_samples": dict(blend=["gpt_data/tiny"], split="1,0,0", seq=4, mbs=2, dp=1, gbs=8, train_iters=0,
                         train_samples=46, rampup=None, eval_interval=1000, eval_iters=0, resume_at=0),
    # --train-iters with validation (what ptk matched already).
    "blend_iters_eval": dict(blend=["0.5", "gpt_data/B", "0.5", "gpt_data/C"], split="90,10,0", seq=32, mbs=2,
                             dp=2, gbs=8, train_iters=7, train_samples=0, rampup=None, eval_interval=2,
                             eval_iters=1, resume_at=0),
    # --train-samples below the ramp's samples: the ramp's iterations take 20 samples of a split built
    # for 14 (three whole epochs: 15 samples); Megatron's loader runs out at iteration 6.
    "tiny_ramp_short": dict(blend=["gpt_data/tiny"], split="1,0,0", seq=4, mbs=2, dp=1, gbs=8, train_iters=0,
                            train_samples=14, rampup=[2, 2, 16], eval_interval=1000, eval_iters=0, resume_at=0),
}


def load_megatron_training(mlm):
    """update_train_iters, get_train_valid_test_num_samples and MegatronPretrainingSampler from the
    Megatron-LM source, compiled alone (their module imports need a GPU stack)."""
    from megatron.core import num_microbatches_calculator as nmc
    ns = {"update_num_microbatches": nmc.update_num_microbatches,
          "get_current_global_batch_size": nmc.get_current_global_batch_size,
          "print_rank_0": lambda *a, **k: print(*a, file=sys.stderr)}
    wanted = {os.path.join("megatron", "training", "training.py"): ("update_train_iters",
                                                                    "get_train_valid_test_num_samples"),
              os.path.join("megatron", "training", "datasets", "data_samplers.py"): ("MegatronPretrainingSampler",)}
    for rel, names in wanted.items():
        path = os.path.join(mlm, rel)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
        if len(nodes) != len(names):
            raise SystemExit(f"{path}: expected {names}, found {[n.name for n in nodes]}")
        exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), ns)
    return ns, nmc


def fingerprint(ds, i):
    s = ds[i]
    text = s["tokens"].tolist() + [int(s["labels"][-1])]
    return text[:4] + [sum(text)]


def build(c, sizes, cache, tok):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=c["seq"], path_to_cache=cache, tokenizer=tok,
                           blend=get_blend_from_list(c["blend"]), split=c["split"], reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, cfg).build()


class Run:
    """Megatron's train()/evaluate() loop reduced to the samples it draws."""

    def __init__(self, ns, nmc, c, args, datasets):
        self.ns, self.nmc, self.c, self.args = ns, nmc, c, args
        self.train, self.valid, self.test = datasets
        self.iterations, self.evaluations, self.test_batches = [], [], []
        self.runs_out_at = 0

    def samplers(self, ds, consumed):
        S = self.ns["MegatronPretrainingSampler"]
        return [iter(S(total_samples=len(ds), consumed_samples=consumed, micro_batch_size=self.c["mbs"],
                       data_parallel_rank=r, data_parallel_size=self.c["dp"])) for r in range(self.c["dp"])]

    def open(self):  # build_train_valid_test_data_loaders, from the consumed samples
        a = self.args
        self.train_it = self.samplers(self.train, a.consumed_train_samples)
        self.valid_it = self.samplers(self.valid, a.consumed_valid_samples) if self.valid is not None else None
        self.nmc.update_num_microbatches(a.consumed_train_samples, consistency_check=False)

    def draw(self, its, n):  # n micro-batches of every rank: [micro-batch][rank] -> sample indices
        return [[next(it) for it in its] for _ in range(n)]

    def evaluate(self, at):
        a = self.args
        n = a.global_batch_size // (a.micro_batch_size * self.c["dp"])
        batches = []
        for _ in range(a.eval_iters):
            batches.append(self.draw(self.valid_it, n))
            a.consumed_valid_samples += a.global_batch_size
        self.evaluations.append({"after_iteration": at, "batches": batches})

    def train_to(self, last):
        a = self.args
        while a.iteration < last:
            self.nmc.update_num_microbatches(a.consumed_train_samples, consistency_check=True)
            try:
                mbs = self.draw(self.train_it, self.nmc.get_num_microbatches())
            except StopIteration:  # Megatron's get_batch would raise it here
                self.runs_out_at = a.iteration + 1
                return False
            a.iteration += 1
            gbs = self.nmc.get_current_global_batch_size()
            self.iterations.append({"iteration": a.iteration, "global_batch_size": gbs,
                                    "consumed_before": a.consumed_train_samples, "batches": mbs})
            a.consumed_train_samples += gbs
            if self.valid_it is not None and a.eval_iters > 0 and a.iteration % a.eval_interval == 0:
                self.evaluate(a.iteration)
        return True


def run_case(ns, nmc, name, c, tok, work):
    a = types.SimpleNamespace(train_iters=c["train_iters"] or None, train_samples=c["train_samples"] or None,
                              global_batch_size=c["gbs"], micro_batch_size=c["mbs"], rampup_batch_size=c["rampup"],
                              eval_iters=c["eval_iters"], eval_interval=c["eval_interval"], full_validation=False,
                              skip_train=False, phase_transition_iterations=None, iteration=0,
                              consumed_train_samples=0, consumed_valid_samples=0)
    ns["get_args"] = lambda: a
    nmc.destroy_num_microbatches_calculator()
    rampup = [str(x) for x in c["rampup"]] if c["rampup"] else None  # argparse gives strings
    nmc.init_num_microbatches_calculator(0, rampup, c["gbs"], c["mbs"], c["dp"], False)
    a.rampup_batch_size = rampup
    ns["update_train_iters"](a)  # get_optimizer_param_scheduler calls it for a --train-samples run
    sizes = ns["get_train_valid_test_num_samples"]()
    cache = os.path.join(work, name)
    datasets = build(c, sizes, cache, tok)
    run = Run(ns, nmc, c, a, datasets)
    run.open()
    finished = True
    if c["resume_at"]:
        finished = run.train_to(c["resume_at"])
        run.open()  # a new process: load_checkpoint, then the loaders from the consumed samples
    finished = finished and run.train_to(a.train_iters)
    if finished and run.valid_it is not None and a.eval_iters > 0:
        run.evaluate(a.iteration)  # pretrain's evaluation at the end of training
    if finished and run.test is not None and a.eval_iters > 0:  # and on the test split, from its start
        test_it = run.samplers(run.test, 0)
        n = a.global_batch_size // (a.micro_batch_size * c["dp"])
        run.test_batches = [run.draw(test_it, n) for _ in range(a.eval_iters)]
    used = sorted({i for it in run.iterations for mb in it["batches"] for r in mb for i in r})
    valid_used = sorted({i for e in run.evaluations for b in e["batches"] for mb in b for r in mb for i in r})
    test_used = sorted({i for b in run.test_batches for mb in b for r in mb for i in r})
    rec = {"case": c, "train_iters": a.train_iters, "num_samples": list(sizes),
           "lengths": [len(d) if d is not None else None for d in datasets],
           "cache_files": sorted(os.listdir(cache)), "runs_out_at_iteration": run.runs_out_at,
           "iterations": run.iterations, "evaluations": run.evaluations,
           "train_samples": {str(i): fingerprint(datasets[0], i) for i in used},
           "valid_samples": {str(i): fingerprint(datasets[1], i) for i in valid_used},
           "test_batches": run.test_batches, "test_samples": {str(i): fingerprint(datasets[2], i) for i in test_used}}
    # The corner: the training split sized by the samples the iterations consume.
    consumed = sum(it["global_batch_size"] for it in run.iterations)
    if consumed != sizes[0]:
        other = build(c, [consumed, sizes[1], sizes[2]], os.path.join(work, name + "-consumed"), tok)
        rec["differs_if_sized_by_consumed"] = any(
            i >= len(other[0]) or fingerprint(other[0], i) != rec["train_samples"][str(i)] for i in used)
    else:
        rec["differs_if_sized_by_consumed"] = False
    print(f"{name}: train_iters {a.train_iters}, num_samples {sizes}, consumed {consumed}, runs out at "
          f"{run.runs_out_at}, differs if sized by consumed: {rec['differs_if_sized_by_consumed']}", file=sys.stderr)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout at core_v0.16.1")
    args = ap.parse_args()
    megatron_shim.install(training_args=True)
    ns, nmc = load_megatron_training(args.megatron_lm)
    work = tempfile.mkdtemp(prefix="ptk-rampup-")
    megatron_shim.offline_gpt2_workdir(work, ref_env.VOCAB, ref_env.MERGES)
    shutil.copytree(GPT_DATA, os.path.join(work, "gpt_data"))
    os.chdir(work)
    megatron_shim.one_process_gloo_group()
    tok = megatron_shim.gpt2_bpe_tokenizer()
    out = {name: run_case(ns, nmc, name, c, tok, work) for name, c in CASES.items()}
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    os.replace(tmp, OUT)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
