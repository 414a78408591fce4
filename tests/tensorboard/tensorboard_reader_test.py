#!/usr/bin/env python3
"""ptk-train --tensorboard-dir, read back by TensorBoard's own reader (tensorboard 2.17.1 from PyPI,
installed by scripts/install-deps.sh --with-python-ref into /opt/ptk-pyref).

Checks:
  * a run stopped at iteration 5 and resumed to 10 leaves two event files that TensorBoard reads as
    one series: every per-iteration tag at steps 1..10 once, its "vs samples" twin at the samples
    consumed, and every value equal to the log line's (to the digits it prints) and to
    metrics.jsonl's (to float32, as TensorBoard stores it);
  * Megatron's tags: learning-rate, batch-size, lm loss, loss-scale, grad-norm, lm loss validation
    (and its ppl with --log-validation-ppl-to-tensorboard), iteration-time and throughput with
    --log-timers-to-tensorboard --log-throughput; --no-log-loss-scale-to-tensorboard,
    --log-world-size-to-tensorboard and --tensorboard-log-interval select as in Megatron;
  * a byte flipped in an event file is refused by TensorBoard's reader (the CRCs are real);
  * a full disk while events are written is exit 3 naming the event file;
  * what a checkpoint covers is in an event file before the tracker names it: killed at each fsync
    (strace's fault injection) with --save-interval 7 --log-interval 5, every iteration up to the
    tracker's (21 among them) is in an event file and in metrics.jsonl;
  * a second run while the first still writes to the same --tensorboard-dir or --metrics-file is
    refused in one line naming it; a new run afterwards writes in a subdirectory of its own, saying so.
Usage: tensorboard_reader_test.py BIN_DIR
"""
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

BIN = sys.argv[1]
for p in ("/opt/ptk-pyref", os.environ.get("PTK_PYREF_DIR", "")):
    if p and os.path.isdir(p) and p not in sys.path:
        sys.path.insert(0, p)
import numpy  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402
from tensorboard.compat.tensorflow_stub import errors as tb_errors, pywrap_tensorflow  # noqa: E402

failures = 0


def check(cond, what):
    global failures
    if not cond:
        failures += 1
        print("FAIL:", what)


TRAIN = [os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
         "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--mock-data", "--threads", "2", "--eval-interval",
         "4", "--eval-iters", "1"]


def run(args, expect=0):
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check(r.returncode == expect, "exit {} (expected {}) for {}:\n{}".format(r.returncode, expect, args, r.stdout))
    return r.stdout


def scalars(tb_dir):
    acc = event_accumulator.EventAccumulator(tb_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


LINE = re.compile(r" iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): ([0-9.]+) \|"
                  r" throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+) \| learning rate: ([0-9.E+-]+) \| global batch size: +(\d+) \|"
                  r" lm loss: ([0-9.E+-]+) \| loss scale: ([0-9.]+) \| grad norm: ([0-9.]+) \|")
VALID = re.compile(r" validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+) \| lm loss PPL: ([0-9.E+-]+) \|")


def close(a, b, rel, abs_=0.0):
    return abs(a - b) <= rel * abs(b) + abs_


def f32_equal(tb_value, exact):
    # One float32 ulp: metrics.jsonl prints the double with 9 digits, TensorBoard keeps float32.
    want = numpy.float32(exact)
    return abs(numpy.float32(tb_value) - want) <= numpy.spacing(abs(want))


with tempfile.TemporaryDirectory() as tmp:
    # ---- a run stopped at 5 and resumed to 10, every iteration logged
    tb = os.path.join(tmp, "tb")
    ck = os.path.join(tmp, "ck")
    flags = ["--train-iters", "10", "--log-interval", "1", "--tensorboard-dir", tb, "--save", ck,
             "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard", "--log-throughput",
             "--eval-iters", "1"]
    out = run(TRAIN + flags + ["--exit-interval", "5"])
    out += run(TRAIN + flags + ["--load", ck])
    files = sorted(glob.glob(os.path.join(tb, "events.out.tfevents.*")))
    check(len(files) == 2, "one event file per run: {}".format(files))
    for f in files:
        events = list(EventFileLoader(f).Load())
        check(events and events[0].file_version == "brain.Event:2", f + ": the first event names the format")
    s = scalars(tb)
    records = [json.loads(line) for line in open(os.path.join(tb, "metrics.jsonl"))]
    metrics = [m for m in records if "lm_loss" in m]  # the iterations'; the evaluations' are keyed by their tags
    check([m["iteration"] for m in metrics] == list(range(1, 11)), "metrics.jsonl holds iterations 1..10")
    lines = {int(m.group(1)): m for m in LINE.finditer(out)}
    check(sorted(lines) == list(range(1, 11)), "log lines for iterations 1..10: {}".format(sorted(lines)))
    for tag in ("learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm"):
        check([st for st, _ in s.get(tag, [])] == list(range(1, 11)), "{} at steps 1..10: {}".format(tag, s.get(tag)))
        check([st for st, _ in s.get(tag + " vs samples", [])] == [4 * i for i in range(1, 11)],
              "{} vs samples at 4, 8, ..., 40: {}".format(tag, s.get(tag + " vs samples")))
        check([v for _, v in s.get(tag, [])] == [v for _, v in s.get(tag + " vs samples", [])],
              tag + ": the same values against samples")
    for (step, lr), (_, bs), (_, loss), (_, scale), (_, norm) in zip(s["learning-rate"], s["batch-size"], s["lm loss"],
                                                                        s["loss-scale"], s["grad-norm"]):
        m, line = metrics[step - 1], lines[step]
        check(f32_equal(lr, m["learning_rate"]) and close(lr, float(line.group(5)), 6e-7),
              "learning-rate at {}: {} (log {}, metrics {})".format(step, lr, line.group(5), m["learning_rate"]))
        check(f32_equal(loss, m["lm_loss"]) and close(loss, float(line.group(7)), 6e-7),
              "lm loss at {}: {} (log {}, metrics {})".format(step, loss, line.group(7), m["lm_loss"]))
        check(f32_equal(norm, m["grad_norm"]) and close(norm, float(line.group(9)), 0, 5.01e-4),
              "grad-norm at {}: {} (log {}, metrics {})".format(step, norm, line.group(9), m["grad_norm"]))
        check(bs == float(line.group(6)) == 4, "batch-size at {}: {}".format(step, bs))
        check(scale == float(line.group(8)) == 1.0, "loss-scale at {}: {}".format(step, scale))
    for step, secs in s.get("iteration-time", []):
        check(close(secs * 1000, float(lines[step].group(3)), 0, 0.0501), "iteration-time at {}".format(step))
    for step, tflops in s.get("throughput", []):
        check(close(tflops, float(lines[step].group(4)), 0, 0.0501), "throughput at {}".format(step))
    check(len(s.get("iteration-time", [])) == 10 and len(s.get("throughput", [])) == 10,
          "iteration-time and throughput at every log line")
    valid = {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in VALID.finditer(out)}
    check(sorted(valid) == [4, 8], "validation at 4 and 8: {}".format(valid))
    got = dict(s.get("lm loss validation", []))  # the end-of-training evaluation adds step 10
    gotppl = dict(s.get("lm loss validation ppl", []))
    for it, (loss, ppl) in valid.items():
        check(it in got and close(got[it], loss, 6e-7), "lm loss validation at {}: {} vs {}".format(it, got.get(it), loss))
        check(it in gotppl and close(gotppl[it], ppl, 6e-7), "ppl at {}: {} vs {}".format(it, gotppl.get(it), ppl))
        check(math.isclose(dict(s["lm loss validation vs samples"])[4 * it], got[it]), "validation vs samples")
    check(10 in got and "lm loss test" in s, "the end of training: validation at 10 and the test loss")
    # metrics.jsonl holds each evaluation too, under its TensorBoard tag: the scalars' values, steps and samples.
    evals = [m for m in records if "lm_loss" not in m]
    check([(m["iteration"], sorted(m)) for m in evals] ==
          [(it, ["consumed_samples", "iteration", "lm_loss_" + k, "lm_loss_" + k + "_ppl"])
           for it, k in ((4, "validation"), (8, "validation"), (10, "validation"), (10, "test"))],
          "metrics.jsonl's evaluations: validation at 4, 8, 10, then the test's: {}".format(evals))
    for m in evals:
        tag = "lm loss " + ("test" if "lm_loss_test" in m else "validation")
        key = tag.replace(" ", "_")
        check(m["consumed_samples"] == 4 * m["iteration"], "an evaluation's samples: {}".format(m))
        check(f32_equal(dict(s[tag])[m["iteration"]], m[key]), "{} at {}: metrics {}".format(tag, m["iteration"], m))
        check(f32_equal(dict(s[tag + " ppl"])[m["iteration"]], m[key + "_ppl"]),
              "{} ppl at {}: metrics {}".format(tag, m["iteration"], m))

    # ---- the selection flags
    tb2 = os.path.join(tmp, "tb2")
    out2 = run(TRAIN + ["--train-iters", "6", "--log-interval", "3", "--tensorboard-dir", tb2,
                        "--no-log-loss-scale-to-tensorboard", "--log-world-size-to-tensorboard",
                        "--tensorboard-log-interval", "2", "--tensorboard-queue-size", "5"])
    s2 = scalars(tb2)
    check("loss-scale" not in s2 and "loss-scale vs samples" not in s2, "--no-log-loss-scale-to-tensorboard")
    check(s2.get("world-size") == [(2, 1.0), (4, 1.0), (6, 1.0)], "world-size: {}".format(s2.get("world-size")))
    check([st for st, _ in s2.get("lm loss", [])] == [2, 4, 6], "--tensorboard-log-interval 2: {}".format(s2.get("lm loss")))
    check("iteration-time" not in s2 and "throughput" not in s2 and "lm loss validation ppl" not in s2,
          "timers and ppl only when asked: {}".format(sorted(s2)))
    check("--tensorboard-queue-size 5: accepted" in out2, "--tensorboard-queue-size is accepted with a note")

    # ---- a flipped byte is refused by TensorBoard's record reader (the CRCs are real)
    def read_records(path):
        reader = pywrap_tensorflow.PyRecordReader_New(path)
        n = 0
        try:
            while True:
                reader.GetNext()
                n += 1
        except tb_errors.OutOfRangeError:
            return n, None
        except tb_errors.DataLossError as e:
            return n, str(e)

    whole, err = read_records(files[0])
    check(err is None and whole > 10, "{}: {} records, {}".format(files[0], whole, err))
    data = bytearray(open(files[0], "rb").read())
    data[len(data) // 2] ^= 0x40
    bad = os.path.join(tmp, "bad.tfevents")
    open(bad, "wb").write(bytes(data))
    n, err = read_records(bad)
    check(err is not None and "crc32" in err and n < whole, "a corrupted record is refused: {} {}".format(n, err))

    # ---- a full disk (a file-size limit: EFBIG, as ENOSPC) is exit 3 naming the event file
    tb3 = os.path.join(tmp, "tb3")
    cmd = " ".join("'{}'".format(a) for a in TRAIN + ["--train-iters", "60", "--log-interval", "1", "--eval-iters", "0",
                                                       "--tensorboard-dir", tb3, "--metrics-file", "/dev/null"])
    r = subprocess.run(["bash", "-c", "ulimit -f 2; " + cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check(r.returncode == 3 and "events.out.tfevents." in r.stdout,
          "a full disk: exit {} (want 3) naming the event file:\n{}".format(r.returncode, r.stdout[-2000:]))

    # ---- killed right after a save: the iterations the checkpoint covers are in an event file
    tiny = [os.path.join(BIN, "ptk-train"), "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--vocab-size", "64", "--make-vocab-size-divisible-by", "1", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--lr", "1e-3", "--mock-data", "--eval-iters", "0", "--threads", "1",
            "--train-iters", "21", "--save-interval", "7", "--log-interval", "5"]
    if subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"], capture_output=True).returncode != 0:
        print("SKIPPED (strace cannot trace here): the kills after a save")
    else:
        kills = covered = 0
        for k in range(1, 200):
            d = os.path.join(tmp, "kill{}".format(k))
            tbk, ckk = os.path.join(d, "tb"), os.path.join(d, "ck")
            r = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=fsync", "-e",
                                "inject=fsync:signal=KILL:when={}".format(k)] + tiny +
                               ["--save", ckk, "--tensorboard-dir", tbk], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
            if r.returncode == 0:
                break
            kills += 1
            try:
                latest = int(open(os.path.join(ckk, "latest_checkpointed_iteration.txt")).read())
            except (OSError, ValueError):
                continue  # killed before the first save
            steps = set()
            for f in glob.glob(os.path.join(tbk, "events.out.tfevents.*")):
                try:
                    for e in EventFileLoader(f).Load():
                        if any(v.tag == "lm loss" for v in e.summary.value):
                            steps.add(e.step)
                except Exception:  # a record cut by the kill ends the file; the whole ones count
                    pass
            missing = sorted(set(range(1, latest + 1)) - steps)
            check(not missing, "killed at fsync #{} with the tracker at {}: iterations {} in no event file".format(
                k, latest, missing))
            its = {json.loads(line)["iteration"] for line in open(os.path.join(tbk, "metrics.jsonl")) if line.strip()}
            check(set(range(1, latest + 1)) <= its, "killed at fsync #{}: metrics.jsonl misses some of 1..{}".format(
                k, latest))
            covered += latest == 21
        check(kills >= 5 and covered >= 1, "{} kills, {} right after the save of iteration 21".format(kills, covered))
        print("{} kills at an fsync, {} of them after the save of iteration 21: every checkpointed iteration in an "
              "event file".format(kills, covered))

    # ---- a second run while the first still writes: refused in one line naming the directory or file
    tbc = os.path.join(tmp, "tbc")
    first = subprocess.Popen(tiny[:-6] + ["--train-iters", "100000000", "--log-interval", "1", "--tensorboard-dir",
                                          tbc], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(6000):
            if glob.glob(os.path.join(tbc, "events.out.tfevents.*")) or first.poll() is not None:
                break
            time.sleep(0.01)
        check(first.poll() is None, "the first run is running")
        second = run(tiny[:-6] + ["--train-iters", "5", "--tensorboard-dir", tbc], expect=1)
        bad = [line for line in second.splitlines() if "--tensorboard-dir" in line]
        check(len(bad) == 1 and "{} is being written by another run".format(tbc) in bad[0],
              "the second run names --tensorboard-dir:\n" + second)
        second = run(tiny[:-6] + ["--train-iters", "5", "--tensorboard-dir", os.path.join(tmp, "tbother"),
                                  "--metrics-file", os.path.join(tbc, "metrics.jsonl")], expect=1)
        bad = [line for line in second.splitlines() if "metrics.jsonl" in line and "another run" in line]
        check(len(bad) == 1 and "--metrics-file" in bad[0], "the second run names --metrics-file:\n" + second)
        check(len(glob.glob(os.path.join(tbc, "events.out.tfevents.*"))) == 1, "the refused runs wrote no event file")
    finally:
        first.kill()
        first.wait()
    # After it: a new run (from iteration 0) writes its events and lines in a subdirectory of its own
    # (a run of its own for TensorBoard), saying so; the first run's stay as they were.
    third = run(tiny[:-6] + ["--train-iters", "3", "--log-interval", "1", "--tensorboard-dir", tbc])
    check("holds 1 event file(s) of another run" in third and "writes its own in " + os.path.join(tbc, "run-2") in third,
          "a new run into the directory says where it writes:\n" + third)
    check(len(glob.glob(os.path.join(tbc, "events.out.tfevents.*"))) == 1, "the first run's event file alone")
    check(len(glob.glob(os.path.join(tbc, "run-2", "events.out.tfevents.*"))) == 1, "the new run's in run-2")
    s3 = scalars(os.path.join(tbc, "run-2"))
    check([st for st, _ in s3.get("lm loss", [])] == [1, 2, 3], "run-2: lm loss at 1..3: {}".format(s3.get("lm loss")))

print("tensorboard_reader_test: {}".format("OK" if failures == 0 else "{} failure(s)".format(failures)))
sys.exit(1 if failures else 0)
