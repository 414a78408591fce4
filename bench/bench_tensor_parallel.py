"""What tensor parallelism costs on CPU ranks: ptk-train at --tensor-model-parallel-size 2 (two
processes over gloo on loopback) beside one rank, in the same run, on the same cores.

Two anchors: one rank with as many threads as the two ranks have together (the same cores used as
one process), and one rank with one thread (the work of one tensor rank's share, undivided). Same
model (the same padded vocabulary), micro-batch, sequence and mock data, fp32, no dropout; the lm loss lines of the T=2 run are
checked against the one-rank run's before any time is read. Each figure is the median of the
log's 'elapsed time per iteration' after the first two intervals; the runs take turns (--rounds),
so that this VM's drifts reach all of them alike.

Usage: /usr/bin/python3 bench/bench_tensor_parallel.py --bin build/bin [--iters 12] [--rounds 2]
Prints one JSON object: tokens/s of each and the ratios T=2 / one rank.
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

MODELS = {
    "2L-h256-s128": dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=128, mbs=4),
    "4L-h512-s256": dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, mbs=2),
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(bin_dir, m, iters, threads, tensor):
    return [os.path.join(bin_dir, "ptk-train"), "--num-layers", str(m["num_layers"]), "--hidden-size",
            str(m["hidden_size"]), "--num-attention-heads", str(m["num_attention_heads"]), "--seq-length",
            str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]), "--micro-batch-size",
            str(m["mbs"]), "--global-batch-size", str(m["mbs"]), "--train-iters", str(iters), "--lr", "1e-4",
            "--lr-decay-style", "constant", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--eval-iters", "0", "--log-interval", "1", "--threads", str(threads),
            "--tensor-model-parallel-size", str(tensor),
            # the same padded vocabulary at every T (Megatron pads to divisible-by x T), so the same model
            "--make-vocab-size-divisible-by", str(128 // tensor)]


def parse(out):
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    losses = re.findall(r"lm loss: ([0-9.E+-]+)", out)
    if len(ms) < 4:
        sys.exit(f"bench_tensor_parallel: too few log lines:\n{out[-2000:]}")
    return statistics.median(ms[2:]) / 1000.0, losses


def one_rank(bin_dir, m, iters, threads):
    r = subprocess.run(command(bin_dir, m, iters, threads, 1), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bench_tensor_parallel: one rank failed:\n{r.stdout[-1000:]}{r.stderr[-2000:]}")
    return parse(r.stdout)


def two_ranks(bin_dir, m, iters):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen(command(bin_dir, m, iters, 1, 2), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate() for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"bench_tensor_parallel: a T=2 rank failed:\n{o[-1000:]}{e[-2000:]}")
    return parse(outs[-1][0])  # the log lines are the last rank's (Megatron's print_rank_last)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    res = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "models": {}}
    for name, m in MODELS.items():
        tokens = m["mbs"] * m["seq_length"]
        t1, t2, tp = [], [], []
        for _ in range(args.rounds):
            a, loss_one = one_rank(args.bin, m, args.iters, 2)
            b, _ = one_rank(args.bin, m, args.iters, 1)
            c, loss_tp = two_ranks(args.bin, m, args.iters)
            if len(loss_tp) != len(loss_one) or any(
                    abs(float(x) - float(y)) > 1e-5 * abs(float(y)) for x, y in zip(loss_tp, loss_one)):
                sys.exit(f"bench_tensor_parallel: T=2 losses {loss_tp[:4]} differ from one rank's {loss_one[:4]}")
            t2.append(a)
            t1.append(b)
            tp.append(c)
        one2, one1, two = statistics.median(t2), statistics.median(t1), statistics.median(tp)
        res["models"][name] = {
            "one_rank_2_threads_tokens_per_s": round(tokens / one2),
            "one_rank_1_thread_tokens_per_s": round(tokens / one1),
            "t2_two_ranks_1_thread_each_tokens_per_s": round(tokens / two),
            "ratio_t2_vs_one_rank_same_cores": round(one2 / two, 2),
            "ratio_t2_vs_one_rank_1_thread": round(one1 / two, 2),
        }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
