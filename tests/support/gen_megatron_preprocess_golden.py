#!/usr/bin/env python3
"""Generates the byte-identity goldens for ptk-tokenize by running Megatron-LM's own
tools/preprocess_data.py (tokenizer: Megatron's GPT2BPETokenizer = Hugging Face GPT2TokenizerFast).

Writes tests/data/megatron_preprocess/corpus.jsonl (a small multilingual corpus assembled from the
tokenizer goldens' cases, with empty documents, list-valued "text", a second key, escapes and raw
UTF-8) and, for every configuration in CONFIGS, NAME_{key}_document.{bin,idx} as Megatron wrote them.

Needs: a Megatron-LM checkout (for tools/, which is not on PyPI), megatron-core from PyPI,
transformers 4.x, and Debian's python3-numpy/python3-torch, e.g.
  python3 -m pip install --target /tmp/mlref --no-deps megatron-core==0.16.1 transformers==4.57.6 \
      tokenizers==0.22.2 "huggingface_hub<1.0" safetensors regex pyyaml requests tqdm filelock packaging fsspec \
      typing_extensions certifi charset_normalizer idna urllib3
  PYTHONPATH=/tmp/mlref /usr/bin/python3 tests/support/gen_megatron_preprocess_golden.py --megatron-lm ~/Megatron-LM
The committed goldens were produced from Megatron-LM commit 00736f4c796c3b9b4bc0609320064a0afdcd8edc's
tools/preprocess_data.py with megatron-core 0.16.1 and transformers 4.57.6.
"""
import argparse
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_shim  # noqa: E402
import ref_env  # noqa: E402

OUT = os.path.join(ref_env.ROOT, "tests", "data", "megatron_preprocess")

# name -> preprocess_data.py flags (besides --input/--output-prefix/--tokenizer flags)
CONFIGS = {
    "eod": ["--append-eod", "--workers", "2"],
    "noeod": ["--workers", "2"],
    "rr3": ["--append-eod", "--partitions", "3", "--workers", "3"],
    "seq2": ["--append-eod", "--partitions", "2", "--keep-sequential-samples", "--workers", "2"],
    "title": ["--json-keys", "title", "--append-eod", "--workers", "1"],
}


def make_corpus(path):
    cases = [json.loads(l) for l in open(os.path.join(ref_env.ROOT, "tests", "data", "tokenizer", "corpus.jsonl"))]
    texts = [c["text"] for c in cases if "text" in c]
    rng = random.Random(4242)
    rng.shuffle(texts)
    texts = texts[:260]
    lines = []
    for i, t in enumerate(texts):
        rec = {"text": t, "title": t[:12], "meta": {"redpajama_set_name": "RedPajamaC4", "i": i}}
        if i % 17 == 0:
            rec["text"] = ""  # empty document: kept, without EOD
        if i % 23 == 5:
            rec["text"] = [t[:len(t) // 2], "", t[len(t) // 2:]]  # pre-split sentences
        if i % 29 == 7:
            rec = {"meta": {"x": [1, 2, {"y": None}]}, "text": t + " <|endoftext|> tail", "title": ""}
        lines.append(json.dumps(rec, ensure_ascii=(i % 2 == 0)))
    lines.append(json.dumps({"text": "A" * 20000 + " long document", "title": "long"}))
    lines.append(json.dumps({"text": "x\u2028y\u0085z", "title": "line separators inside a string"}, ensure_ascii=False))
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")


def load_preprocess(megatron_lm):
    path = os.path.join(megatron_lm, "tools", "preprocess_data.py")
    megatron_shim.install(training_args=True)
    # HEAD imports build_tokenizer from megatron.core.tokenizers.utils; megatron-core 0.16.1 ships
    # the same function under megatron.core.tokenizers.text.utils.
    try:
        importlib.import_module("megatron.core.tokenizers.utils.build_tokenizer")
    except ImportError:
        mod = importlib.import_module("megatron.core.tokenizers.text.utils.build_tokenizer")
        sys.modules["megatron.core.tokenizers.utils.build_tokenizer"] = mod
    spec = importlib.util.spec_from_file_location("preprocess_data", path)
    pd = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = pd  # the worker pool pickles Encoder.encode by module name
    spec.loader.exec_module(pd)
    # Megatron calls find_optimal_num_workers(args.performance_dir) unconditionally after the work is
    # done; with no --performance-dir it lists the current directory and fails on an empty result.
    orig = pd.find_optimal_num_workers
    pd.find_optimal_num_workers = lambda d: orig(d) if d else None
    return pd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-lm", required=True, help="Megatron-LM checkout (tools/preprocess_data.py)")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    corpus = os.path.join(OUT, "corpus.jsonl")
    make_corpus(corpus)
    work = tempfile.mkdtemp(prefix="ptk-megatron-")
    megatron_shim.offline_gpt2_hub_cache(os.path.join(work, "hf"), ref_env.VOCAB, ref_env.MERGES)
    pd = load_preprocess(a.megatron_lm)
    for name, flags in CONFIGS.items():
        d = os.path.join(work, name)
        os.makedirs(d)
        shutil.copyfile(corpus, os.path.join(d, "corpus.jsonl"))
        prefix = os.path.join(d, name)
        sys.argv = ["preprocess_data.py", "--input", os.path.join(d, "corpus.jsonl"), "--output-prefix", prefix,
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", ref_env.VOCAB, "--merge-file",
                    ref_env.MERGES, "--log-interval", "100"] + flags
        cwd = os.getcwd()
        os.chdir(d)
        try:
            pd.main()
        finally:
            os.chdir(cwd)
        key = flags[flags.index("--json-keys") + 1] if "--json-keys" in flags else "text"
        for ext in (".bin", ".idx"):
            src = f"{prefix}_{key}_document{ext}"
            shutil.copyfile(src, os.path.join(OUT, os.path.basename(src)))
        print(f"{name}: {' '.join(flags)}", file=sys.stderr)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
