#!/usr/bin/env python3
"""Generates tests/data/fim/: a small GPT-2 dataset made from the bundled sample, and the first samples that
Megatron-LM's own fill-in-the-middle dataset (GPTFIMDataset, megatron/training/datasets/fim_dataset.py of the
core_v0.16.1 tag, the Megatron-LM release of megatron-core 0.16.1) gives for a few flag sets.

  doc.{bin,idx}   the first 40 documents of sample/slimpajama-mini/validation/chunk{1,2}/*.jsonl.zst, cut to varied
                  lengths so that samples hold several documents, an empty one after every sixth, tokenized by
                  Megatron's GPT2BPETokenizer (its tokenize, then the EOD, as tools/preprocess_data.py --append-eod),
                  written by megatron-core's IndexedDatasetBuilder
  samples.json    per flag set: its GPTFIMDatasetConfig's FIM fields and the text (seq_length + 1 token ids) of
                  dataset[0], dataset[1], ... read in that order (the FIM RNG is the dataset's, drawn as read);
                  "plain": the same of megatron-core's GPTDataset (no FIM); "rng": numpy's draws (rng_draws)

The vocabulary is GPT-2's vocab.json with <fim_prefix> <fim_middle> <fim_suffix> <fim_pad> added at 50257..50260
(written by fim_vocab(); tests/trainer/fim_dataset_test.cpp writes the same file): GPT-2's own lacks them,
and for a token it lacks Megatron's tokens_to_ids gives the unknown token <|endoftext|>, which ptk refuses.

Megatron's code runs unchanged. What is shimmed around it:
  - megatron_shim.install(): megatron and megatron.core as bare packages, megatron.core.utils.log_single_rank
    (a logging call) and megatron.core.safe_globals stubbed, as for the other dataset goldens;
  - megatron.training and megatron.training.datasets registered as bare packages, so that only fim_dataset.py
    (loaded from --fim-dataset-py, its git blob recorded) runs, not the training package's __init__;
  - the Hugging Face hub's "gpt2" (which MegatronHFTokenizer names) served from an offline cache snapshot of the
    same vocab.json and merges.txt (megatron_shim.offline_gpt2_workdir).

Needs torch (megatron-core's datasets), transformers 4.x with its dependencies, zstd and git. Made with PyPI torch
2.6 (/opt/ptk-torch26), megatron-core 0.16.1 and transformers 4.44.2 (/opt/ptk-pyref), and transformers' pure-Python
dependencies that venv lacks (requests, urllib3, idna, certifi, charset_normalizer, chardet, six, tqdm, yaml, and
regex's metadata) linked from Debian's /usr/lib/python3/dist-packages into a folder DEPS, with their .dist-info or
.egg-info:
  git -C MEGATRON_LM show core_v0.16.1:megatron/training/datasets/fim_dataset.py > /tmp/fim_dataset.py
  PYTHONPATH=/opt/ptk-pyref:DEPS /opt/ptk-torch26/bin/python tests/support/gen_fim_golden.py --fim-dataset-py /tmp/fim_dataset.py
"""
import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_shim  # noqa: E402
import ref_env  # noqa: E402

OUT = os.path.join(ref_env.ROOT, "tests", "data", "fim")
SOURCES = [os.path.join(ref_env.ROOT, "sample", "slimpajama-mini", "validation", f"chunk{c}", f"example_holdout_{k}.jsonl.zst")
           for c in (1, 2) for k in (0, 1)]
FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
SEQ, SEED, SAMPLES = 96, 1234, 40

# name -> the FIM fields of GPTFIMDatasetConfig (pretrain_gpt.py's names for the flags)
CONFIGS = {
    "psm": dict(fim_rate=0.9, fim_spm_rate=0.0),
    "spm": dict(fim_rate=0.7, fim_spm_rate=1.0),
    "mixed": dict(fim_rate=0.5, fim_spm_rate=0.5),
    "split_fragments": dict(fim_rate=0.8, fim_spm_rate=0.5, fim_split_sample="Ċ", fim_fragment_rate=0.6),
    "no_prefix": dict(fim_rate=1.0, fim_spm_rate=0.3, fim_no_prefix="Psalms"),
}


def fim_vocab(path):
    with open(ref_env.VOCAB, encoding="utf-8") as f:
        vocab = json.load(f)
    for i, t in enumerate(FIM_TOKENS):
        vocab[t] = 50257 + i
    with open(path, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)


def write_dataset(tok, prefix):
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    text = subprocess.run(["zstd", "-dc"] + SOURCES, check=True, capture_output=True).stdout.decode("utf-8")
    docs = [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    lengths = [40, 300, 120, 900, 60, 15, 500, 200, 80, 1500]
    for i, d in enumerate(docs[:40]):
        ids = tok.tokenize(d[: lengths[i % len(lengths)]]) + [tok.eod]
        b.add_item(torch.tensor(ids, dtype=torch.int64))
        b.end_document()
        if i % 6 == 5:  # an empty document: two EODs in a row, whose empty segment FIM drops (then pads)
            b.add_item(torch.tensor([tok.eod], dtype=torch.int64))
            b.end_document()
    b.finalize(prefix + ".idx")


def rng_draws():
    """numpy's legacy RandomState calls GPTFIMDataset makes (binomial(1, p), randint(0, n + 1, size=2)), in a
    fixed interleaving: ["b", p, value] and ["r", n, [values]], for the RNG's unit test."""
    import numpy
    rng = numpy.random.RandomState(seed=7)
    out = []
    for k in range(200):
        p = [0.0, 1.0, 0.5, 0.3, 0.9, 1e-9, 0.999999, 0.25][k % 8]
        out.append(["b", p, int(rng.binomial(1, p))])
        n = [0, 1, 10, 255, 256, 1000, 2**32 - 1, 2**32, 3 * 2**33][k % 9]
        out.append(["r", n, [int(x) for x in rng.randint(low=0, high=n + 1, size=2)]])
    return out


def load_fim_module(path):
    for name in ("megatron.training", "megatron.training.datasets"):
        if name not in sys.modules or not isinstance(getattr(sys.modules[name], "__path__", None), list):
            mod = types.ModuleType(name)
            mod.__path__ = []
            sys.modules[name] = mod
        else:
            sys.modules[name].__path__ = []
    spec = importlib.util.spec_from_file_location("megatron.training.datasets.fim_dataset", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fim-dataset-py", required=True, help="megatron/training/datasets/fim_dataset.py of core_v0.16.1")
    args = ap.parse_args()
    blob = subprocess.run(["git", "hash-object", args.fim_dataset_py], check=True, capture_output=True,
                          text=True).stdout.strip()
    megatron_shim.install(training_args=True)
    work = tempfile.mkdtemp(prefix="ptk-fim-")
    vocab = os.path.join(work, "fim-vocab.json")
    fim_vocab(vocab)
    megatron_shim.offline_gpt2_workdir(work, vocab, ref_env.MERGES)
    os.chdir(work)
    megatron_shim.one_process_gloo_group()
    tok = megatron_shim.gpt2_bpe_tokenizer()
    fim = load_fim_module(args.fim_dataset_py)
    assert tok._tokenizer.tokens_to_ids(FIM_TOKENS) == [50257, 50258, 50259, 50260], "not the FIM vocabulary"
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    write_dataset(tok, os.path.join(OUT, "doc"))
    extra = dict(zip(["prefix", "middle", "suffix", "pad"], FIM_TOKENS), eod="<|endoftext|>")
    rec = {"fim_dataset_py_blob": blob, "seq_length": SEQ, "seed": SEED, "split": "1,0,0", "num_samples": SAMPLES,
           "extra_tokens": extra, "vocab_sha256": hashlib.sha256(open(vocab, "rb").read()).hexdigest(), "configs": {}}
    for name, c in CONFIGS.items():
        cfg = fim.GPTFIMDatasetConfig(random_seed=SEED, sequence_length=SEQ, blend=get_blend_from_list([os.path.join(OUT, "doc")]),
                                      split="1,0,0", path_to_cache=os.path.join(work, "cache", name), tokenizer=tok,
                                      reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                      fim_extra_tokens=extra, **c)
        ds = BlendedMegatronDatasetBuilder(fim.GPTFIMDataset, [SAMPLES, None, None], lambda: True, cfg).build()[0]
        texts = []
        for i in range(SAMPLES):
            s = ds[i]
            texts.append(s["tokens"].tolist() + s["labels"].tolist()[-1:])
        rec["configs"][name] = {"flags": c, "class": type(ds).__name__, "length": len(ds), "texts": texts}
        marks = sum(t.count(50257) for t in texts)
        print(f"{name}: {type(ds).__name__}[{len(ds)}], {marks} <fim_prefix> in {SAMPLES} samples", file=sys.stderr)
    # The same data without --fim-data: megatron-core's plain GPTDataset (what ptk reads when the flag is absent).
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    cfg = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, blend=get_blend_from_list([os.path.join(OUT, "doc")]),
                           split="1,0,0", path_to_cache=os.path.join(work, "cache", "plain"), tokenizer=tok,
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    ds = BlendedMegatronDatasetBuilder(GPTDataset, [SAMPLES, None, None], lambda: True, cfg).build()[0]
    rec["plain"] = {"class": type(ds).__name__, "length": len(ds),
                    "texts": [ds[i]["tokens"].tolist() + ds[i]["labels"].tolist()[-1:] for i in range(SAMPLES)]}
    rec["rng"] = rng_draws()
    with open(os.path.join(OUT, "samples.json"), "w") as f:
        json.dump(rec, f, indent=None, separators=(",", ":"))
        f.write("\n")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
