#!/usr/bin/env python3
"""Compatibility of ptk's indexed datasets with megatron-core's own IndexedDataset code.

Runs under Debian's python3 with python3-numpy/python3-torch and megatron-core from PyPI (installed
by scripts/install-deps.sh --with-python-ref into /opt/ptk-pyref). Checks, for uint16 and int32
datasets with empty documents and multi-sequence documents:
  * ptk's builder and megatron's IndexedDatasetBuilder write byte-identical .bin/.idx files;
  * megatron's IndexedDataset reads every sequence and document index of ptk's files;
  * ptk reads every sequence of megatron's files (and ptk-inspect --verify accepts them);
  * ptk-merge and megatron's add_index merges are byte-identical, a merge of a merge of a merge too;
  * a .bin longer than its .idx describes: both read the same sequences (ptk with a warning);
  * megatron reads ptk-tokenize's output.
Usage: megatron_compat_test.py BIN_DIR TEST_BIN_DIR SOURCE_DIR
"""
import json
import os
import random
import subprocess
import sys
import tempfile

BIN, TEST_BIN, SRC = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, os.path.join(SRC, "tests", "support"))
for p in ("/opt/ptk-pyref", os.environ.get("PTK_PYREF_DIR", "")):
    if p and os.path.isdir(p) and p not in sys.path:
        sys.path.insert(0, p)
import megatron_shim  # noqa: E402

megatron_shim.install(training_args=False)
import numpy  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, DType  # noqa: E402

failures = 0


def check(cond, what):
    global failures
    if not cond:
        failures += 1
        print("FAIL:", what)


def random_docs(rng, n, max_id):
    docs = []
    for _ in range(n):
        seqs = rng.choice([0, 1, 1, 1, 2, 3])
        docs.append([[rng.randint(0, max_id) for _ in range(rng.randint(0, 40))] for _ in range(seqs)])
    return docs


def ptk_write(prefix, code, docs):
    subprocess.run([os.path.join(TEST_BIN, "dataset_tool"), "write", str(code), prefix], input=json.dumps(docs).encode(),
                   check=True)


def ptk_dump(prefix):
    out = subprocess.run([os.path.join(TEST_BIN, "dataset_tool"), "dump", prefix], capture_output=True, check=True)
    return json.loads(out.stdout)


def megatron_write(prefix, dtype, docs):
    import torch
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(torch.tensor(seq, dtype=torch.int64))
        b.end_document()
    b.finalize(prefix + ".idx")


def megatron_read(prefix):
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    return [[ds[int(s)].tolist() for s in range(di[d], di[d + 1])] for d in range(len(di) - 1)]


def same_bytes(a, b):
    return all(open(a + ext, "rb").read() == open(b + ext, "rb").read() for ext in (".bin", ".idx"))


def main():
    rng = random.Random(1234)
    tmp = tempfile.mkdtemp(prefix="ptk-compat-")
    for code, dtype, max_id in ((8, numpy.uint16, 50256), (4, numpy.int32, 200000)):
        docs = random_docs(rng, 300, max_id)
        docs[0] = []  # an empty first document (Megatron-LM issue #62 territory)
        p_ptk, p_meg = os.path.join(tmp, f"ptk{code}"), os.path.join(tmp, f"meg{code}")
        ptk_write(p_ptk, code, docs)
        megatron_write(p_meg, dtype, docs)
        check(same_bytes(p_ptk, p_meg), f"dtype {code}: ptk and megatron builders differ")
        check(megatron_read(p_ptk) == docs, f"dtype {code}: megatron reads other sequences from ptk's file")
        check(ptk_dump(p_meg) == docs, f"dtype {code}: ptk reads other sequences from megatron's file")
        ds = IndexedDataset(p_ptk)
        check(ds.index.dtype == dtype, f"dtype {code}: megatron sees dtype {ds.index.dtype}")
        r = subprocess.run([os.path.join(BIN, "ptk-inspect"), p_meg, "--verify"], capture_output=True)
        check(r.returncode == 0, f"ptk-inspect --verify rejects megatron's file: {r.stderr}")

    # Merges: megatron's add_index vs ptk-merge.
    parts = []
    parts_docs = []
    all_docs = []
    for i in range(3):
        docs = random_docs(rng, 50 + i, 50256)
        p = os.path.join(tmp, f"part{i}")
        megatron_write(p, numpy.uint16, docs)
        parts.append(p)
        parts_docs.append(docs)
        all_docs += docs
    meg_merged = os.path.join(tmp, "meg_merged")
    b = IndexedDatasetBuilder(meg_merged + ".bin", dtype=numpy.uint16)
    for p in parts:
        b.add_index(p)
    b.finalize(meg_merged + ".idx")
    ptk_merged = os.path.join(tmp, "ptk_merged")
    subprocess.run([os.path.join(BIN, "ptk-merge"), "--inputs", *parts, "--output-prefix", ptk_merged], check=True,
                   capture_output=True)
    check(same_bytes(meg_merged, ptk_merged), "ptk-merge and megatron add_index differ")
    check(megatron_read(ptk_merged) == all_docs, "megatron reads other sequences from ptk-merge's output")

    # A merge of a merge of a merge (with an empty dataset among the parts): each level byte-identical
    # to megatron's add_index of the same inputs.
    empty = os.path.join(tmp, "empty")
    megatron_write(empty, numpy.uint16, [])
    levels = [(parts[:2], "l1"), (["l1", empty], "l2"), ([parts[2], "l2"], "l3")]
    for inputs, name in levels:
        meg_in = [os.path.join(tmp, "meg_" + p) if p.startswith("l") else p for p in inputs]
        ptk_in = [os.path.join(tmp, "ptk_" + p) if p.startswith("l") else p for p in inputs]
        b = IndexedDatasetBuilder(os.path.join(tmp, "meg_" + name) + ".bin", dtype=numpy.uint16)
        for p in meg_in:
            b.add_index(p)
        b.finalize(os.path.join(tmp, "meg_" + name) + ".idx")
        r = subprocess.run([os.path.join(BIN, "ptk-merge"), "--inputs", *ptk_in, "--output-prefix",
                            os.path.join(tmp, "ptk_" + name)], capture_output=True)
        check(r.returncode == 0, f"ptk-merge {name}: {r.stderr}")
        check(same_bytes(os.path.join(tmp, "meg_" + name), os.path.join(tmp, "ptk_" + name)),
              f"merge level {name}: ptk-merge and megatron add_index differ")
    check(megatron_read(os.path.join(tmp, "ptk_l3")) == parts_docs[2] + parts_docs[0] + parts_docs[1],
          "megatron reads other documents from the three-level merge")

    # A .bin longer than its .idx describes: megatron reads it (the rest never looked at); ptk reads the
    # same sequences, ptk-inspect --verify accepts it with a warning; a .bin too short is refused.
    long_p = os.path.join(tmp, "long")
    megatron_write(long_p, numpy.uint16, parts_docs[0])
    with open(long_p + ".bin", "ab") as f:
        f.write(b"\x01\x02\x03")
    check(megatron_read(long_p) == parts_docs[0], "megatron does not read a .bin with trailing bytes")
    check(ptk_dump(long_p) == parts_docs[0], "ptk reads a .bin with trailing bytes otherwise than megatron")
    r = subprocess.run([os.path.join(BIN, "ptk-inspect"), long_p, "--verify"], capture_output=True, text=True)
    check(r.returncode == 0 and "long.bin: 3 trailing bytes at offset" in r.stderr
          and "(the data's 3 trailing bytes ignored)" in r.stdout, f"ptk-inspect --verify on trailing bytes: {r}")
    size = os.path.getsize(long_p + ".bin")
    os.truncate(long_p + ".bin", size - 3 - 2)
    r = subprocess.run([os.path.join(BIN, "ptk-inspect"), long_p, "--verify"], capture_output=True, text=True)
    check(r.returncode == 1 and r.stderr.count("\n") == 1 and "long.bin: sequence" in r.stderr
          and "past the end" in r.stderr, f"ptk-inspect --verify on a short .bin: {r}")

    # ptk-tokenize output read by megatron.
    corpus = os.path.join(SRC, "tests", "data", "megatron_preprocess", "corpus.jsonl")
    out = os.path.join(tmp, "tok")
    subprocess.run([os.path.join(BIN, "ptk-tokenize"), "--quiet", "--input", corpus, "--output-prefix", out,
                    "--append-eod"], check=True, capture_output=True)
    check(megatron_read(out + "_text_document") == ptk_dump(out + "_text_document"),
          "megatron and ptk read ptk-tokenize's output differently")
    if failures:
        print(f"{failures} compatibility check(s) failed")
        sys.exit(1)
    print("megatron-core compatibility: all checks passed")


if __name__ == "__main__":
    main()
