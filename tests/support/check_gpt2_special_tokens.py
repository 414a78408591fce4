#!/usr/bin/env python3
"""Checks what Megatron's --tokenizer-special-tokens does to GPT2BPETokenizer's ids, which is why
ptk-tokenize accepts --tokenizer-special-tokens '<|endoftext|>' (and, with --legacy-tokenizer, any value)
and refuses other values.

megatron-core 0.16.1's build_tokenizer (megatron/core/tokenizers/text/utils/build_tokenizer.py) passes
the flag's tokens to the Hugging Face GPT-2 tokenizer as additional_special_tokens
(HuggingFaceTokenizer.__init__ adds them with add_special_tokens); the legacy _GPT2BPETokenizer
(--legacy-tokenizer, megatron/training/tokenizer/tokenizer.py) does not read the flag. This runs
megatron-core's HuggingFaceTokenizer over GPT-2's vocab and merges (a local directory in place of the
"gpt2" hub id MegatronHFTokenizer names, the same files), slow tokenizer (0.16.1's default), and compares
text_to_ids with and without each list, over every string of the goldens' corpora and a few more:
  ['<|endoftext|>']: the same ids and vocabulary size (GPT-2's eos token is a special token already);
  ['<x>']: a new id (50257) where the text holds '<x>', and a larger vocabulary;
  ['hello']: a token of GPT-2's vocabulary made special: split out of the words that hold it ("xhelloy": x, hello, y).

Needs transformers 4.x (with requests) and megatron-core (with torch), e.g.
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python3 tests/support/check_gpt2_special_tokens.py
Checked with megatron-core 0.16.1 and transformers 4.44.2: 1369 strings; ['<|endoftext|>'] none differ,
vocabulary 50257; ['<x>'] 'x <x> y' differs, vocabulary 50258; ['hello'] 'xhelloy' differs.
"""
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ref_env  # noqa: E402

CORPORA = [os.path.join(ref_env.ROOT, "tests", "data", "megatron_preprocess", "corpus.jsonl"),
           os.path.join(ref_env.ROOT, "tests", "data", "tokenizer", "corpus.jsonl")]
EXTRA = ["a<|endoftext|>b", "<|endoftext|>", "x <x> y", "hello world", "xhelloy", "Hello <|endoftext|> again"]


def strings():
    for path in CORPORA:
        for line in open(path, encoding="utf-8"):
            text = json.loads(line).get("text", "")
            yield from text if isinstance(text, list) else [text]
    yield from EXTRA


def build(local, special):
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer
    return HuggingFaceTokenizer(local, vocab_file=ref_env.VOCAB, merges_file=ref_env.MERGES, use_fast=False,
                                additional_special_tokens=special, include_special_tokens=False)


def main():
    local = tempfile.mkdtemp()
    try:
        shutil.copy(ref_env.VOCAB, os.path.join(local, "vocab.json"))
        shutil.copy(ref_env.MERGES, os.path.join(local, "merges.txt"))
        with open(os.path.join(local, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer"}, f)
        plain = build(local, [])
        texts = list(strings())
        want = [plain.text_to_ids(s) for s in texts]
        bad = 0
        for special, same in ((["<|endoftext|>"], True), (["<x>"], False), (["hello"], False)):
            t = build(local, special)
            differ = [s for s, w in zip(texts, want) if t.text_to_ids(s) != w]
            size = len(t.tokenizer)
            print(f"{special}: {len(texts)} strings, {len(differ)} differ{''.join(f' {d[:30]!r}' for d in differ[:3])}"
                  f"; vocabulary {size} (without: {len(plain.tokenizer)})")
            if same != (not differ and size == len(plain.tokenizer)):
                bad += 1
        return 1 if bad else 0
    finally:
        shutil.rmtree(local)


if __name__ == "__main__":
    sys.exit(main())
