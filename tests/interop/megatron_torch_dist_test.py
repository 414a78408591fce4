"""ptk-convert --loader megatron on Megatron's torch_dist checkpoints (PyTorch's distributed checkpoint).

The checkpoints under tests/data/torch_dist/ were written by PyTorch 2.5's own torch.distributed.checkpoint
(tests/support/make_torch_dist_fixture.py: megatron-core's sharded keys, layers stacked, chunks per layer and
tensor-parallel rank); each expected.json records the SHA-256 of every merged tensor. The ptk
checkpoint ptk-convert writes must hold each weight (the fp32 masters of the --bf16 one) and AdamW
moment bit for bit, and the iteration, consumed samples and Adam step. Damaged copies (a .distcp
missing, truncated, a flipped byte, a key the model has not, args that do not match the tensors) are
refused with one line naming the file and key or byte offset, exit non-zero, and nothing is written.

Usage: megatron_torch_dist_test.py BIN_DIR
"""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy

BIN = sys.argv[1]
HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "torch_dist")
CONVERT = os.path.join(BIN, "ptk-convert")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def convert(load, save):
    return subprocess.run([CONVERT, "--loader", "megatron", "--saver", "ptk", "--load-dir", load, "--save-dir", save],
                          capture_output=True, text=True)


def read_ptk(save):
    it = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    data = open(os.path.join(save, f"iter_{it:07d}", "mp_rank_00", "model_optim_rng.ptk"), "rb").read()
    assert data[:8] == b"PTKCKPT1" and hashlib.sha256(data[:-64]).hexdigest().encode() == data[-64:]
    (n,) = struct.unpack("<Q", data[8:16])
    h = json.loads(data[16:16 + n])
    return h, numpy.frombuffer(data[16 + n:-64], dtype="<f4").reshape(3, h["num_params"])


def converts_bit_for_bit(tmp, name):
    save = os.path.join(tmp, name + "-ptk")
    p = convert(os.path.join(DATA, name), save)
    check(p.returncode == 0, f"{name}: converts ({p.returncode}: {p.stderr.strip()})")
    if p.returncode != 0:
        return
    exp = json.load(open(os.path.join(DATA, name, "expected.json")))
    h, arr = read_ptk(save)
    check(h["iteration"] == exp["iteration"], f"{name}: iteration {h['iteration']}")
    check(h["adam_step"] == exp["adam_step"], f"{name}: adam step {h['adam_step']} (want {exp['adam_step']})")
    check(h["consumed_train_samples"] == 8 * exp["iteration"], f"{name}: consumed samples")
    names = {t["name"]: t for t in h["tensors"]}
    check(sorted(names) == sorted(exp["tensors"]), f"{name}: tensor names {sorted(set(names) ^ set(exp['tensors']))}")
    compared = 0
    for tname, entry in exp["tensors"].items():
        t = names.get(tname)
        if t is None:
            continue
        size = int(numpy.prod(t["shape"]))
        for which, row in (("weight", 0), ("exp_avg", 1), ("exp_avg_sq", 2)):
            got = arr[row, t["offset"]:t["offset"] + size]
            if which not in entry:
                check(not got.any(), f"{name}: {which} of {tname} is zero (no optimizer state saved)")
                continue
            want = entry[which]
            check(list(t["shape"]) == want["shape"], f"{name}: shape of {tname} {t['shape']} != {want['shape']}")
            ok = hashlib.sha256(got.astype("<f4").tobytes()).hexdigest() == want["sha256"]
            check(ok, f"{name}: {which} of {tname} bit for bit (first {got[:3].tolist()} want {want['first']})")
            compared += 1
    check(compared >= len(exp["tensors"]), f"{name}: compared {compared} tensors")
    print(f"{name}: {compared} tensors bit for bit")


def refused(tmp, label, mutate, *needles):
    """A copy damaged by `mutate(iter_dir)`: one line naming what, exit non-zero, nothing written."""
    src = os.path.join(DATA, "te_untied_fp32")
    ck = os.path.join(tmp, label)
    shutil.copytree(src, ck)
    mutate(os.path.join(ck, "iter_0000030"))
    save = os.path.join(tmp, label + "-ptk")
    p = convert(ck, save)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    check(p.returncode != 0, f"{label}: exit {p.returncode}")
    check(len(lines) == 1, f"{label}: one line, got {lines}")
    for n in needles:
        check(n in p.stderr, f"{label}: {n!r} in {p.stderr.strip()!r}")
    check(not os.path.exists(save) or not os.listdir(save), f"{label}: nothing written in {save}")
    print(f"{label}: {p.stderr.strip()}")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        converts_bit_for_bit(tmp, "te_untied_fp32")
        converts_bit_for_bit(tmp, "local_tied_bf16")

        refused(tmp, "missing-distcp", lambda d: os.remove(os.path.join(d, "__0_1.distcp")), "__0_1.distcp: missing")

        def truncate(d):
            f = os.path.join(d, "__0_0.distcp")
            os.truncate(f, os.path.getsize(f) - 1000)
        refused(tmp, "truncated-distcp", truncate, "__0_0.distcp: byte ", "truncated")

        def flip(d):
            f = os.path.join(d, "__0_0.distcp")
            data = bytearray(open(f, "rb").read())
            # Inside the first float tensor's storage: past the first archive's local header and pickle.
            at = data.index(b"archive/data/0") + 200
            data[at] ^= 0x40
            open(f, "wb").write(bytes(data))
        refused(tmp, "flipped-byte", flip, "__0_0.distcp: byte ", "CRC-32 mismatch")

        def unknown_key(d):
            f = os.path.join(d, ".metadata")
            data = open(f, "rb").read()
            old, new = b"decoder.final_layernorm.bias", b"decoder.final_layernorm.bixs"
            assert old in data
            open(f, "wb").write(data.replace(old, new))
        refused(tmp, "unknown-key", unknown_key, ".metadata", "decoder.final_layernorm.bixs", "not a weight")

        def wrong_args(d):
            import torch  # Debian's PyTorch reads and rewrites common.pt
            f = os.path.join(d, "common.pt")
            common = torch.load(f)
            common["args"].ffn_hidden_size = 128
            torch.save(common, f)
        refused(tmp, "args-mismatch", wrong_args, ".metadata", "mlp.linear_fc1.bias", "shape [2, 64]",
                "--ffn-hidden-size 128")

        refused(tmp, "no-common", lambda d: os.remove(os.path.join(d, "common.pt")), "common.pt: missing")
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
