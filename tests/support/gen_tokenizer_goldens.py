#!/usr/bin/env python3
"""Generates tests/data/tokenizer/golden.jsonl from corpus.jsonl with the real reference tokenizers.

For every corpus case it records
  hf           ids from Hugging Face GPT2TokenizerFast (literal <|endoftext|> -> 50256), which is what
               Megatron-LM's GPT2BPETokenizer runs today;
  hf_ordinary  the same with split_special_tokens=True (<|endoftext|> as ordinary text);
  tiktoken     tiktoken "gpt2" encode_ordinary, stored only where it differs from hf_ordinary
               (that happens only for code points first assigned after Unicode 16.0, see
               tokenizer/generators/gen_unicode_tables.py).
Big repeated inputs store the count and sha256 of the ids (little-endian int32) instead of the ids.

Reference versions used for the committed file: transformers 4.57.6, tokenizers 0.22.2, tiktoken 0.14.0.
Usage: pip install "transformers<5" tokenizers tiktoken
       python3 tests/support/gen_tokenizer_goldens.py > tests/data/tokenizer/golden.jsonl
"""
import hashlib
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(__file__))
import ref_env  # noqa: E402


def ids_digest(ids):
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


def main():
    import tiktoken
    import tokenizers
    import transformers
    tt = ref_env.tiktoken_gpt2()
    hf = ref_env.hf_gpt2_fast()
    hf_ord = ref_env.hf_gpt2_fast()
    hf_ord.split_special_tokens = True
    print(f"# transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, tiktoken {tiktoken.__version__}",
          file=sys.stderr)
    corpus = os.path.join(ref_env.ROOT, "tests", "data", "tokenizer", "corpus.jsonl")
    differ = 0
    for line in open(corpus, encoding="utf-8"):
        case = json.loads(line)
        text = case["text"] if "text" in case else case["repeat"] * case["count"]
        a = hf(text).input_ids
        b = hf_ord(text).input_ids
        c = tt.encode_ordinary(text)
        out = {"name": case["name"]}
        big = "repeat" in case and len(text) > 100000
        if big:
            out["hf_n"], out["hf_sha256"] = len(a), ids_digest(a)
            out["hf_ordinary_n"], out["hf_ordinary_sha256"] = len(b), ids_digest(b)
        else:
            out["hf"] = a
            if b != a:
                out["hf_ordinary"] = b
        if c != b:
            differ += 1
            out["tiktoken"] = c if not big else {"n": len(c), "sha256": ids_digest(c)}
            print(f"tiktoken differs from HF on {case['name']}: "
                  f"{sorted({f'U+{ord(ch):04X}' for ch in text if ord(ch) > 0x7f})[:12]}", file=sys.stderr)
        sys.stdout.write(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"{differ} cases where tiktoken differs from HF", file=sys.stderr)


if __name__ == "__main__":
    main()
