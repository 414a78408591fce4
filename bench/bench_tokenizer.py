#!/usr/bin/env python3
"""Tokenizer benchmark: ptk's GPT-2 tokenizer and ptk-tokenize end to end, side by side in the same
run with tiktoken, Hugging Face tokenizers and gigatoken on the same texts (MB = 10^6 bytes of UTF-8
text; best of --repeats passes; single thread and all threads). Checks that every tokenizer gives
tiktoken's ids on the corpus before timing anything. Prints a table and one JSON line.

Usage: python3 bench/bench_tokenizer.py [--corpus FILE.jsonl] [--build build] [--repeats 3]
Default corpus: the text of the bundled sample's train split (sample/slimpajama-mini).
Reference libraries are installed into build/bench-venv from PyPI on first use.
"""
import argparse
import atexit
import base64
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
REFS = ["tiktoken==0.14.0", "tokenizers==0.23.3", "gigatoken==0.10.0", "numpy"]


def ensure_venv(build, script=None):
    """Re-executes `script` (default: this file) in build/bench-venv, with the reference libraries."""
    venv = os.path.join(build, "bench-venv")
    py = os.path.join(venv, "bin", "python")
    if os.environ.get("PTK_BENCH_IN_VENV") == "1":
        return
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", *REFS], check=True)
    env = dict(os.environ, PTK_BENCH_IN_VENV="1")
    os.execve(py, [py, os.path.abspath(script or __file__), *sys.argv[1:]], env)


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), times[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat-corpus", type=int, default=4,
                    help="the default corpus is the sample's train text this many times (steady state, not start-up)")
    a = ap.parse_args()
    ensure_venv(a.build)
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    import ref_env
    import tiktoken
    import tokenizers
    import gigatoken

    tmp = tempfile.mkdtemp(prefix="ptk-bench-")
    atexit.register(shutil.rmtree, tmp, True)  # also when a step fails
    corpus = a.corpus
    if corpus is None:
        corpus = os.path.join(tmp, "corpus.jsonl")
        raw = b"".join(subprocess.run(["zstd", "-dc", f], capture_output=True, check=True).stdout
                       for f in sorted(glob.glob(os.path.join(ROOT, "sample", "slimpajama-mini", "train", "*", "*.zst"))))
        with open(corpus, "wb") as out:
            out.write(raw * a.repeat_corpus)
    docs = [json.loads(l)["text"] for l in open(corpus, encoding="utf-8") if l.strip()]
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    mb = nbytes / 1e6
    print(f"corpus: {corpus}: {len(docs)} documents, {mb:.2f} MB of text; {a.threads} threads; CPU {cpu_name()}")

    tt = ref_env.tiktoken_gpt2()
    hf = tokenizers.Tokenizer.from_str(ref_env.hf_tokenizer_json()) if hasattr(ref_env, "hf_tokenizer_json") else None
    if hf is None:
        from tokenizers import models, pre_tokenizers, decoders
        hf = tokenizers.Tokenizer(models.BPE.from_file(ref_env.VOCAB, ref_env.MERGES))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
    rank_file = os.path.join(tmp, "gpt2.tiktoken")
    with open(rank_file, "w") as f:
        for tok, rank in tt._mergeable_ranks.items():
            f.write(base64.b64encode(tok).decode() + " " + str(rank) + "\n")
    gt = gigatoken.Tokenizer.from_tiktoken(rank_file, pretokenizer="gpt2")

    # ---- correctness gate: every tokenizer gives tiktoken's ids; so does ptk-tokenize.
    want = [tt.encode_ordinary(d) for d in docs]
    assert [e.ids for e in hf.encode_batch(docs)] == want, "HF tokenizers disagree with tiktoken"
    assert [list(map(int, gt.encode(d))) for d in docs] == want, "gigatoken disagrees with tiktoken"
    tok_bin = os.path.join(a.build, "bin", "ptk-tokenize")
    prefix = os.path.join(tmp, "gate")
    subprocess.run([tok_bin, "--quiet", "--input", corpus, "--output-prefix", prefix, "--endoftext-as-text"], check=True,
                   capture_output=True)
    import numpy
    got = numpy.fromfile(prefix + "_text_document.bin", dtype=numpy.uint16).tolist()
    assert got == [i for w in want for i in w], "ptk-tokenize disagrees with tiktoken"
    print("ids: ptk, HF tokenizers and gigatoken equal tiktoken on every document")

    results = {}

    def record(name, seconds, first=None):
        results[name] = {"mb_s": round(mb / seconds, 2)}
        if first is not None:
            results[name]["cold_mb_s"] = round(mb / first, 2)

    # ---- ptk tokenizer alone (C++ harness, same documents)
    out = subprocess.run([os.path.join(a.build, "bench", "tokenizer_bench"), corpus, str(a.threads), str(a.repeats)],
                         capture_output=True, text=True, check=True).stdout
    pb = json.loads(out)
    results["ptk tokenizer 1 thread"] = {"mb_s": pb["st_warm_mb_s"], "cold_mb_s": pb["st_cold_mb_s"]}
    results[f"ptk tokenizer {a.threads} threads"] = {"mb_s": pb["mt_mb_s"]}
    results["ptk pre-tokenizer alone"] = {"mb_s": pb["pretokenize_mb_s"]}

    # ---- ptk-tokenize end to end (jsonl -> .bin/.idx), MB of text per second
    for w in (1, a.threads):
        def run_tok():
            subprocess.run([tok_bin, "--quiet", "--input", corpus, "--output-prefix", prefix, "--append-eod", "--workers",
                            str(w)], check=True, capture_output=True)
        s, f = best(run_tok, a.repeats)
        record(f"ptk-tokenize end-to-end {w} thread{'s' if w > 1 else ''}", s, f)

    # ---- references
    s, f = best(lambda: [tt.encode_ordinary(d) for d in docs], a.repeats)
    record("tiktoken 1 thread", s, f)
    s, f = best(lambda: tt.encode_ordinary_batch(docs, num_threads=a.threads), a.repeats)
    record(f"tiktoken {a.threads} threads", s, f)
    s, f = best(lambda: [hf.encode(d) for d in docs], a.repeats)
    record("HF tokenizers 1 thread", s, f)
    s, f = best(lambda: hf.encode_batch(docs), a.repeats)
    record(f"HF tokenizers {a.threads} threads", s, f)
    s, f = best(lambda: [gt.encode(d) for d in docs], a.repeats)
    record("gigatoken 1 thread", s, f)
    s, f = best(lambda: gt.encode_batch(docs, parallel=True), a.repeats)
    record(f"gigatoken {a.threads} threads", s, f)

    base = results["tiktoken 1 thread"]["mb_s"]
    print(f"\n{'':42} {'MB/s':>9} {'vs tiktoken 1T':>15}")
    for name, r in results.items():
        print(f"{name:42} {r['mb_s']:9.1f} {r['mb_s'] / base:14.1f}x")
    ratios = {
        "ptk_vs_tiktoken_1t": round(results["ptk tokenizer 1 thread"]["mb_s"] / base, 2),
        "ptk_vs_hf_1t": round(results["ptk tokenizer 1 thread"]["mb_s"] / results["HF tokenizers 1 thread"]["mb_s"], 2),
        "ptk_vs_gigatoken_1t": round(results["ptk tokenizer 1 thread"]["mb_s"] / results["gigatoken 1 thread"]["mb_s"], 2),
        "ptk_tokenize_e2e_vs_tiktoken_1t": round(results["ptk-tokenize end-to-end 1 thread"]["mb_s"] / base, 2),
    }
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"bench": "tokenizer", "commit": commit, "cpu": cpu_name(), "threads": a.threads, "corpus_mb": round(mb, 2),
                      "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
