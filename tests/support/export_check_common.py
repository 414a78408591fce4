"""What the Megatron export checks share (check_mla_export_with_megatron_core.py,
check_mtp_export_with_megatron_core.py, check_moe_export_with_megatron_core.py): the failures list and the check
that prints and records each result, a command run to its end, ptk's logits by logits_tool, and a megatron-core
model's state_dict entries.
"""
import os
import subprocess

failures = []


def check(cond, what):
    print(("ok: " if cond else "FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args):
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise SystemExit("{} failed:\n{}".format(" ".join(args), r.stdout[-3000:]))
    return r.stdout


def ptk_logits(numpy, test_bin, ck, tmp, seqs, vocab):
    """ptk's logits (test_bin/logits_tool on the checkpoint `ck`) of each of `seqs`: (len, vocab) float32 arrays."""
    seq_file, out = os.path.join(tmp, "seqs.txt"), os.path.join(tmp, "logits.f32")
    with open(seq_file, "w") as f:
        for s in seqs:
            f.write(" ".join(map(str, s)) + "\n")
    run([os.path.join(test_bin, "logits_tool"), ck, seq_file, out])
    flat, res, at = numpy.fromfile(out, dtype=numpy.float32), [], 0
    for s in seqs:
        res.append(flat[at:at + len(s) * vocab].reshape(len(s), vocab))
        at += len(s) * vocab
    return res


def names_of(gpt):
    """state_dict's entries in order: (kind, name, shape), kind param, buffer or extra."""
    params = dict(gpt.named_parameters())
    buffers = dict(gpt.named_buffers())
    out = []
    for n, v in gpt.state_dict(keep_vars=True).items():
        kind = "param" if n in params else "buffer" if n in buffers else "extra"
        shape = "x".join(str(d) for d in v.shape) if kind != "extra" else "-"
        out.append((kind, n, shape or "scalar"))
    return out
