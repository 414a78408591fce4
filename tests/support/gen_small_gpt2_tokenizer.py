#!/usr/bin/env python3
"""GPT-2's tokenizer cut to its first 999 tokens (the 256 bytes and the first 743 merges, which make
exactly ids 256..998) plus <|endoftext|> as id 999: a vocabulary of 1000 for the trainer's end-to-end
tests, whose tiny models would otherwise spend nearly all their time in GPT-2's output layer of 50257.

Usage: gen_small_gpt2_tokenizer.py SOURCE_DIR   (writes tests/data/trainer/gpt2-1000-{vocab.json,merges.txt})
"""
import json
import os
import sys

src = sys.argv[1]
vocab = json.load(open(os.path.join(src, "tokenizer", "data", "gpt2-vocab.json"), encoding="utf-8"))
by_id = {i: t for t, i in vocab.items()}
small = {by_id[i]: i for i in range(999)}
small["<|endoftext|>"] = 999
lines = open(os.path.join(src, "tokenizer", "data", "gpt2-merges.txt"), encoding="utf-8").read().split("\n")
merges = [lines[0]]
for line in lines[1:]:
    a, b = line.split(" ")
    if not (a in small and b in small and a + b in small):
        break
    merges.append(line)
assert len(merges) - 1 == 743, len(merges)
out = os.path.join(src, "tests", "data", "trainer")
with open(os.path.join(out, "gpt2-1000-vocab.json"), "w", encoding="utf-8") as f:
    json.dump(small, f, ensure_ascii=False)
with open(os.path.join(out, "gpt2-1000-merges.txt"), "w", encoding="utf-8") as f:
    f.write("\n".join(merges) + "\n")
