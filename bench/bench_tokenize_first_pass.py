#!/usr/bin/env python3
"""ptk-tokenize as users run it: one pass over text it has not seen, in a fresh process, end to end
(jsonl in, .bin/.idx out), beside the fastest single-thread paths of the reference tokenizers on
the same file, each in a fresh process too:
  gigatoken file API      Tokenizer.encode_files(JsonlFileSource([file]), parallel=False)
  gigatoken per document  Tokenizer.encode on texts parsed beforehand (parsing not timed)
  tiktoken, HF tokenizers per document on texts parsed beforehand
ptk-tokenize is timed as a whole process (start-up, reading, parsing, writing a new .bin/.idx
included: the last run's output is removed first, as a user's output prefix is new); the Python
references from just before their tokenizer is built to the last id (interpreter start-up and
imports excluded). Median of --runs fresh processes each, the engines taking turns run by run (so
that the machine's drifts reach them alike; ptk's one- and two-worker runs back to back, each first
in turn, so that neither always follows the Python engines' freeing of their memory). Repeat passes (a warm cache: one more pass over the
same text in the same process, ptk's tokenizer and gigatoken's alike) are reported separately. Corpora: the multilingual one
(bench/multilingual_corpus.py: Debian's translations, 175 languages) and the bundled sample.
Every engine's ids are checked against tiktoken's first.

Two workers against one: ptk's runs are cheap, so each round times --ptk-pairs pairs (one- and
two-worker processes back to back, each first in turn), and besides the ratio of the medians the
median of the pairs' own ratios is reported (a pair's two runs see the same state of the machine).
A process on a one-line file is timed beside them: what every run pays that a second worker cannot
share (exec and loading, start-up, the finishing fsyncs and renames, exit). With F that time and T1
the one-worker time, T1 / (F + (T1 - F) / 2) is the most two workers could gain if everything else
split evenly between them (Amdahl); it is printed beside the measured ratio.

Usage: python3 bench/bench_tokenize_first_pass.py [--build build] [--runs 3] [--ptk-pairs 3] [--corpus-mb 24]
Prints a table per corpus and one JSON line.
"""
import argparse
import atexit
import base64
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tokenizer  # noqa: E402  (its venv of reference libraries, its CPU name)

CHILD = r"""
import base64, json, sys, time
engine, corpus, rank_file = sys.argv[1:4]
docs = None
if engine not in ("gigatoken-file",):
    docs = [json.loads(l)["text"] for l in open(corpus, encoding="utf-8") if l.strip()]
import gigatoken, tiktoken, tokenizers
t0 = time.perf_counter()
if engine.startswith("gigatoken"):
    gt = gigatoken.Tokenizer.from_tiktoken(rank_file, pretokenizer="gpt2")
    if engine == "gigatoken-file":
        out = gt.encode_files(gigatoken.JsonlFileSource([corpus]), parallel=False)
        n = len(out)
    else:
        n = sum(len(gt.encode(d)) for d in docs)
        t1 = time.perf_counter()
        n2 = sum(len(gt.encode(d)) for d in docs)
        print(json.dumps({"repeat_seconds": time.perf_counter() - t1}))
elif engine == "tiktoken":
    ranks = {base64.b64decode(t): int(r) for t, r in (l.split() for l in open(rank_file))}
    pat = r"'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    enc = tiktoken.Encoding("gpt2", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
    n = sum(len(enc.encode_ordinary(d)) for d in docs)
elif engine == "hf":
    from tokenizers import models, pre_tokenizers, decoders
    hf = tokenizers.Tokenizer(models.BPE.from_file(sys.argv[4], sys.argv[5]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    n = sum(len(hf.encode(d).ids) for d in docs)
print(json.dumps({"seconds": time.perf_counter() - t0, "items": n}))
"""


def run_child(venv_py, engine, corpus, rank_file, vocab, merges):
    out = subprocess.run([venv_py, "-c", CHILD, engine, corpus, rank_file, vocab, merges], check=True,
                         capture_output=True, text=True).stdout
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    res = {}
    for l in lines:
        res.update(l)
    return res


def ptk_tokenize(build, corpus, prefix, workers):
    # A fresh output, as a user's run writes: replacing the last run's 30 MB .bin would add the file
    # system's freeing of it (~10 ms on ext4) to ptk's time.
    for f in glob.glob(glob.escape(prefix) + "_text_document.*"):
        os.remove(f)
    t = time.perf_counter()
    subprocess.run([os.path.join(build, "bin", "ptk-tokenize"), "--quiet", "--input", corpus, "--output-prefix", prefix,
                    "--workers", str(workers), "--endoftext-as-text"], check=True, capture_output=True)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--corpus-mb", type=float, default=24.0)
    ap.add_argument("--ptk-pairs", type=int, default=3, help="ptk one/two-worker pairs per round")
    a = ap.parse_args()
    if a.runs < 1 or a.ptk_pairs < 1:
        ap.error("--runs and --ptk-pairs must be at least 1")
    bench_tokenizer.ensure_venv(a.build, __file__)  # re-executes this script in the venv
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    import ref_env
    import numpy
    import tiktoken

    tmp = tempfile.mkdtemp(prefix="ptk-bench-fp-")
    atexit.register(shutil.rmtree, tmp, True)
    tt = ref_env.tiktoken_gpt2()
    rank_file = os.path.join(tmp, "gpt2.tiktoken")
    with open(rank_file, "w") as f:
        for tok, rank in tt._mergeable_ranks.items():
            f.write(base64.b64encode(tok).decode() + " " + str(rank) + "\n")

    corpora = {}
    ml = os.path.join(tmp, "multilingual.jsonl")
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "multilingual_corpus.py"), ml, "--max-mb",
                    str(a.corpus_mb)], check=True)
    corpora["multilingual"] = ml
    sample = os.path.join(tmp, "sample.jsonl")
    with open(sample, "wb") as out:
        for f in sorted(glob.glob(os.path.join(ROOT, "sample", "slimpajama-mini", "train", "*", "*.zst"))):
            out.write(subprocess.run(["zstd", "-dc", f], capture_output=True, check=True).stdout)
    corpora["sample"] = sample

    py = sys.executable
    summary = {}
    one_line = os.path.join(tmp, "one-line.jsonl")  # the fixed cost of a ptk-tokenize process
    with open(one_line, "w") as f:
        f.write(json.dumps({"text": "Hello world"}) + "\n")
    for name, corpus in corpora.items():
        docs = [json.loads(l)["text"] for l in open(corpus, encoding="utf-8") if l.strip()]
        mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
        want = [i for d in docs for i in tt.encode_ordinary(d)]
        prefix = os.path.join(tmp, name)
        ptk_tokenize(a.build, corpus, prefix, 1)
        got = numpy.fromfile(prefix + "_text_document.bin", dtype=numpy.uint16).tolist()
        assert got == want, f"ptk-tokenize disagrees with tiktoken on {name}"
        import gigatoken
        gt = gigatoken.Tokenizer.from_tiktoken(rank_file, pretokenizer="gpt2")
        assert [int(i) for d in docs for i in gt.encode(d)] == want, f"gigatoken disagrees on {name}"
        print(f"\n{name}: {len(docs)} documents, {mb:.1f} MB of text; ids of ptk-tokenize and gigatoken equal tiktoken's")

        # Rounds: every engine once per round, in turn, so that the machine's drifts (a shared VM's
        # speed moves by tens of percent over minutes) reach all of them alike; medians per engine.
        engines = (("gigatoken-file", "gigatoken file API 1 thread"),
                   ("gigatoken-docs", "gigatoken per document 1 thread"),
                   ("tiktoken", "tiktoken 1 thread"), ("hf", "HF tokenizers 1 thread"))
        times = {"ptk-tokenize 1 worker (process)": [], "ptk-tokenize 2 workers (process)": []}
        times.update({label: [] for _, label in engines})
        repeat, ptk_repeat, pair_ratios, fixed = [], [], [], []
        for run in range(a.runs):
            # ptk's two runs side by side, in turn first: each process's first touch of fresh memory
            # costs more right after a big process (the Python engines) has freed its own, and the
            # two-worker run touches more; so neither one always follows the Python engines.
            for pair in range(a.ptk_pairs):
                t = {}
                for workers in ((1, 2) if (run * a.ptk_pairs + pair) % 2 == 0 else (2, 1)):
                    t[workers] = ptk_tokenize(a.build, corpus, prefix, workers)
                    label = f"ptk-tokenize {workers} worker{'s' if workers > 1 else ''} (process)"
                    times[label].append(t[workers])
                pair_ratios.append(t[1] / t[2])
                fixed.append(ptk_tokenize(a.build, one_line, prefix + "-one-line", 1))
            for engine, label in engines:
                r = run_child(py, engine, corpus, rank_file, ref_env.VOCAB, ref_env.MERGES)
                times[label].append(r["seconds"])
                if engine == "gigatoken-docs":
                    repeat.append(r["repeat_seconds"])
            # ptk's repeat pass as gigatoken's: one pass over the text a second time, in its process.
            out = subprocess.run([os.path.join(a.build, "bench", "tokenizer_bench"), corpus, "1", "1"],
                                 capture_output=True, text=True, check=True).stdout
            ptk_repeat.append(json.loads(out)["st_warm_mb_s"])
        res = {k: statistics.median(v) for k, v in times.items()}
        res = {k: res[k] for k in ["ptk-tokenize 1 worker (process)", "ptk-tokenize 2 workers (process)"] +
               [label for _, label in engines]}
        mbs = {k: mb / v for k, v in res.items()}
        giga = max(mbs["gigatoken file API 1 thread"], mbs["gigatoken per document 1 thread"])
        print(f"{'first pass, fresh process':44} {'MB/s':>8} {'vs fastest gigatoken 1T':>24}")
        for k, v in mbs.items():
            print(f"{k:44} {v:8.1f} {v / giga:23.2f}x")
        t1, t2, f = (res["ptk-tokenize 1 worker (process)"], res["ptk-tokenize 2 workers (process)"],
                     statistics.median(fixed))
        paired, bound = statistics.median(pair_ratios), t1 / (f + (t1 - f) / 2)
        print(f"{'ptk 2 workers / 1 worker':44} {t1 / t2:8.2f}x ratio of medians, {paired:.2f}x median of "
              f"{len(pair_ratios)} pairs")
        print(f"{'ptk process on a one-line file':44} {f * 1e3:8.1f} ms: 2 workers / 1 worker at most {bound:.2f}x "
              f"(Amdahl)")
        rep = {"ptk tokenizer 1 thread (repeat pass)": statistics.median(ptk_repeat),
               "gigatoken per document (repeat pass)": mb / statistics.median(repeat)}
        print(f"{'repeat pass, same process':44} {'MB/s':>8}")
        for k, v in rep.items():
            print(f"{k:44} {v:8.1f}")
        summary[name] = {
            "mb": round(mb, 2),
            "ptk_one_line_process_ms": round(f * 1e3, 1),
            "first_pass_mb_s": {k: round(v, 1) for k, v in mbs.items()},
            "repeat_pass_mb_s": {k: round(v, 1) for k, v in rep.items()},
            "ratios": {
                "ptk_1w_vs_gigatoken_fastest_1t": round(mbs["ptk-tokenize 1 worker (process)"] / giga, 2),
                "ptk_2w_vs_1w": round(mbs["ptk-tokenize 2 workers (process)"] / mbs["ptk-tokenize 1 worker (process)"], 2),
                "ptk_2w_vs_1w_median_of_pairs": round(paired, 2),
                "ptk_2w_vs_1w_amdahl_bound": round(bound, 2),
                "ptk_repeat_vs_gigatoken_repeat": round(rep["ptk tokenizer 1 thread (repeat pass)"] /
                                                        rep["gigatoken per document (repeat pass)"], 2),
            },
        }
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({"bench": "tokenize_first_pass", "commit": commit, "cpu": bench_tokenizer.cpu_name(),
                      "results": summary}))


if __name__ == "__main__":
    main()
