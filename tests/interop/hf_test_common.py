"""What the Hugging Face tests share (hf_transformers_test.py, hf_llama_test.py, hf_llama_resume_test.py,
hf_qwen3_test.py): transformers from /opt/ptk-pyref (4.44.2 from PyPI on Debian's torch 1.13, CPU; for
hf_qwen3_test.py 4.51.3 from /opt/ptk-pyref/transformers-qwen3; installed by scripts/install-deps.sh
--with-python-ref), running the tools, counting failures, loading a model with
every warning captured, and ptk's logits (logits_tool) against transformers'.

Imported from the tests' own directory (Python puts a script's directory first on sys.path); the tests
take the build's bin directory and the test binaries' directory as their arguments.
"""
import logging
import os
import re
import shlex
import subprocess
import sys

BIN, TEST_BIN = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
# PTK_HF_REFERENCE=qwen3 (hf_qwen3_test.py sets it before importing this module): transformers 4.51.3 from
# its own folder, transformers-qwen3 (see reference_dirs), instead of 4.44.2.
QWEN3 = os.environ.get("PTK_HF_REFERENCE") == "qwen3"


def reference_dirs():
    """Where install-deps.sh puts the reference: $PTK_PYREF_DIR, else /opt/ptk-pyref (for Qwen3 the
    transformers-qwen3 folder inside); the existing ones, the first one first."""
    roots = [os.environ.get("PTK_PYREF_DIR", ""), "/opt/ptk-pyref"]
    dirs = [os.path.join(r, "transformers-qwen3") if QWEN3 else r for r in roots if r]
    return [d for d in dirs if os.path.isdir(d)]


def skip_or_fail(what):
    """A reference that is not installed: exit 77 (CTest's skip) with a banner on stdout and stderr, or, under CI
    (CI=true, where scripts/test.sh has run install-deps.sh --with-python-ref), exit 1."""
    bar = "!" * 100
    ci = os.environ.get("CI", "") == "true"
    msg = ("{bar}\n{verdict}: {what}\nInstall it with: bash scripts/install-deps.sh --with-python-ref\n{bar}").format(
        bar=bar, verdict="FAILED (CI=true)" if ci else "SKIPPED: NOT TESTED", what=what)
    print(msg, flush=True)
    print(msg, file=sys.stderr, flush=True)
    sys.exit(1 if ci else 77)


if QWEN3 and not reference_dirs():
    skip_or_fail("ptk's Qwen3ForCausalLM export and import were NOT checked against transformers: no "
                 "transformers-qwen3 folder in $PTK_PYREF_DIR or /opt/ptk-pyref (transformers 4.51.3 and its pins)")
for p in reversed(reference_dirs()):
    if p not in sys.path:
        sys.path.insert(0, p)
if QWEN3:  # transformers 4.51 on Debian's torch 1.13: tests/support/torch2_shim.py says what it adds
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
    import torch2_shim  # noqa: E402
    torch2_shim.install()
import numpy  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

CONVERT = os.path.join(BIN, "ptk-convert")
TOL = 1e-4
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def finish(name):
    """Print the verdict and exit 1 on any failure."""
    print("{}: {}".format(name, "OK" if not failures else "{} failure(s)".format(len(failures))))
    sys.exit(1 if failures else 0)


def run(args, expect=0):
    """stdout and stderr together; an exit code other than `expect` is a failure."""
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check(r.returncode == expect, "exit {} (expected {}) for {}:\n{}".format(r.returncode, expect, " ".join(args),
                                                                             r.stdout[-3000:]))
    return r.stdout


class Capture(logging.Handler):  # every warning transformers logs while loading (missing weights are logged)
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


transformers.logging.set_verbosity_warning()
capture = Capture()
transformers.logging.get_logger().addHandler(capture)


def load_checked(cls, path, **kwargs):
    """cls.from_pretrained(path) with no missing, unexpected or mismatched weight and no warning."""
    capture.records.clear()
    model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
    check(all(not v for v in info.values()), "{}: loading info {}".format(path, info))
    check(not capture.records, "{}: warnings while loading: {}".format(path, capture.records))
    return model.eval()


def hf_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq]), use_cache=False).logits[0].numpy()


def ptk_logits(ckpt, seqs, vocab, tmp):
    seq_file, out = os.path.join(tmp, "seqs.txt"), os.path.join(tmp, "logits.f32")
    with open(seq_file, "w") as f:
        for s in seqs:
            f.write(" ".join(map(str, s)) + "\n")
    if os.path.exists(out):
        os.remove(out)  # a failed run must not leave the previous call's logits to compare
    run([os.path.join(TEST_BIN, "logits_tool"), ckpt, seq_file, out])
    if not os.path.exists(out):
        return [numpy.zeros((0, vocab), dtype=numpy.float32) for _ in seqs]
    flat = numpy.fromfile(out, dtype=numpy.float32)
    res, at = [], 0
    for s in seqs:
        res.append(flat[at:at + len(s) * vocab].reshape(len(s), vocab))
        at += len(s) * vocab
    check(at == flat.size, "logits_tool wrote {} values, {} expected".format(flat.size, at))
    return res


def compare_logits(ckpt, model, seqs, vocab, tmp, what):
    """ptk's logits of checkpoint `ckpt` equal transformers' `model`'s within TOL on each sequence (the largest
    difference printed)."""
    worst = 0.0
    for seq, ours in zip(seqs, ptk_logits(ckpt, seqs, vocab, tmp)):
        theirs = hf_logits(model, seq)
        check(theirs.shape == ours.shape, "{}: shapes {} {}".format(what, theirs.shape, ours.shape))
        if theirs.shape == ours.shape:
            diff = float(numpy.abs(theirs - ours).max())
            worst = max(worst, diff)
            check(diff <= TOL, "{}: {} tokens: logits differ by {} (> {})".format(what, len(seq), diff, TOL))
            check(float(numpy.abs(ours).max()) > 1.0, "{}: logits too small to test anything".format(what))
    print("{}: ptk's and transformers' logits differ by at most {:.3g} ({} sequences, tolerance {})".format(
        what, worst, len(seqs), TOL))
    return model


def train_from_import(flags, ckin, mode):
    """ptk-train's output for 2 iterations on mock data from the checkpoint `ckin` ptk-convert's import wrote,
    with the model flags the import printed (`flags`, a list) and `mode` (--finetune, --no-load-optim)."""
    return run([os.path.join(BIN, "ptk-train")] + flags +
               ["--seq-length", "40", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--mock-data",
                "--eval-iters", "0", "--log-interval", "1", "--threads", "2", "--load", ckin, mode])


def check_finetune(out, ckin):
    """ptk-convert's import (its output `out`, its checkpoint `ckin`) printed the ptk-train flags to continue
    training with ("continue training with: ptk-train ... --seq-length N"), and ptk-train --finetune with them loads
    the import's weights. Returns those flags (a list), or None when the import printed none."""
    flags = re.search(r"continue training with: ptk-train (.*) --seq-length N", out)
    check(flags is not None, "ptk-convert prints ptk-train's flags:\n" + out)
    if not flags:
        return None
    # as a shell reads them: --moe-layer-freq "[0,1]" is quoted
    tr = train_from_import(shlex.split(flags.group(1)), ckin, "--finetune")
    check("--finetune: loaded the weights of iteration 0" in tr, "ptk-train --finetune from the import:\n" + tr)
    return shlex.split(flags.group(1))


SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def check_sharded_export(hf_dir, model, max_shard_size, tmp, what):
    """ptk's export `hf_dir`, written with --max-shard-size `max_shard_size`, is sharded as transformers'
    save_pretrained(max_shard_size=...) shards the model it loaded (`model`): the same shard files holding the same
    tensors, the index byte for byte, no model.safetensors."""
    from safetensors import safe_open
    ref = os.path.join(tmp, what.replace(" ", "_") + "-save_pretrained")
    model.save_pretrained(ref, safe_serialization=True, max_shard_size=max_shard_size)
    ours = sorted(f for f in os.listdir(hf_dir) if SHARD_NAME.fullmatch(f))
    theirs = sorted(f for f in os.listdir(ref) if SHARD_NAME.fullmatch(f))
    check(len(ours) > 2 and ours == theirs, "{}: shards {} vs save_pretrained's {}".format(what, ours, theirs))
    check(not os.path.exists(os.path.join(hf_dir, "model.safetensors")), "{}: a model.safetensors too".format(what))
    index = "model.safetensors.index.json"
    check(open(os.path.join(hf_dir, index), "rb").read() == open(os.path.join(ref, index), "rb").read(),
          "{}: {} differs from save_pretrained's".format(what, index))
    for name in sorted(set(ours) & set(theirs)):
        with safe_open(os.path.join(hf_dir, name), framework="pt") as a, \
                safe_open(os.path.join(ref, name), framework="pt") as b:
            check(sorted(a.keys()) == sorted(b.keys()) and a.metadata() == {"format": "pt"},
                  "{}: {} holds {} (save_pretrained's: {})".format(what, name, sorted(a.keys()), sorted(b.keys())))
    print("{}: {} shards, as save_pretrained(max_shard_size={!r}) writes them".format(what, len(ours), max_shard_size))


def check_sharded_import(src, max_shard_size, ck_whole, tmp, what):
    """transformers' `src` saved by save_pretrained(max_shard_size=...) imports into ptk with the weights of the
    unsharded import `ck_whole`, bit for bit (both exported back whole: the same model.safetensors)."""
    hfs, cks = os.path.join(tmp, what + "-hf"), os.path.join(tmp, what + "-ck")
    src.save_pretrained(hfs, safe_serialization=True, max_shard_size=max_shard_size)
    check(os.path.exists(os.path.join(hfs, "model.safetensors.index.json")) and
          not os.path.exists(os.path.join(hfs, "model.safetensors")), "{}: save_pretrained did not shard".format(what))
    run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfs, "--save-dir", cks])
    out = []
    for ck in (ck_whole, cks):
        out.append(os.path.join(tmp, what + "-back-" + os.path.basename(ck)))
        run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", out[-1]])
    a, b = (open(os.path.join(d, "model.safetensors"), "rb").read() for d in out)
    check(a == b and len(a) > 0, "{}: the sharded import's weights differ from the unsharded import's".format(what))
