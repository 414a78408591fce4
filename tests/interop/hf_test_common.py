"""What the Hugging Face tests share (hf_transformers_test.py, hf_llama_test.py, hf_llama_resume_test.py):
transformers from /opt/ptk-pyref (4.44.2 from PyPI on Debian's torch 1.13, CPU; installed by
scripts/install-deps.sh --with-python-ref), running the tools, counting failures, loading a model with
every warning captured, and ptk's logits (logits_tool) against transformers'.

Imported from the tests' own directory (Python puts a script's directory first on sys.path); the tests
take the build's bin directory and the test binaries' directory as their arguments.
"""
import logging
import os
import subprocess
import sys

BIN, TEST_BIN = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
for p in ("/opt/ptk-pyref", os.environ.get("PTK_PYREF_DIR", "")):
    if p and os.path.isdir(p) and p not in sys.path:
        sys.path.insert(0, p)
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
    run([os.path.join(TEST_BIN, "logits_tool"), ckpt, seq_file, out])
    flat = numpy.fromfile(out, dtype=numpy.float32)
    res, at = [], 0
    for s in seqs:
        res.append(flat[at:at + len(s) * vocab].reshape(len(s), vocab))
        at += len(s) * vocab
    check(at == flat.size, "logits_tool wrote {} values, {} expected".format(flat.size, at))
    return res


def compare_logits(ckpt, model, seqs, vocab, tmp, what):
    """ptk's logits of checkpoint `ckpt` equal transformers' `model`'s within TOL on each sequence."""
    for seq, ours in zip(seqs, ptk_logits(ckpt, seqs, vocab, tmp)):
        theirs = hf_logits(model, seq)
        check(theirs.shape == ours.shape, "{}: shapes {} {}".format(what, theirs.shape, ours.shape))
        if theirs.shape == ours.shape:
            diff = float(numpy.abs(theirs - ours).max())
            check(diff <= TOL, "{}: {} tokens: logits differ by {} (> {})".format(what, len(seq), diff, TOL))
            check(float(numpy.abs(ours).max()) > 1.0, "{}: logits too small to test anything".format(what))
    return model
