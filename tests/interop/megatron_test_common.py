"""What the Megatron checkpoint tests share (megatron_checkpoint_test.py, megatron_torch_dist_test.py):
running ptk-convert, reading the ptk checkpoint it writes, and counting failures.

Imported from the tests' own directory (Python puts a script's directory first on sys.path); the tests
take the build's bin directory as their first argument.
"""
import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy

BIN = sys.argv[1]
CONVERT = os.path.join(BIN, "ptk-convert")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def finish(ok_message):
    """Exit 1 with the count of failures, or print `ok_message`."""
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print(ok_message)


def run(*argv, ok=True):
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if ok and p.returncode != 0:
        raise SystemExit(f"{argv} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def convert(loader, saver, load, save, *flags, ok=True):
    return run(CONVERT, "--loader", loader, "--saver", saver, "--load-dir", load, "--save-dir", save, *flags, ok=ok)


def read_ptk(save):
    """The latest ptk checkpoint in `save`: its header and a [3, num_params] float32 array (params,
    exp_avg, exp_avg_sq); the file's SHA-256 trailer checked."""
    it = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    data = open(os.path.join(save, f"iter_{it:07d}", "mp_rank_00", "model_optim_rng.ptk"), "rb").read()
    assert data[:8] == b"PTKCKPT1" and hashlib.sha256(data[:-64]).hexdigest().encode() == data[-64:]
    (n,) = struct.unpack("<Q", data[8:16])
    h = json.loads(data[16:16 + n])
    return h, numpy.frombuffer(data[16 + n:-64], dtype="<f4").reshape(3, h["num_params"])


def ptk_tensor(h, arr, which, name):
    """Tensor `name` of row `which` (0 params, 1 exp_avg, 2 exp_avg_sq) in its shape."""
    for t in h["tensors"]:
        if t["name"] == name:
            size = int(numpy.prod(t["shape"]))
            return arr[which, t["offset"]:t["offset"] + size].reshape(t["shape"])
    raise KeyError(name)


def same_bits(a, b):
    a = numpy.ascontiguousarray(a, dtype=numpy.float32)
    b = numpy.ascontiguousarray(b, dtype=numpy.float32)
    return a.shape == b.shape and a.tobytes() == b.tobytes()
