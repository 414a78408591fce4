#!/usr/bin/env python3
"""Turns ptk-train's metrics (JSON lines, one per iteration and one per evaluation) into a loss-curve PNG.

Usage: python3 scripts/plot-loss.py METRICS.jsonl [METRICS2.jsonl ...] -o loss.png [--title T]
A directory (ptk-train's --tensorboard-dir) stands for the metrics.jsonl in it. Each file is one curve (a resumed run appends to the same file, so one file is one run). The
evaluations' records ("lm_loss_validation", "lm_loss_test", ... in place of "lm_loss") are passed over; other lines
that are not JSON objects with "iteration" and "lm_loss" are an error naming the file and line.
Needs matplotlib (Debian: python3-matplotlib, installed by scripts/install-deps.sh): a Python
without it (a virtualenv's first on PATH) reruns the script with one that has it, or names it.
"""
import argparse
import json
import os
import sys


def metrics_file(path):
    """PATH, or DIR/metrics.jsonl for a directory; a path that names no file is one line saying so."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "metrics.jsonl")):
            return os.path.join(path, "metrics.jsonl")
        sys.exit(f"plot-loss: {path}: a directory without metrics.jsonl (ptk-train writes it in its "
                 f"--tensorboard-dir, or at --metrics-file)")
    if not os.path.exists(path):
        sys.exit(f"plot-loss: {path}: no such file (ptk-train writes metrics.jsonl in its --tensorboard-dir, "
                 f"or at --metrics-file)")
    return path


def read(path):
    its, losses = {}, {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if "lm_loss" not in rec and any(k.startswith("lm_loss_") for k in rec):
                    continue  # an evaluation's record: the curve is the training loss
                it, loss = int(rec["iteration"]), float(rec["lm_loss"])
            except (ValueError, KeyError, TypeError) as e:
                sys.exit(f"plot-loss: {path}:{n}: not a metrics record ({e})")
            if not rec.get("skipped", False):
                losses[it] = loss  # a resumed run may repeat iterations: the last one wins
    its = sorted(losses)
    return its, [losses[i] for i in its]


# Interpreters that may have matplotlib where the one running this does not (a virtualenv or pyenv
# Python first on PATH, while Debian's python3-matplotlib is installed for /usr/bin/python3).
CANDIDATES = ["/usr/bin/python3", "/usr/local/bin/python3", "python3", "python"]


def has_matplotlib(python):
    import subprocess
    try:
        return subprocess.run([python, "-c", "import matplotlib"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_where_matplotlib_is():
    """Reruns this script with an interpreter that has matplotlib, or says exactly what to do."""
    import shutil
    if not os.environ.get("PTK_PLOT_LOSS_REEXEC"):
        for c in CANDIDATES:
            path = shutil.which(c)
            if path and path != sys.executable and has_matplotlib(path):
                print(f"plot-loss: note: {sys.executable} has no matplotlib; running {path}, which has it",
                      file=sys.stderr)
                os.environ["PTK_PLOT_LOSS_REEXEC"] = "1"
                os.execv(path, [path, os.path.abspath(__file__)] + sys.argv[1:])
    sys.exit(f"plot-loss: matplotlib is missing for {sys.executable} and for every other python3 found "
             f"({', '.join(CANDIDATES)}): install it for one of them (Debian: apt-get install python3-matplotlib, "
             f"for /usr/bin/python3; or {sys.executable} -m pip install matplotlib)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--title", default="ptk-train: lm loss")
    args = ap.parse_args()
    args.metrics = [metrics_file(p) for p in args.metrics]  # before matplotlib: a typo says so at once
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        run_where_matplotlib_is()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for path in args.metrics:
        its, losses = read(path)
        if not its:
            sys.exit(f"plot-loss: {path}: no iterations")
        name = os.path.splitext(os.path.basename(path))[0]
        if name == "metrics":  # TENSORBOARD_DIR/metrics.jsonl: the run's directory names it
            name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        ax.plot(its, losses, label=name, linewidth=1.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(args.title)
    ax.grid(True, alpha=0.3)
    if len(args.metrics) > 1:
        ax.legend()
    fig.tight_layout()
    tmp = args.output + ".tmp.png"
    fig.savefig(tmp)
    os.replace(tmp, args.output)
    print(f"plot-loss: wrote {args.output}")


if __name__ == "__main__":
    main()
