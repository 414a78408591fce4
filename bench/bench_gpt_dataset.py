#!/usr/bin/env python3
"""GPTDataset benchmark: building the document/sample/shuffle indices of a synthetic one-billion-token
dataset with ptk vs megatron-core's BlendedMegatronDatasetBuilder, in the same run, after checking
that both write byte-identical .npy caches; then sample read throughput of ptk's prefetching loader
next to megatron-core's GPTDataset.__getitem__.

Runs under Debian's python3 (numpy, torch) with megatron-core on PYTHONPATH (/opt/ptk-pyref, as
scripts/install-deps.sh --with-python-ref installs it):
  python3 bench/bench_gpt_dataset.py [--build build] [--tokens 1e9] [--seq 2048]
The .bin is sparse (index building reads only the .idx).
"""
import argparse
import atexit
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


class Tok:
    """The tokenizer facts the dataset code uses, with ptk's GPT-2 identifiers."""
    eod = 50256
    vocab_size = 50257
    pad = None

    @property
    def unique_identifiers(self):
        from collections import OrderedDict
        return OrderedDict([("class", "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText"),
                            ("tokenizer_path", "GPT2BPETokenizer"), ("additional_special_tokens", "[]"),
                            ("vocab_file", "gpt2-vocab.json"), ("merges_file", "gpt2-merges.txt"), ("use_fast", "True"),
                            ("trust_remote_code", "False"), ("include_special_tokens", "True")])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--tokens", type=float, default=1e9)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--epochs", type=float, default=2.5, help="train samples requested, in epochs")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    for p in ("/opt/ptk-pyref", os.environ.get("PTK_PYREF_DIR", "")):
        if p and os.path.isdir(p):
            sys.path.insert(0, p)
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    import numpy
    import megatron_shim
    megatron_shim.install(training_args=False)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    tmp = tempfile.mkdtemp(prefix="ptk-bench-gpt-")
    atexit.register(shutil.rmtree, tmp, True)  # also when a step fails
    os.chdir(tmp)
    # ~1000-token documents, lognormal lengths.
    rng = numpy.random.RandomState(0)
    n_docs = int(a.tokens / 1000)
    lengths = numpy.clip(rng.lognormal(6.5, 0.8, n_docs), 1, 60000).astype(numpy.int32)
    total = int(lengths.sum(dtype=numpy.int64))
    with open("data.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8]) + n_docs.to_bytes(8, "little") +
                (n_docs + 1).to_bytes(8, "little"))
        f.write(lengths.tobytes())
        ptr = numpy.zeros(n_docs, dtype=numpy.int64)
        ptr[1:] = numpy.cumsum(lengths[:-1].astype(numpy.int64) * 2)
        f.write(ptr.tobytes())
        f.write(numpy.arange(n_docs + 1, dtype=numpy.int64).tobytes())
    with open("data.bin", "wb") as f:
        f.truncate(total * 2)
    per_epoch = (total - 1) // a.seq
    sizes = [int(per_epoch * a.epochs), 2000, 200]
    split = "969,30,1"
    print(f"dataset: {n_docs} documents, {total / 1e9:.2f} B tokens; seq {a.seq}; samples requested {sizes}")

    def megatron_build(cache):
        cfg = GPTDatasetConfig(random_seed=1234, sequence_length=a.seq, blend=(["data"], None), split=split,
                               path_to_cache=cache, tokenizer=Tok(), reset_position_ids=False, reset_attention_mask=False,
                               eod_mask_loss=False)
        t = time.perf_counter()
        ds = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
        return time.perf_counter() - t, ds

    def ptk_build(cache):
        out = subprocess.run([os.path.join(a.build, "bench", "gpt_dataset_bench"), "build", "data", cache, str(a.seq),
                              *map(str, sizes), split], capture_output=True, text=True, check=True).stdout
        return json.loads(out)["build_s"]

    t_meg, t_ptk = [], []
    for r in range(a.repeats):
        for c in ("meg", "ptk"):
            shutil.rmtree(c, ignore_errors=True)
        t, meg_ds = megatron_build("meg")
        t_meg.append(t)
        t_ptk.append(ptk_build("ptk"))
    # Gate: the same cache files, byte for byte.
    mf = sorted(os.path.basename(p) for p in glob.glob("meg/*"))
    pf = sorted(os.path.basename(p) for p in glob.glob("ptk/*"))
    assert mf == pf, f"different cache files: {mf} vs {pf}"
    for f in mf:
        assert open(os.path.join("meg", f), "rb").read() == open(os.path.join("ptk", f), "rb").read(), f"{f} differs"
    print(f"index caches: {len(mf)} files, byte-identical between megatron-core and ptk")

    # Loader throughput. The .bin is sparse (all-zero tokens): read it once so that both sides find
    # its pages cached and the copy path, not page-fault zeroing, is what gets measured.
    with open("data.bin", "rb") as f:
        while f.read(1 << 24):
            pass
    mbs, batches = 8, 300
    out = subprocess.run([os.path.join(a.build, "bench", "gpt_dataset_bench"), "load", "data", "ptk", str(a.seq),
                          *map(str, sizes), split, str(mbs), str(batches)], capture_output=True, text=True, check=True).stdout
    ptk_load = json.loads(out)
    train = meg_ds[0]
    t = time.perf_counter()
    for i in range(mbs * batches):
        train[i]
    meg_sps = mbs * batches / (time.perf_counter() - t)

    res = {"index_build_s": {"megatron_core": round(min(t_meg), 4), "ptk": round(min(t_ptk), 4),
                             "ratio": round(min(t_meg) / min(t_ptk), 2)},
           "samples_per_s": {"megatron_core_getitem": round(meg_sps, 1), "ptk_loader": ptk_load["samples_per_s"],
                             "ratio": round(ptk_load["samples_per_s"] / meg_sps, 2)},
           "tokens": total, "seq_length": a.seq, "samples_requested": sizes}
    print(f"index build: megatron-core {min(t_meg):.3f} s, ptk {min(t_ptk):.3f} s -> {res['index_build_s']['ratio']}x faster")
    print(f"sample reads: megatron-core {meg_sps:.0f}/s, ptk loader {ptk_load['samples_per_s']:.0f}/s -> "
          f"{res['samples_per_s']['ratio']}x")
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"bench": "gpt_dataset", "commit": commit, **res}))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
