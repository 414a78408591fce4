"""ptk-convert and Megatron checkpoints of interleaved (virtual pipeline) runs.

Megatron's save_checkpoint keeps each model chunk's state dict under model0, model1, ... in every
mp_rank file, each chunk's layers numbered from 0; chunk v of pipeline stage p holds global layers
from v * L / V + p * L / (P * V) (megatron-core's get_transformer_layer_offset), and the optimizer's
groups list the chunks' parameters one chunk after the other. megatron-core's model code cannot run
on this machine's torch, so the inputs are written by tests/support/gen_megatron_checkpoint.py --vp V
(torch.save, a real torch Adam over the chunks' parameters, the merged tensors in reference.pt).

Checked: the import is bit for bit the reference (weights or fp32 masters, AdamW moments); the
saver's --target-num-layers-per-virtual-pipeline-stage writes, at the generator's layout, the
generator's tensors and optimizer state bit for bit with Megatron's args; ptk -> megatron (V = 2)
-> ptk is bit for bit; what does not fit is refused in one line, nothing written.

The distributed optimizer (--distributed-optimizer): distrib_optim.pt holds one grad buffer per model
chunk (keys 0 .. V-1, each chunk laid out alone, only chunk 0 bucketed); the import takes its fp32
params and moments bit for bit, a chunk's buffer of another size or missing refused in one line;
--target-use-distributed-optimizer writes the same format, and ptk -> megatron (distributed
optimizer, V = 2) -> ptk is bit for bit, moments included.

Usage: megatron_vpp_test.py BIN_DIR
"""
import argparse
import os
import sys
import tempfile

import torch

from megatron_test_common import check, convert, finish, ptk_tensor, read_ptk, run, same_bits

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "support", "gen_megatron_checkpoint.py")


def gen(out, *flags):
    run(sys.executable, GEN, out, *flags)


def load(path):
    return torch.load(path, weights_only=False)


def imports_bit_for_bit(tmp, label, flags, ptk_rows=56):
    meg = os.path.join(tmp, label + "-meg")
    ptk = os.path.join(tmp, label + "-ptk")
    gen(meg, *flags)
    p = convert("megatron", "ptk", meg, ptk)
    check("model chunks each (interleaved)" in p.stderr, f"{label}: the summary names the chunks:\n{p.stderr}")
    ref = load(os.path.join(meg, "reference.pt"))
    h, arr = read_ptk(ptk)
    check(h["iteration"] == 20 and h["adam_step"] == 2, f"{label}: iteration and Adam step carried")
    for which, key in ((0, "weight"), (1, "exp_avg"), (2, "exp_avg_sq")):
        for name, full in ref[key].items():
            want = full.numpy()
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                want = want[:ptk_rows]
            check(same_bits(ptk_tensor(h, arr, which, name), want), f"{label}: {key} of {name} bit for bit")
    return meg, ptk


def rank_files(meg):
    it = int(open(os.path.join(meg, "latest_checkpointed_iteration.txt")).read())
    d = os.path.join(meg, f"iter_{it:07d}")
    return {r: os.path.join(d, r, "model_optim_rng.pt") for r in sorted(os.listdir(d))}


def refused(tmp, label, load_dir, needles, loader="megatron", saver="ptk", flags=(), rc=None):
    save = os.path.join(tmp, label + "-out")
    p = convert(loader, saver, load_dir, save, *flags, "--make-vocab-size-divisible-by", "8", ok=False)
    lines = [x for x in p.stderr.splitlines() if x.strip() and not x.startswith("Run with --help")]
    check(p.returncode != 0 and (rc is None or p.returncode == rc), f"{label}: refused (exit {p.returncode})")
    check(len(lines) == 1 and all(n in p.stderr for n in needles), f"{label}: one line naming {needles}:\n{p.stderr}")
    written = [] if not os.path.isdir(save) else [x for x in os.listdir(save) if not x.startswith("ptk-")]
    check(not written, f"{label}: nothing written ({written})")


def real_rows(key, t, x, vocab=50):
    """x without the rows beyond the vocabulary's 50 tokens (a vocabulary shard of rank t): the
    generator pads with random rows, ptk with copies of the last token's and zero moments."""
    if not key.endswith(("word_embeddings.weight", "output_layer.weight")):
        return x
    first = t * x.shape[0]
    return x[:max(0, min(x.shape[0], vocab - first))]


def distributed_optimizer(tmp):
    """The distributed optimizer's distrib_optim.pt of interleaved runs, read and written."""
    # TP 2 x PP 2 x 2 chunks, tied (the shared embedding's own buckets), chunk 0 of stage 0 in buckets of 300.
    meg, ptk = imports_bit_for_bit(tmp, "distopt-te", ["--tp", "2", "--pp", "2", "--vp", "2", "--layers", "4",
                                                       "--distributed-optimizer", "--ddp-bucket-size", "300"])
    # Local names, untied, --bf16 (the fp32 params are distrib_optim.pt's), 2 layers a chunk.
    imports_bit_for_bit(tmp, "distopt-local", ["--pp", "2", "--vp", "2", "--layers", "8", "--impl", "local",
                                               "--untie", "--bf16", "--distributed-optimizer"])
    # Refused in one line: chunk 1's buffer of another size, or missing; a buffer beyond the chunks.
    for label, change, needles in (
            ("distopt-numel", lambda d: d[1][next(iter(d[1]))].update(numel_unpadded=7),
             ["distrib_optim.pt: grad buffer 1 (model chunk 1) holds 7 elements"]),
            ("distopt-no-chunk1", lambda d: d.pop(1), ["grad buffer 1 (model chunk 1): missing", "2 model chunks"]),
            ("distopt-buffer2", lambda d: d.update({2: d[1]}), ["grad buffer 2: more than the 2 model chunks'"])):
        bad = os.path.join(tmp, label)
        run("cp", "-r", meg, bad)
        f = os.path.join(os.path.dirname(rank_files(bad)["mp_rank_01_001"]), "distrib_optim.pt")
        d = load(f)
        change(d)
        torch.save(d, f)
        refused(tmp, label, bad, ["mp_rank_01_001"] + needles)

    # ptk -> megatron with --target-use-distributed-optimizer: Megatron's format, and back bit for bit.
    for label, flags in (("vp", ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                                 "--target-num-layers-per-virtual-pipeline-stage", "1"]),
                         ("pp", ["--target-pipeline-parallel-size", "2", "--saver-transformer-impl", "local"])):
        out, back = os.path.join(tmp, f"distopt-{label}-out"), os.path.join(tmp, f"distopt-{label}-back")
        p = convert("ptk", "megatron", ptk, out, *flags, "--target-use-distributed-optimizer",
                    "--make-vocab-size-divisible-by", "8")
        check("--use-distributed-optimizer" in p.stderr, f"{label}: the summary names Megatron's flag:\n{p.stderr}")
        chunks = 2 if label == "vp" else 1
        for rank, f in rank_files(out).items():
            got = load(f)
            check(got["args"].use_distributed_optimizer is True, f"{label} {rank}: args.use_distributed_optimizer")
            opt = got["optimizer"]
            check(set(opt) == {"optimizer"} and set(opt["optimizer"]) == {"param_groups"} and
                  all("params" not in g and g["step"] == 2 for g in opt["optimizer"]["param_groups"]) and
                  [g["wd_mult"] for g in opt["optimizer"]["param_groups"]] == [1.0, 0.0],
                  f"{label} {rank}: DistributedOptimizer.state_dict's groups (no params, Adam's step): {opt}")
            d = load(os.path.join(os.path.dirname(f), "distrib_optim.pt"))
            check(set(d) == {"buckets_coalesced", *range(chunks)} and d["buckets_coalesced"] is True,
                  f"{label} {rank}: a grad buffer per model chunk ({list(d)})")
            for v in range(chunks):
                (key, st), = d[v].items()
                check(key == (torch.float32, torch.float32) and set(st) == {"param", "exp_avg", "exp_avg_sq",
                                                                           "numel_unpadded"} and
                      all(st[k].dtype == torch.float32 and st[k].shape == (st["numel_unpadded"],)
                          for k in ("param", "exp_avg", "exp_avg_sq")),
                      f"{label} {rank}: buffer {v} as save_parameter_state writes it")
        convert("megatron", "ptk", out, back)
        h, arr = read_ptk(ptk)
        h2, arr2 = read_ptk(back)
        check(arr2.tobytes() == arr.tobytes() and h2["tensors"] == h["tensors"] and
              h2["adam_step"] == h["adam_step"] == 2,
              f"ptk -> megatron (distributed optimizer, {label}) -> ptk bit for bit, moments included")
    # At the generator's layout (TP 2 x PP 2 x 2 chunks, one bucket), the generator's distrib_optim.pt
    # (save_parameter_state's layout) bit for bit but for the vocabulary's padding rows.
    ref = os.path.join(tmp, "distopt-ref")
    gen(ref, "--tp", "2", "--pp", "2", "--vp", "2", "--layers", "4", "--distributed-optimizer")
    out = os.path.join(tmp, "distopt-vp-out")
    for rank, f in rank_files(ref).items():
        want = load(os.path.join(os.path.dirname(f), "distrib_optim.pt"))
        got = load(os.path.join(os.path.dirname(rank_files(out)[rank]), "distrib_optim.pt"))
        for v in range(2):
            (_, w), = want[v].items()
            (_, g), = got[v].items()
            # The vocabulary's rows beyond ptk's 56 (rows 56..63, tensor rank 1's last 8 of 16 columns) are
            # the generator's random ones, the export's copies of the last token's row with zero moments.
            vocab = (rank == "mp_rank_01_000" and v == 0) or (rank == "mp_rank_01_001" and v == 1)
            same = w["numel_unpadded"] == g["numel_unpadded"]
            for k in ("param", "exp_avg", "exp_avg_sq"):
                same = same and int((w[k] != g[k]).sum()) == (8 * 16 if vocab else 0)
            check(same, f"{rank} buffer {v}: the generator's layout and values")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        distributed_optimizer(tmp)
        # TP 2 x PP 2 x 2 chunks, Transformer Engine names, tied embeddings (the last chunk's copy).
        meg, ptk = imports_bit_for_bit(tmp, "te", ["--tp", "2", "--pp", "2", "--vp", "2", "--layers", "4"])
        # Local names, untied, --bf16 (the fp32 masters), 2 layers a chunk (layer 5 is stage 0's chunk 1's layer 1).
        imports_bit_for_bit(tmp, "local", ["--pp", "2", "--vp", "2", "--layers", "8", "--impl", "local", "--untie",
                                           "--bf16"])

        # ptk -> megatron at the generator's layout: its files' tensors and optimizer state bit for bit.
        out = os.path.join(tmp, "te-out")
        p = convert("ptk", "megatron", ptk, out, "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "2", "--target-num-layers-per-virtual-pipeline-stage", "1",
                    "--make-vocab-size-divisible-by", "8")
        check("2 model chunks each" in p.stderr, f"the saver's summary names the chunks:\n{p.stderr}")
        want_files, got_files = rank_files(meg), rank_files(out)
        check(list(want_files) == list(got_files), f"the same rank files ({list(got_files)})")
        for rank, f in got_files.items():
            got, want = load(f), load(want_files[rank])
            check("model" not in got and "model2" not in got, f"{rank}: model0 and model1 only")
            a = got["args"]
            check(a.virtual_pipeline_model_parallel_size == 2 and a.num_layers_per_virtual_pipeline_stage == 1 and
                  a.pipeline_model_parallel_size == 2 and a.tensor_model_parallel_size == 2, f"{rank}: Megatron's args")
            for v in range(2):
                gm, wm = got[f"model{v}"], want[f"model{v}"]
                gt = {k: x for k, x in gm.items() if not k.endswith("_extra_state")}
                wt = {k: x for k, x in wm.items() if not k.endswith("_extra_state")}
                check(list(gt) == list(wt), f"{rank} model{v}: megatron-core's names in order ({list(gt)})")
                for k in wt:
                    t = int(rank[8:10])
                    check(k in gt and torch.equal(real_rows(k, t, gt[k]), real_rows(k, t, wt[k])),
                          f"{rank} model{v}: {k} bit for bit")
                check(sorted(k for k in gm if k.endswith("_extra_state")) ==
                      sorted(k for k in wm if k.endswith("_extra_state")), f"{rank} model{v}: the extra states")
            go, wo = got["optimizer"], want["optimizer"]
            check([g["params"] for g in go["param_groups"]] == [g["params"] for g in wo["param_groups"]],
                  f"{rank}: the optimizer's groups (chunk after chunk)")
            names = [(v, k) for v in range(2) for k in want[f"model{v}"] if not k.endswith("_extra_state")]
            ids = [i for g in wo["param_groups"] for i in g["params"]]
            decay = [n for n in names if want[f"model{n[0]}"][n[1]].dim() > 1]
            by_id = dict(zip(ids, decay + [n for n in names if n not in decay]))
            for i, st in wo["state"].items():
                k, t = by_id[i][1], int(rank[8:10])
                check(all(torch.equal(real_rows(k, t, go["state"][i][x]), real_rows(k, t, st[x]))
                          for x in ("exp_avg", "exp_avg_sq")), f"{rank}: AdamW state {i} ({by_id[i]}) bit for bit")
        # ... and back: ptk -> megatron (V = 2) -> ptk bit for bit.
        back = os.path.join(tmp, "te-back")
        convert("megatron", "ptk", out, back)
        h, arr = read_ptk(ptk)
        h2, arr2 = read_ptk(back)
        check(arr2.tobytes() == arr.tobytes() and h2["tensors"] == h["tensors"] and h2["iteration"] == h["iteration"],
              "ptk -> megatron (V = 2) -> ptk bit for bit")
        # Another layout: TP 1 x PP 2 x 2 chunks of 1 layer (V = 2), local names.
        out2, back2 = os.path.join(tmp, "local-out"), os.path.join(tmp, "local-back")
        convert("ptk", "megatron", ptk, out2, "--target-pipeline-parallel-size", "2",
                "--target-num-layers-per-virtual-pipeline-stage", "1", "--saver-transformer-impl", "local",
                "--make-vocab-size-divisible-by", "8")
        stage1 = load(rank_files(out2)["mp_rank_00_001"])
        ref = load(os.path.join(meg, "reference.pt"))["weight"]
        # Stage 1's chunk 1 is virtual stage 3: global layer 3, its layer 0.
        check(torch.equal(stage1["model1"]["decoder.layers.0.mlp.linear_fc2.weight"],
                          ref["decoder.layers.3.mlp.linear_fc2.weight"]), "stage 1's chunk 1 holds layer 3")
        convert("megatron", "ptk", out2, back2)
        h3, arr3 = read_ptk(back2)
        check(arr3.tobytes() == arr.tobytes(), "ptk -> megatron (TP 1, V = 2, local) -> ptk bit for bit")

        # Refused in one line: a chunk missing, args that disagree, layers that do not divide.
        files = rank_files(meg)
        for label, change, needles in (
                ("no-model1", lambda d: d.pop("model1"), ["mp_rank_01_001", "model1"]),
                ("vp-3", lambda d: setattr(d["args"], "virtual_pipeline_model_parallel_size", 3),
                 ["model2: missing", "virtual_pipeline_model_parallel_size 3"]),
                ("layers-per-chunk", lambda d: setattr(d["args"], "num_layers_per_virtual_pipeline_stage", 2),
                 ["num_layers_per_virtual_pipeline_stage 2"]),
                ("layers-5", lambda d: setattr(d["args"], "num_layers", 5), ["5 layers do not divide"])):
            bad = os.path.join(tmp, label)
            run("cp", "-r", meg, bad)
            for rank in files if label != "no-model1" else ["mp_rank_01_001"]:
                f = os.path.join(rank_files(bad)[rank])
                d = load(f)
                change(d)
                torch.save(d, f)
            refused(tmp, label, bad, needles)
        refused(tmp, "saver-3", ptk, ["--target-num-layers-per-virtual-pipeline-stage 3"], "ptk", "megatron",
                ["--target-pipeline-parallel-size", "2", "--target-num-layers-per-virtual-pipeline-stage", "3"], rc=2)
        refused(tmp, "saver-pp1", ptk, ["--target-pipeline-parallel-size 2 or more"], "ptk", "megatron",
                ["--target-num-layers-per-virtual-pipeline-stage", "1"], rc=2)
        refused(tmp, "saver-hf", ptk, ["only --saver megatron"], "ptk", "hf",
                ["--target-num-layers-per-virtual-pipeline-stage", "1"], rc=2)
    finish("megatron_vpp_test: interleaved checkpoints read and written bit for bit")


if __name__ == "__main__":
    main()
