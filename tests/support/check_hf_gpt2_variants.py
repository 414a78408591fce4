#!/usr/bin/env python3
"""Checks that the Hugging Face GPT-2 tokenizers Megatron's GPT2BPETokenizer may run give the same ids,
which is why ptk-tokenize accepts --tokenizer-hf-use-fast and --tokenizer-hf-include-special-tokens and
ignores them: the slow GPT2Tokenizer (megatron-core 0.16.1's default, use_fast=False) and GPT2TokenizerFast,
each through tokenize + convert_tokens_to_ids (include_special_tokens=False) and through a call's
input_ids (include_special_tokens=True), over every string of the goldens' corpora.

Needs transformers 4.x, e.g. PYTHONPATH=/opt/ptk-pyref python3 tests/support/check_hf_gpt2_variants.py
Checked with transformers 4.44.2: 1363 strings, none differ.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ref_env  # noqa: E402

CORPORA = [os.path.join(ref_env.ROOT, "tests", "data", "megatron_preprocess", "corpus.jsonl"),
           os.path.join(ref_env.ROOT, "tests", "data", "tokenizer", "corpus.jsonl")]


def main():
    from transformers import GPT2Tokenizer
    slow = GPT2Tokenizer(ref_env.VOCAB, ref_env.MERGES)
    fast = ref_env.hf_gpt2_fast()
    n = 0
    differ = []
    for path in CORPORA:
        for line in open(path, encoding="utf-8"):
            text = json.loads(line).get("text", "")
            for s in text if isinstance(text, list) else [text]:
                want = slow.convert_tokens_to_ids(slow.tokenize(s))
                got = [fast.convert_tokens_to_ids(fast.tokenize(s)), slow(s).input_ids, fast(s).input_ids]
                n += 1
                if any(g != want for g in got):
                    differ.append(s[:60])
    print(f"{n} strings, {len(differ)} differ" + "".join(f"\n  {d!r}" for d in differ[:10]))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
