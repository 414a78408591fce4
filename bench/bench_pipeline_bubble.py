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

The P-stage run has --timing-log-level 2 --timing-log-option all (on CPU ranks the timers read a
clock and synchronise nothing): per stage, the median over the same iterations of its compute
(forward-compute + backward-compute), its time in the 1F1B exchanges (forward-recv, forward-send,
..., each stage's wait for its neighbour and the copy), the tied embeddings' all-reduce, the
optimizer, the batch generator and what the iteration spends outside them. The one-rank run has
--timing-log-level 1 (its forward-backward and optimizer). With tP the P-stage iteration, the
measured bubble times tP is tP - t1 / P, which each stage's timers split exactly into: its compute
above the one rank's forward-backward / P (a stage slower than its share: imbalance, or cores that
the P processes share), its exchange waits (the schedule's bubble, which the formula predicts), the
tied embeddings' all-reduce, its optimizer above the one rank's / P, and the rest (zeroing,
loss reduction, logging).

Usage: /usr/bin/python3 bench/bench_pipeline_bubble.py --bin build/bin [--stages 2] [--micro 1 2 4 8]
Prints one JSON object: per m, the times, the measured bubble and the formula's, and the stages' timers.
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


# Megatron's 1F1B exchange timers: the time a stage waits for its neighbour (and copies).
P2P = ["forward-recv", "forward-send", "backward-recv", "backward-send", "forward-send-backward-recv",
       "backward-send-forward-recv"]


def command(bin_dir, micro, iters, stages):
    m = MODEL
    return [os.path.join(bin_dir, "ptk-train"), "--num-layers", str(m["num_layers"]), "--hidden-size",
            str(m["hidden_size"]), "--num-attention-heads", str(m["num_attention_heads"]), "--seq-length",
            str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]), "--micro-batch-size", "1",
            "--global-batch-size", str(micro), "--train-iters", str(iters), "--lr", "1e-4", "--lr-decay-style",
            "constant", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
            "--log-interval", "1", "--threads", "1", "--pipeline-model-parallel-size", str(stages)] + (
                ["--decoder-first-pipeline-num-layers", str(FIRST_STAGE_LAYERS[stages])]
                if stages in FIRST_STAGE_LAYERS else []) + (
                    ["--timing-log-level", "2", "--timing-log-option", "all"] if stages > 1 else
                    ["--timing-log-level", "1", "--timing-log-option", "max"])


def parse_one_rank_timers(out):
    """The one rank's median ms per iteration of forward-backward and optimizer (blocks after the first two)."""
    per = {}
    for block in out.split("max time across ranks (ms):")[1:][2:]:
        for line in block.splitlines()[1:]:
            m = re.match(r"^    (\S+) \.+: ([0-9.]+)$", line)
            if not m:
                break
            per.setdefault(m.group(1), []).append(float(m.group(2)))
    return {k: statistics.median(v) for k, v in per.items()}


def parse_timers(out, stages):
    """Per stage, the median ms per iteration of each timer over the blocks after the first two."""
    blocks = out.split("times across ranks (ms):")[1:]
    per = {}  # (name, rank) -> [ms per block]
    for block in blocks[2:]:
        name = None
        for line in block.splitlines()[1:]:
            m = re.match(r"^  (\S+):$", line)
            r = re.match(r"^     rank +(\d+): ([0-9.]+)$", line)
            if m:
                name = m.group(1)
            elif r and name:
                per.setdefault((name, int(r.group(1))), []).append(float(r.group(2)))
            else:
                break
    med = lambda name, rank: statistics.median(per.get((name, rank), [0.0]))
    res = []
    for rank in range(stages):
        compute = med("forward-compute", rank) + med("backward-compute", rank)
        res.append({
            "stage": rank,
            "forward_compute_ms": round(med("forward-compute", rank), 1),
            "backward_compute_ms": round(med("backward-compute", rank), 1),
            "p2p_wait_ms": round(sum(med(n, rank) for n in P2P), 1),
            "p2p_ms": {n: round(med(n, rank), 1) for n in P2P if (n, rank) in per},
            "embedding_all_reduce_ms": round(med("embedding-grads-all-reduce", rank), 1),
            "forward_backward_ms": round(med("forward-backward", rank), 1),
            "optimizer_ms": round(med("optimizer", rank), 1),
            "batch_generator_ms": round(med("batch-generator", rank), 1),
            "compute_share": round(compute / max(med("forward-backward", rank), 1e-9), 3),
        })
    return res


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
    # The log lines and the timer blocks are the last rank's (Megatron's print_rank_last and timers.log).
    t, losses = parse(outs[-1][0])
    return t, losses, parse_timers(outs[-1][0], stages) if stages > 1 else parse_one_rank_timers(outs[0][0])


def bubble_sources(stage, one, t1, tp, P):
    """A stage's split of tP - t1 / P (ms), as fractions of tP: they add up to the measured bubble."""
    fb1, opt1 = one.get("forward-backward", 0.0), one.get("optimizer", 0.0)
    compute = stage["forward_compute_ms"] + stage["backward_compute_ms"]
    parts = {
        "compute_above_one_rank_share": compute - fb1 / P,
        "p2p_wait": stage["p2p_wait_ms"],
        "embedding_all_reduce": stage["embedding_all_reduce_ms"],
        "optimizer_above_one_rank_share": stage["optimizer_ms"] - opt1 / P,
    }
    parts["rest"] = (tp - t1 / P) * 1000.0 - sum(parts.values())
    return {k: round(v / (tp * 1000.0), 3) for k, v in parts.items()}


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
           "load_average_at_start": os.getloadavg()[0],
           "model": MODEL, "micro_batches": {}}
    for m in args.micro:
        t1s, tps, stage_timers = [], [], []
        for _ in range(args.rounds):
            t1, loss_one, one = run(args.bin, m, args.iters, 1)
            tp, loss_pp, timers = run(args.bin, m, args.iters, P)
            for st in timers:
                st["bubble_sources"] = bubble_sources(st, one, t1, tp, P)
            stage_timers.append({"one_rank_ms": {k: round(v, 1) for k, v in one.items()}, "stages": timers})
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
            "stages": stage_timers[len(stage_timers) // 2],  # one round's (the runs take turns)
        }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
