"""The pipeline bubble of ptk-train's 1F1B schedule on CPU ranks, measured beside Megatron's formula.

ptk-train at --pipeline-model-parallel-size P (P processes over gloo on loopback, one thread each)
and one rank with one thread, on the same model, mock data and micro-batches, fp32, no dropout; the
lm loss lines of the P-stage run are checked against the one-rank run's before any time is read.
With t1 the one rank's time per iteration, a stage's share of the work is t1 / P: the measured
bubble is 1 - (t1 / P) / tP, the share of the P-stage iteration a stage spends not computing
(waiting in the warm-up and cool-down, and sending), beside the formula (P - 1) / (m + P - 1) for m
micro-batches per iteration. P processes need P free cores for the figure to mean anything: the
script refuses a P above os.cpu_count(). Each time is the median of the log's 'elapsed time per
iteration' after the first two intervals; the runs take turns (--rounds).

Usage: /usr/bin/python3 bench/bench_pipeline_bubble.py --bin build/bin [--stages 2] [--micro 1 2 4 8]
Prints one JSON object: per m, the times, the measured bubble and the formula's.
"""
import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys

# The output layer over GPT-2's 50257 tokens costs about as much as 8 of these layers: at P = 2 the
# first stage takes 10 layers and the last 2 and the head, so that the stages are balanced and the
# figure is the schedule's bubble, not one stage waiting for a heavier one.
MODEL = dict(num_layers=12, hidden_size=512, num_attention_heads=8, seq_length=64)
FIRST_STAGE_LAYERS = {2: 10}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(bin_dir, micro, iters, stages):
    m = MODEL
    return [os.path.join(bin_dir, "ptk-train"), "--num-layers", str(m["num_layers"]), "--hidden-size",
            str(m["hidden_size"]), "--num-attention-heads", str(m["num_attention_heads"]), "--seq-length",
            str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]), "--micro-batch-size", "1",
            "--global-batch-size", str(micro), "--train-iters", str(iters), "--lr", "1e-4", "--lr-decay-style",
            "constant", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
            "--log-interval", "1", "--threads", "1", "--pipeline-model-parallel-size", str(stages)] + (
                ["--decoder-first-pipeline-num-layers", str(FIRST_STAGE_LAYERS[stages])]
                if stages in FIRST_STAGE_LAYERS else [])


def parse(out):
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    losses = re.findall(r"lm loss: ([0-9.E+-]+)", out)
    if len(ms) < 4:
        sys.exit(f"bench_pipeline_bubble: too few log lines:\n{out[-2000:]}")
    return statistics.median(ms[2:]) / 1000.0, losses


def run(bin_dir, micro, iters, stages):
    port = free_port()
    procs = []
    for rank in range(stages):
        env = dict(os.environ, WORLD_SIZE=str(stages), RANK=str(rank), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(command(bin_dir, micro, iters, stages), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate() for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"bench_pipeline_bubble: a rank of P={stages} failed:\n{o[-1000:]}{e[-2000:]}")
    return parse(outs[0][0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    P = args.stages
    if P > (os.cpu_count() or 1):
        sys.exit(f"bench_pipeline_bubble: {P} stages need {P} cores, this machine has {os.cpu_count()}")
    res = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "stages": P,
           "model": MODEL, "micro_batches": {}}
    for m in args.micro:
        t1s, tps = [], []
        for _ in range(args.rounds):
            t1, loss_one = run(args.bin, m, args.iters, 1)
            tp, loss_pp = run(args.bin, m, args.iters, P)
            if len(loss_pp) != len(loss_one) or any(
                    abs(float(x) - float(y)) > 1e-6 * abs(float(y)) for x, y in zip(loss_pp, loss_one)):
                sys.exit(f"bench_pipeline_bubble: P={P} losses {loss_pp[:4]} differ from one rank's {loss_one[:4]}")
            t1s.append(t1)
            tps.append(tp)
        t1, tp = statistics.median(t1s), statistics.median(tps)
        res["micro_batches"][str(m)] = {
            "one_rank_s_per_iteration": round(t1, 4),
            "pipeline_s_per_iteration": round(tp, 4),
            "speedup": round(t1 / tp, 2),
            "measured_bubble": round(1.0 - (t1 / P) / tp, 3),
            "formula_bubble": round((P - 1) / (m + P - 1), 3),
        }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
