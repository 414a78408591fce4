#!/usr/bin/env python3
"""Checks that ptk-tokenize --legacy-tokenizer writes the ids Megatron-LM's legacy GPT2BPETokenizer
(megatron/training/tokenizer/tokenizer.py's _GPT2BPETokenizer over gpt2_tokenization.GPT2Tokenizer)
gives, over a jsonl's "text" (a string or a list of strings), with --append-eod.

Needs a Megatron-LM checkout (megatron/training is not on PyPI) and Python's `regex` and numpy, e.g.
  python3 tests/support/check_megatron_legacy_gpt2.py --megatron-lm ~/Megatron-LM --ptk-tokenize build/bin/ptk-tokenize
Checked with core_v0.16.1's gpt2_tokenization.py over tests/data/megatron_preprocess/corpus.jsonl
(22365 ids, <|endoftext|> in the text included) and over the string texts of
tests/data/tokenizer/corpus.jsonl (1058 documents, 85976 ids).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-lm", required=True)
    ap.add_argument("--ptk-tokenize", default=os.path.join(ROOT, "build", "bin", "ptk-tokenize"))
    ap.add_argument("--input", default=os.path.join(ROOT, "tests", "data", "megatron_preprocess", "corpus.jsonl"))
    args = ap.parse_args()
    path = os.path.join(args.megatron_lm, "megatron", "training", "tokenizer", "gpt2_tokenization.py")
    spec = importlib.util.spec_from_file_location("gpt2_tokenization", path)
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    vocab = os.path.join(ROOT, "tokenizer", "data", "gpt2-vocab.json")
    merges = os.path.join(ROOT, "tokenizer", "data", "gpt2-merges.txt")
    # What _GPT2BPETokenizer builds; its eod is the vocabulary's <|endoftext|>.
    tok = g.GPT2Tokenizer(vocab, merges, errors="replace", special_tokens=[], max_len=None)
    eod = tok.encoder["<|endoftext|>"]
    want = []
    with open(args.input, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            doc = []
            for sentence in text if isinstance(text, list) else [text]:
                doc.extend(tok.encode(sentence))
            if doc:
                doc.append(eod)
            want.extend(doc)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "legacy")
        subprocess.run([args.ptk_tokenize, "--quiet", "--input", args.input, "--output-prefix", prefix,
                        "--tokenizer-type", "GPT2BPETokenizer", "--legacy-tokenizer", "--append-eod"], check=True)
        got = np.fromfile(prefix + "_text_document.bin", dtype=np.uint16).tolist()
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        print(f"differ: {len(got)} ids from ptk, {len(want)} from Megatron's legacy tokenizer; first at {first}")
        return 1
    print(f"same {len(got)} ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
