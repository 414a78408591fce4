"""ptk-convert --loader megatron on Megatron's torch_dist checkpoints (PyTorch's distributed checkpoint).

The checkpoints under tests/data/torch_dist/ were written by PyTorch 2.5's own torch.distributed.checkpoint
(tests/support/make_torch_dist_fixture.py: megatron-core's sharded keys, layers stacked, chunks per layer and
tensor-parallel rank); each expected.json records the SHA-256 of every merged tensor. The ptk
checkpoint ptk-convert writes must hold each weight (the fp32 masters of the --bf16 one) and AdamW
moment bit for bit, and the iteration, consumed samples and Adam step. Damaged copies (a .distcp
missing, truncated, a flipped byte, a key the model has not, args that do not match the tensors) are
refused with one line naming the file and key or byte offset, exit non-zero, and nothing is written.

The checkpoints under tests/data/torch_dist_distopt/ were written by megatron-core itself
(tests/support/make_torch_dist_distopt_fixture.py): its DistributedOptimizer's state in each sharding format
(dp_zero_gather_scatter, fully_sharded_model_space, fully_reshardable, dp_reshardable; and dp_reshardable of a
--bf16 run, whose weights are the fp32 main params, not the bf16 copies); the fp32 params and
AdamW moments must be megatron-core's bit for bit, and ptk-train resuming from them must take one AdamW step
from those moments and that step count.

Usage: megatron_torch_dist_test.py BIN_DIR
"""
import hashlib
import json
import os
import shutil
import sys
import tempfile

import numpy

from megatron_test_common import BIN, check, convert, finish, ptk_tensor, read_ptk, run

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "torch_dist")
DISTOPT = os.path.join(HERE, "..", "data", "torch_dist_distopt")
DISTOPT_FORMATS = ("dp_zero_gather_scatter", "fully_sharded_model_space", "fully_reshardable", "dp_reshardable",
                   "dp_reshardable_bf16")


def converts_bit_for_bit(tmp, name, data=DATA):
    save = os.path.join(tmp, name + "-ptk")
    p = convert("megatron", "ptk", os.path.join(data, name), save, ok=False)
    check(p.returncode == 0, f"{name}: converts ({p.returncode}: {p.stderr.strip()})")
    if p.returncode != 0:
        return
    exp = json.load(open(os.path.join(data, name, "expected.json")))
    h, arr = read_ptk(save)
    check(h["iteration"] == exp["iteration"], f"{name}: iteration {h['iteration']}")
    check(h["adam_step"] == exp["adam_step"], f"{name}: adam step {h['adam_step']} (want {exp['adam_step']})")
    batch = 2 if data == DISTOPT else 8
    check(h["consumed_train_samples"] == batch * exp["iteration"], f"{name}: consumed samples")
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
    return save


def refused(tmp, label, mutate, *needles, src=os.path.join(DATA, "te_untied_fp32")):
    """A copy damaged by `mutate(iter_dir)`: one line naming what, exit non-zero, nothing written."""
    ck = os.path.join(tmp, label)
    shutil.copytree(src, ck)
    mutate(os.path.join(ck, [d for d in os.listdir(ck) if d.startswith("iter_")][0]))
    save = os.path.join(tmp, label + "-ptk")
    p = convert("megatron", "ptk", ck, save, ok=False)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    check(p.returncode != 0, f"{label}: exit {p.returncode}")
    check(len(lines) == 1, f"{label}: one line, got {lines}")
    for n in needles:
        check(n in p.stderr, f"{label}: {n!r} in {p.stderr.strip()!r}")
    check(not os.path.exists(save) or not os.listdir(save), f"{label}: nothing written in {save}")
    print(f"{label}: {p.stderr.strip()}")


def replace_bytes(path, old, new):
    data = open(path, "rb").read()
    assert old in data, (path, old)
    open(path, "wb").write(data.replace(old, new))


def resumes_with_the_moments(tmp, name, ptk):
    """ptk-train resumes the converted checkpoint for one iteration: its new weights and moments are one
    torch.optim.AdamW step (at step adam_step + 1) from the saved ones, for the gradient the new exp_avg
    implies (g = (m' - beta1 m) / (1 - beta1)). Moments restarted at zero, or the step count restarted,
    would not fit (the same check against zero moments is shown to fail)."""
    exp = json.load(open(os.path.join(DISTOPT, name, "expected.json")))
    b1, b2 = exp["betas"]
    lr, wd, eps, step = exp["lr"], exp["weight_decay"], exp["eps"], exp["adam_step"] + 1
    out = os.path.join(tmp, name + "-resumed")
    p = run(os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
            "--ffn-hidden-size", "64", "--max-position-embeddings", "16", "--seq-length", "8",
            "--untie-embeddings-and-output-weights", "--vocab-size", "50", "--make-vocab-size-divisible-by", "8",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", str(exp["iteration"] + 1),
            "--lr", str(lr), "--min-lr", str(lr), "--lr-decay-style", "constant", "--weight-decay", str(wd),
            "--adam-beta1", str(b1), "--adam-beta2", str(b2), "--adam-eps", str(eps), "--mock-data",
            "--eval-iters", "0", "--log-interval", "1", "--threads", "1", "--load", ptk, "--save", out,
            # The fixture's schedule spans 100 iterations (Megatron's resume checks every value of it).
            "--use-checkpoint-opt_param-scheduler", ok=False)
    check(p.returncode == 0, f"{name}: ptk-train resumes ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    if p.returncode != 0:
        return
    h0, a0 = read_ptk(ptk)
    h1, a1 = read_ptk(out)
    check(h1["iteration"] == exp["iteration"] + 1 and h1["adam_step"] == step,
          f"{name}: resumed at iteration {h1['iteration']}, Adam step {h1['adam_step']} (want {step})")
    worst, worst_if_zero = 0.0, float("inf")
    for t in h0["tensors"]:
        p0, m0, v0 = (ptk_tensor(h0, a0, w, t["name"]).astype(numpy.float64) for w in range(3))
        p1, m1, v1 = (ptk_tensor(h1, a1, w, t["name"]).astype(numpy.float64) for w in range(3))
        decay = wd if len(t["shape"]) > 1 else 0.0  # Megatron's and ptk's: no decay on biases and norms
        scale = numpy.abs(v1).max() + 1e-30
        for m_prev, v_prev, zero in ((m0, v0, False), (0 * m0, 0 * v0, True)):
            g = (m1 - b1 * m_prev) / (1 - b1)
            v_err = numpy.abs(b2 * v_prev + (1 - b2) * g * g - v1).max() / scale
            p_want = p0 * (1 - lr * decay) - lr * (m1 / (1 - b1 ** step)) / (numpy.sqrt(v1 / (1 - b2 ** step)) + eps)
            p_err = numpy.abs(p_want - p1).max() / lr  # in units of the step's size
            if zero:
                worst_if_zero = min(worst_if_zero, v_err)
            else:
                worst = max(worst, v_err, p_err)
    print(f"{name}: resumed one step: worst relative error {worst:.2e} (against zero moments: {worst_if_zero:.2e})")
    check(worst < 1e-3, f"{name}: the resumed step is AdamW's from the saved moments and step (error {worst:.2e})")
    check(worst_if_zero > 1e-2, f"{name}: zero moments would not fit ({worst_if_zero:.2e})")


def distributed_optimizer(tmp):
    """megatron-core's DistributedOptimizer in torch_dist (tests/support/make_torch_dist_distopt_fixture.py: a
    tiny GPT stepped 3 times by megatron-core itself, saved in each of its sharding formats): the fp32
    params, exp_avg and exp_avg_sq bit for bit as megatron-core held them, Adam's step carried, and a
    resumed run continuing them; a layout ptk does not read refused naming the key and the format."""
    for name in DISTOPT_FORMATS:
        ptk = converts_bit_for_bit(tmp, name, DISTOPT)
        if ptk and name in ("dp_zero_gather_scatter", "fully_sharded_model_space"):
            resumes_with_the_moments(tmp, name, ptk)
    bucket = b"bucket_idx_0.exp_avg_sq"
    refused(tmp, "dp_reshardable-unknown-state",
            lambda d: replace_bytes(os.path.join(d, ".metadata"), bucket, b"bucket_idx_0.exp_avg_sx"),
            ".metadata", "bucket_idx_0.exp_avg_sx", "a layout ptk does not read", '"dp_reshardable"',
            src=os.path.join(DISTOPT, "dp_reshardable"))
    def pipeline_parallel(d):
        import torch  # Debian's PyTorch reads and rewrites common.pt
        f = os.path.join(d, "common.pt")
        common = torch.load(f)
        common["args"].pipeline_model_parallel_size = 2
        torch.save(common, f)
    # Args of two pipeline stages beside one stage's grad buffer: stage 0's layout does not hold it.
    refused(tmp, "dp_reshardable-args-pipeline-parallel", pipeline_parallel, ".metadata",
            "model-parallel rank 0 (tensor rank 0, pipeline rank 0: optimizer.distributed.dp_group_idx_0.gbuf_idx_0)",
            "laid out as megatron-core lays them", '"dp_reshardable"', src=os.path.join(DISTOPT, "dp_reshardable"))
    refused(tmp, "dp_zero_gather_scatter-args-pipeline-parallel", pipeline_parallel, ".metadata",
            "object optimizer.distributed.dp_group_idx_0.param_state", "laid out as megatron-core lays them",
            src=os.path.join(DISTOPT, "dp_zero_gather_scatter"))
    key = b"optimizer.state.exp_avg_sq.output_layer.weight"
    refused(tmp, "model-space-state-missing",
            lambda d: replace_bytes(os.path.join(d, ".metadata"), key, key.replace(b"exp_avg_sq", b"exp_avg_sx")),
            ".metadata", "optimizer.state.exp_avg_sq.output_layer.weight: missing", '"fully_sharded_model_space"',
            src=os.path.join(DISTOPT, "fully_sharded_model_space"))
    refused(tmp, "dp_zero-groups-missing",
            lambda d: replace_bytes(os.path.join(d, ".metadata"), b"dp_group_idx_0.optimizer/", b"dp_group_idx_0.optimizxr/"),
            ".metadata", "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1", "Adam's step",
            src=os.path.join(DISTOPT, "dp_zero_gather_scatter"))


def main():
    with tempfile.TemporaryDirectory() as tmp:
        converts_bit_for_bit(tmp, "te_untied_fp32")
        converts_bit_for_bit(tmp, "local_tied_bf16")
        distributed_optimizer(tmp)

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

    finish("ok")


if __name__ == "__main__":
    main()
