#!/usr/bin/env python3
"""Generates tests/data/gpt_dataset/: small Megatron datasets and, for several data configurations,
the index cache and samples that megatron-core's own GPTDataset / BlendedDataset code produces.

  gpt_data/{tiny,A,B,C}.{bin,idx}   written by megatron-core's IndexedDatasetBuilder (seeded tokens;
                                   tiny = the five documents [5,3,7,2,4] of megatron-formats.md §4.3)
  CONFIG/cache/*                   what BlendedMegatronDatasetBuilder(...).build() wrote (.npy + description)
  CONFIG/samples.json              per split: length, and tokens/labels/loss_mask/position_ids of a few samples

Paths inside descriptions are relative ("gpt_data/A", tokenizer "gpt2-vocab.json"), so the test
replays them from a copy of this directory. Runs under Debian's python3 (numpy 1.24, torch 1.13)
with megatron-core 0.16.1 and transformers 4.x on PYTHONPATH (see gen_megatron_preprocess_golden.py):
  PYTHONPATH=/tmp/mlref /usr/bin/python3 tests/support/gen_gpt_dataset_goldens.py
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_shim  # noqa: E402
import ref_env  # noqa: E402

OUT = os.path.join(ref_env.ROOT, "tests", "data", "gpt_dataset")

# name -> (builder arguments, samples to record per split)
CONFIGS = {
    # the golden vector of the reference notes: 8 samples -> 2 epochs with a separate last epoch
    "tiny_8": dict(blend=["gpt_data/tiny"], split="1,0,0", seq=4, seed=1234, sizes=[8, None, None]),
    "tiny_epoch": dict(blend=["gpt_data/tiny"], split="1,0,0", seq=4, seed=1234, sizes=[None, None, None]),
    # one prefix, three splits, several epochs (train) and a small valid/test
    "single": dict(blend=["gpt_data/A"], split="90, 8, 2", seq=32, seed=1234, sizes=[900, 60, 10]),
    "single_seed42": dict(blend=["gpt_data/A"], split="80,15,5", seq=17, seed=42, sizes=[300, 40, 20]),
    # last epoch not separated (>= 80% of an epoch requested from it)
    "near_epoch": dict(blend=["gpt_data/B"], split="1,0,0", seq=16, seed=7, sizes=[250, None, None]),
    # weighted blend of three
    "blend3": dict(blend=["0.3", "gpt_data/A", "0.5", "gpt_data/B", "0.2", "gpt_data/C"], split="98,2,0", seq=16,
                   seed=1234, sizes=[400, 20, 0]),
    # unweighted blend: weights are the datasets' lengths
    "blend_unweighted": dict(blend=["gpt_data/A", "gpt_data/C"], split="90,10,0", seq=16, seed=1234, sizes=[100, 10, 0]),
    # per-split paths, Azure style (weight 1.0 per file) and a single valid file
    "per_split": dict(per_split=[["1.0", "gpt_data/A", "1.0", "gpt_data/B"], ["1.0", "gpt_data/C"], None], seq=16, seed=1234,
                      sizes=[200, 30, None]),
    # sample contents with reset_position_ids / eod_mask_loss
    "masks": dict(blend=["gpt_data/A"], split="1,0,0", seq=64, seed=5, sizes=[40, None, None], reset_position_ids=True,
                  eod_mask_loss=True, reset_attention_mask=True),
}


def write_datasets(d):
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    os.makedirs(d, exist_ok=True)
    b = IndexedDatasetBuilder(os.path.join(d, "tiny.bin"), dtype=numpy.uint16)
    t = 0
    for n in [5, 3, 7, 2, 4]:
        b.add_item(torch.tensor(list(range(t, t + n))))
        b.end_document()
        t += n
    b.finalize(os.path.join(d, "tiny.idx"))
    rng = numpy.random.RandomState(99)
    for name, ndocs, maxlen in (("A", 120, 90), ("B", 45, 60), ("C", 70, 40)):
        b = IndexedDatasetBuilder(os.path.join(d, name + ".bin"), dtype=numpy.uint16)
        for i in range(ndocs):
            n = int(rng.randint(0, maxlen))  # zero-length sequences included
            toks = rng.randint(0, 50256, size=n).tolist()
            if n > 0:
                toks[-1] = 50256  # an EOD at the end of every non-empty document, as --append-eod writes
                if n > 4 and i % 3 == 0:
                    toks[n // 2] = 50256
            b.add_item(torch.tensor(toks, dtype=torch.int64))
            b.end_document()
        b.finalize(os.path.join(d, name + ".idx"))


def main():
    ap = argparse.ArgumentParser()
    ap.parse_args()
    megatron_shim.install(training_args=True)
    work = tempfile.mkdtemp(prefix="ptk-gptds-")
    megatron_shim.offline_gpt2_workdir(work, ref_env.VOCAB, ref_env.MERGES)
    os.chdir(work)
    write_datasets("gpt_data")
    megatron_shim.one_process_gloo_group()

    tok = megatron_shim.gpt2_bpe_tokenizer()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    shutil.copytree("gpt_data", os.path.join(OUT, "gpt_data"))
    for name, c in CONFIGS.items():
        cache = os.path.join(name, "cache")
        kw = dict(random_seed=c["seed"], sequence_length=c["seq"], path_to_cache=cache, tokenizer=tok,
                  reset_position_ids=c.get("reset_position_ids", False), reset_attention_mask=c.get("reset_attention_mask", False),
                  eod_mask_loss=c.get("eod_mask_loss", False))
        if "per_split" in c:
            kw["blend_per_split"] = [get_blend_from_list(x) for x in c["per_split"]]
        else:
            kw["blend"] = get_blend_from_list(c["blend"])
            kw["split"] = c["split"]
        cfg = GPTDatasetConfig(**kw)
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, c["sizes"], lambda: True, cfg).build()
        rec = {"config": c, "splits": {}}
        for split_name, ds in zip(("train", "valid", "test"), datasets):
            if ds is None:
                rec["splits"][split_name] = None
                continue
            n = len(ds)
            picks = sorted(set([0, 1, 2, n // 2, n - 1] if n else []))
            samples = []
            for i in picks:
                s = ds[i]
                samples.append({"index": i, "dataset_id": int(s.get("dataset_id", 0)),
                                "tokens": s["tokens"].tolist(), "labels": s["labels"].tolist(),
                                "loss_mask": [float(x) for x in s["loss_mask"].tolist()],
                                "position_ids": s["position_ids"].tolist()})
            rec["splits"][split_name] = {"class": type(ds).__name__, "length": n, "samples": samples}
        os.makedirs(os.path.join(OUT, name), exist_ok=True)
        shutil.copytree(cache, os.path.join(OUT, name, "cache"))
        with open(os.path.join(OUT, name, "samples.json"), "w") as f:
            json.dump(rec, f, indent=1)
        print(f"{name}: " + ", ".join(f"{k}={v['class']}[{v['length']}]" if v else f"{k}=None"
                                      for k, v in rec["splits"].items()), file=sys.stderr)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
