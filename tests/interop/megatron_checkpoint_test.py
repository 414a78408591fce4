"""ptk-convert --loader megatron / --saver megatron against PyTorch's own torch.save / torch.load.

Megatron-shaped checkpoints (tests/support/gen_megatron_checkpoint.py: megatron-core's names and
shapes, split over tensor- and pipeline-parallel ranks as Megatron splits them, a real torch Adam's
state) are imported; the ptk checkpoint must hold the merged weights (the fp32 masters of a --bf16
run) and AdamW moments bit for bit. ptk -> megatron at several sizes is read back with torch.load
(names and shapes as megatron-core has them) and imported again: ptk -> megatron -> ptk is bit for
bit on the weights and moments. Damaged inputs are refused with one line naming the file (and the
tensor), exit non-zero, and nothing written.

Usage: megatron_checkpoint_test.py BIN_DIR
"""
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from megatron_test_common import BIN, CONVERT, check, convert, finish, ptk_tensor, read_ptk, run, same_bits

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "support", "gen_megatron_checkpoint.py")


def gen(out, *flags):
    run(sys.executable, GEN, out, *flags)


def import_matches_reference(tmp, label, gen_flags, ptk_vocab_rows):
    meg = os.path.join(tmp, label + "-meg")
    ptk = os.path.join(tmp, label + "-ptk")
    gen(meg, *gen_flags)
    p = convert("megatron", "ptk", meg, ptk)
    ref = torch.load(os.path.join(meg, "reference.pt"))
    h, arr = read_ptk(ptk)
    check(h["iteration"] == 20 and h["consumed_train_samples"] == 160 and h["adam_step"] == 2,
          f"{label}: iteration/consumed samples/adam step carried ({h['iteration']}, {h['consumed_train_samples']}, "
          f"{h['adam_step']})")
    check(h["opt_param_scheduler"]["lr_decay_style"] == "cosine" and h["opt_param_scheduler_num_steps"] == 160,
          f"{label}: the scheduler carried")
    for which, key in ((0, "weight"), (1, "exp_avg"), (2, "exp_avg_sq")):
        for name, full in ref[key].items():
            want = full.numpy()
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                want = want[:ptk_vocab_rows]
            check(same_bits(ptk_tensor(h, arr, which, name), want), f"{label}: {key} of {name} bit for bit")
    return ptk, p


def export_and_check(tmp, label, ptk, tp, pp, impl, h, arr, precision):
    """ptk -> megatron at tp x pp: torch.load reads every shard with megatron-core's names and shapes,
    the shards merge back to ptk's tensors; then megatron -> ptk is bit for bit."""
    meg = os.path.join(tmp, label + "-meg")
    convert("ptk", "megatron", ptk, meg, "--target-tensor-parallel-size", str(tp),
            "--target-pipeline-parallel-size", str(pp), "--saver-transformer-impl", impl,
            "--make-vocab-size-divisible-by", "8")
    it = int(open(os.path.join(meg, "latest_checkpointed_iteration.txt")).read())
    check(it == h["iteration"], f"{label}: the tracker names iteration {h['iteration']}")
    layers = h["model"]["num_layers"]
    per_stage = layers // pp
    hidden = h["model"]["hidden_size"]
    untie = h["model"]["untie_embeddings_and_output_weights"]
    te = impl == "transformer_engine"
    merged = {}
    for p in range(pp):
        for t in range(tp):
            rank = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            sd = torch.load(os.path.join(meg, f"iter_{it:07d}", rank, "model_optim_rng.pt"), map_location="cpu")
            a = sd["args"]
            check(sd["checkpoint_version"] == 3.0 and sd["iteration"] == it, f"{label} {rank}: version, iteration")
            check((a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.num_layers, a.hidden_size) ==
                  (tp, pp, layers, hidden), f"{label} {rank}: args")
            check(a.padded_vocab_size % (8 * tp) == 0, f"{label} {rank}: padded vocabulary a multiple of 8 x TP")
            model = sd["model"]
            names = [k for k in model if not k.endswith("_extra_state")]
            # megatron-core's names for this stage.
            want = []
            if p == 0:
                want += ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
            for layer in range(per_stage):
                q = f"decoder.layers.{layer}."
                ln1 = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias"] \
                    if te else ["input_layernorm.weight", "input_layernorm.bias"]
                ln2 = ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias"] \
                    if te else ["pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"]
                want += [q + n for n in ln1 + ["self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                                               "self_attention.linear_proj.weight", "self_attention.linear_proj.bias"]
                         + ln2 + ["mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
                                  "mlp.linear_fc2.bias"]]
            if p == pp - 1:
                want += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
                if untie or pp > 1:
                    want.append("output_layer.weight")
            check(sorted(names) == sorted(want), f"{label} {rank}: state-dict names {sorted(set(names) ^ set(want))}")
            vp = a.padded_vocab_size
            f = a.ffn_hidden_size
            dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
            check(dtype == precision, f"{label} {rank}: saved as the ptk run trained ({precision}), not {dtype}")
            check(a.params_dtype == dtype, f"{label} {rank}: args.params_dtype {a.params_dtype}")
            for k in names:
                v = model[k]
                check(v.dtype == dtype, f"{label} {rank}: {k} is {dtype}")
                if k.endswith("word_embeddings.weight") or k == "output_layer.weight":
                    shape = (vp // tp, hidden)
                elif k.endswith("position_embeddings.weight"):
                    shape = (a.max_position_embeddings, hidden)
                elif k.endswith("linear_qkv.weight"):
                    shape = (3 * hidden // tp, hidden)
                elif k.endswith("linear_qkv.bias"):
                    shape = (3 * hidden // tp,)
                elif k.endswith("linear_proj.weight"):
                    shape = (hidden, hidden // tp)
                elif k.endswith("linear_fc1.weight"):
                    shape = (f // tp, hidden)
                elif k.endswith("linear_fc1.bias"):
                    shape = (f // tp,)
                elif k.endswith("linear_fc2.weight"):
                    shape = (hidden, f // tp)
                else:
                    shape = (hidden,)
                check(tuple(v.shape) == shape, f"{label} {rank}: {k} shape {tuple(v.shape)}, megatron-core's {shape}")
            # The optimizer: torch Adam's state_dict with Megatron's two groups (wrapped with the fp32
            # masters by group in a bf16/fp16 run, as Float16OptimizerWithFloat16Params saves it).
            opt = sd["optimizer"]
            masters = None
            if dtype != torch.float32:
                masters = opt["fp32_from_fp16_params"]
                opt = opt["optimizer"]
            groups = opt["param_groups"]
            check(len(groups) == 2 and groups[1]["wd_mult"] == 0.0, f"{label} {rank}: two parameter groups")
            params_in_order = [k for k in names]
            decay = [k for k in params_in_order if model[k].dim() > 1]
            no_decay = [k for k in params_in_order if model[k].dim() == 1]
            check(groups[0]["params"] == list(range(len(decay))) and
                  groups[1]["params"] == list(range(len(decay), len(decay) + len(no_decay))),
                  f"{label} {rank}: group indices")
            for idx, k in enumerate(decay + no_decay):
                st = opt["state"][idx]
                check(st["exp_avg"].shape == model[k].shape, f"{label} {rank}: exp_avg of {k}")
                w = model[k]
                if masters is not None:
                    g, pos = (0, idx) if idx < len(decay) else (1, idx - len(decay))
                    w = masters[g][pos]
                    check(w.dtype == torch.float32 and torch.equal(w.to(dtype), model[k]),
                          f"{label} {rank}: the model's {k} is its fp32 master rounded")
                merged.setdefault((p, k), {})[t] = (w, st["exp_avg"], st["exp_avg_sq"], float(st["step"]))
            # A torch Adam over these parameters takes the state as Megatron's loader hands it.
            plist = [torch.nn.Parameter(model[k].float()) for k in decay + no_decay]
            adam = torch.optim.Adam([{"params": plist[:len(decay)]}, {"params": plist[len(decay):]}])
            adam.load_state_dict(opt)
    # The merged shards equal ptk's tensors (the padded rows beyond ptk's are copies of the last token's).
    for t_info in h["tensors"]:
        name = t_info["name"]
        m = __import__("re").match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            layer = int(m.group(1))
            p = layer // per_stage
            rest = m.group(2)
            te_map = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                      "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
                      "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
                      "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
            local = f"decoder.layers.{layer - p * per_stage}." + (te_map.get(rest, rest) if te else rest)
        else:
            p = 0 if name.startswith("embedding.") else pp - 1
            local = name
        pieces = merged[(p, local)]
        dim = 1 if local.endswith("linear_proj.weight") or local.endswith("linear_fc2.weight") else 0
        split = (dim == 1 or local.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight",
                                             "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")))
        for which in range(3):
            full = torch.cat([pieces[t][which] for t in range(tp)], dim=dim) if split else pieces[0][which]
            rows = t_info["shape"][0]
            check(same_bits(full.numpy()[:rows], ptk_tensor(h, arr, which, name)),
                  f"{label}: merged {['weight', 'exp_avg', 'exp_avg_sq'][which]} of {name} equals ptk's")
        check(pieces[0][3] == h["adam_step"], f"{label}: Adam step {pieces[0][3]}")
    # megatron -> ptk again: bit for bit.
    back = os.path.join(tmp, label + "-back")
    convert("megatron", "ptk", meg, back)
    h2, arr2 = read_ptk(back)
    check(arr2.tobytes() == arr.tobytes(), f"{label}: ptk -> megatron -> ptk bit for bit (weights and moments)")
    check(h2["tensors"] == h["tensors"] and h2["iteration"] == h["iteration"] and
          h2["consumed_train_samples"] == h["consumed_train_samples"] and h2["adam_step"] == h["adam_step"],
          f"{label}: the round trip keeps the layout, iteration, samples and Adam step")
    return meg


def megatron_core_names():
    """Where megatron-core's source is installed (scripts/install-deps.sh --with-python-ref: PyPI
    megatron-core, whose model code needs a newer torch than Debian's and so is read, not imported):
    its local GPT layer spec's map from local names to Transformer Engine's fused-LayerNorm names,
    which the loader and saver must use."""
    import re
    for root in [p for p in os.environ.get("PYTHONPATH", "").split(":") if p] + ["/opt/ptk-pyref"]:
        spec = os.path.join(root, "megatron", "core", "models", "gpt", "gpt_layer_specs.py")
        if os.path.exists(spec):
            text = open(spec).read()
            for m in re.finditer(r"sharded_state_dict_keys_map=\{([^}]*)\}", text):
                pairs = dict(re.findall(r'"([\w.]+)":\s*"([\w.]+)"', m.group(1)))
                if "input_layernorm." in pairs:
                    return pairs
    return None


def expect_refusal(tmp, label, load, *needles):
    save = os.path.join(tmp, label + "-refused")
    p = convert("megatron", "ptk", load, save, ok=False)
    err = p.stderr.strip()
    check(p.returncode != 0, f"{label}: exit non-zero ({p.returncode})")
    check(len(err.splitlines()) == 1, f"{label}: one line on stderr: {err!r}")
    for n in needles:
        check(n in err, f"{label}: the error names {n!r}: {err!r}")
    written = [] if not os.path.isdir(save) else [x for x in os.listdir(save) if not x.startswith("ptk-train")]
    check(written == [], f"{label}: nothing written ({written})")


def main():
    tmp = tempfile.mkdtemp(prefix="ptk-megatron-")
    keys_map = megatron_core_names()
    if keys_map is None:
        print("megatron-core not installed: its layer-name map not checked")
    else:
        check(keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                           "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
              f"megatron-core's local -> Transformer Engine name map is the one ptk uses: {keys_map}")
    try:
        # Megatron -> ptk, from several layouts (vocabulary 50 padded to 8 x TP; ptk pads to 56).
        ptk1, _ = import_matches_reference(tmp, "t1p1-te", ["--tp", "1", "--pp", "1"], 56)
        ptk22, p22 = import_matches_reference(tmp, "t2p2-te-bf16", ["--tp", "2", "--pp", "2", "--bf16"], 56)
        check("copy of the tied embedding" not in p22.stderr, f"equal tied copies: no warning: {p22.stderr}")
        ptk21, _ = import_matches_reference(tmp, "t2p1-local-untied",
                                            ["--tp", "2", "--pp", "1", "--impl", "local", "--untie"], 56)
        ptk12, _ = import_matches_reference(tmp, "t1p2-te-untied", ["--tp", "1", "--pp", "2", "--untie", "--layers",
                                                                      "4"], 56)
        # Megatron's distributed optimizer: model_optim_rng.pt keeps the param groups and Adam's step,
        # distrib_optim.pt the fp32 params and moments in megatron-core's grad-buffer order (reverse
        # parameter order, starts padded to 64 elements, buckets). Bit for bit: one bucket, several
        # (--ddp-bucket-size 1000 with --overlap-grad-reduce), a tied embedding shared across pipeline
        # stages (its own bucket), a --bf16 run whose model holds bf16 copies.
        import_matches_reference(tmp, "distopt-t2", ["--tp", "2", "--distributed-optimizer"], 56)
        import_matches_reference(tmp, "distopt-buckets", ["--tp", "1", "--pp", "2", "--layers", "4",
                                                          "--distributed-optimizer", "--ddp-bucket-size", "1000"], 56)
        _, p = import_matches_reference(tmp, "distopt-bf16", ["--tp", "2", "--pp", "2", "--bf16",
                                                              "--distributed-optimizer", "--ddp-bucket-size", "700"],
                                        56)
        check("distrib_optim.pt" in p.stderr, f"a note names distrib_optim.pt: {p.stderr}")
        # A distrib_optim.pt whose buffer does not fit the model (another bucket size) is refused naming it.
        meg = os.path.join(tmp, "distopt-bad")
        gen(meg, "--tp", "1", "--distributed-optimizer")
        rank0 = os.path.join(meg, "iter_0000020", "mp_rank_00", "model_optim_rng.pt")
        sd = torch.load(rank0)
        sd["args"].ddp_bucket_size, sd["args"].overlap_grad_reduce = 16, True  # a bucket per parameter: no padding
        torch.save(sd, rank0)
        p = convert("megatron", "ptk", meg, os.path.join(tmp, "distopt-bad-ptk"), ok=False)
        check(p.returncode != 0 and "distrib_optim.pt: grad buffer 0 holds" in p.stderr and
              "bucket size 16" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
              f"a distrib_optim.pt of another layout refused in one line: {p.returncode} {p.stderr}")
        check(not os.path.exists(os.path.join(tmp, "distopt-bad-ptk", "latest_checkpointed_iteration.txt")),
              "nothing written for a refused distrib_optim.pt")
        # Without distrib_optim.pt (a copy that lost it), the weights come and the moments start at zero.
        meg = os.path.join(tmp, "dist-meg")
        gen(meg, "--tp", "2", "--distributed-optimizer")
        for t in range(2):
            os.remove(os.path.join(meg, "iter_0000020", f"mp_rank_{t:02d}", "distrib_optim.pt"))
        p = convert("megatron", "ptk", meg, os.path.join(tmp, "dist-ptk"))
        check("distrib_optim.pt" in p.stderr + p.stdout, f"a note names distrib_optim.pt: {p.stderr}")
        h, arr = read_ptk(os.path.join(tmp, "dist-ptk"))
        ref = torch.load(os.path.join(meg, "reference.pt"))
        w = ref["weight"]["decoder.layers.1.mlp.linear_fc1.weight"].numpy()
        check(same_bits(ptk_tensor(h, arr, 0, "decoder.layers.1.mlp.linear_fc1.weight"), w),
              "distributed optimizer without distrib_optim.pt: the weights bit for bit")
        check(not arr[1:].any() and h["adam_step"] == 0, "distributed optimizer: zero moments, Adam step 0")
        # A tied embedding's copy on the last pipeline stage that differs from stage 0's (which Megatron
        # keeps equal) was taken silently: ptk's tied model has one tensor, stage 0's. Megatron's loader
        # takes each copy as it is, so the import goes on with a warning naming both tensors and the first
        # element that differs (in the full, tensor-parallel-gathered table).
        meg = os.path.join(tmp, "tied-differs")
        gen(meg, "--tp", "2", "--pp", "2")
        last = os.path.join(meg, "iter_0000020", "mp_rank_01_001", "model_optim_rng.pt")
        sd = torch.load(last)
        rows = sd["model"]["output_layer.weight"].shape[0]
        sd["model"]["output_layer.weight"][3, 5] += 1.0
        torch.save(sd, last)
        p = convert("megatron", "ptk", meg, os.path.join(tmp, "tied-differs-ptk"))
        first = os.path.join(meg, "iter_0000020", "mp_rank_01_000", "model_optim_rng.pt")
        check(f"{last}: output_layer.weight (the last stage's copy of the tied embedding) differs from "
              f"embedding.word_embeddings.weight in {first} at [{rows + 3}, 5]" in p.stderr,
              f"a tied copy that differs is warned naming both tensors and the element: {p.stderr}")
        h, arr = read_ptk(os.path.join(tmp, "tied-differs-ptk"))
        ref = torch.load(os.path.join(meg, "reference.pt"))
        check(same_bits(ptk_tensor(h, arr, 0, "embedding.word_embeddings.weight"),
                        ref["weight"]["embedding.word_embeddings.weight"].numpy()[:56]),
              "a tied copy that differs: stage 0's embedding is taken")
        # ptk-train resumes the imported checkpoint where Megatron stopped (iteration 20, 160 samples).
        resumed = os.path.join(tmp, "resumed")
        p = run(os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads",
                "4", "--seq-length", "8", "--max-position-embeddings", "16", "--vocab-size", "50",
                "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2", "--global-batch-size", "8",
                "--train-iters", "22", "--lr", "3e-4", "--mock-data", "--eval-iters", "0", "--log-interval", "1",
                "--use-checkpoint-opt_param-scheduler", "--threads", "1", "--load", ptk1, "--save", resumed, ok=False)
        check(p.returncode == 0 and " 21/" in p.stdout + p.stderr and " 20/" not in p.stdout + p.stderr,
              f"ptk-train resumes the imported checkpoint at iteration 21:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        # A run of Megatron's with --decoupled-lr: its rates (its args', which its optimizer's groups hold and its
        # resume loads back) are the imported schedule's, so a resume checks this command line's against them and
        # --use-checkpoint-opt_param-scheduler goes on with them (they were dropped: "none (--lr's)").
        meg = os.path.join(tmp, "decoupled-meg")
        gen(meg, "--tp", "1", "--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-4")
        ptk_dec = os.path.join(tmp, "decoupled-ptk")
        convert("megatron", "ptk", meg, ptk_dec)
        hd, _ = read_ptk(ptk_dec)
        sched = hd["opt_param_scheduler"]
        check(sched.get("decoupled_lr") == 1e-3 and sched.get("decoupled_min_lr") == 1e-4,
              f"--decoupled-lr's rates imported with the schedule: {sched}")
        train = [os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads",
                 "4", "--seq-length", "8", "--max-position-embeddings", "16", "--vocab-size", "50",
                 "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2", "--global-batch-size", "8",
                 "--train-iters", "100", "--exit-interval", "21", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
                 "--lr-warmup-iters", "10", "--lr-decay-iters", "100", "--weight-decay", "0.1", "--mock-data",
                 "--eval-iters", "0", "--threads", "1", "--load", ptk_dec]
        p = run(*train, "--decoupled-lr", "2e-3", "--decoupled-min-lr", "1e-4", ok=False)
        check(p.returncode == 2 and "decoupled learning rate (embedding and output layer) (--decoupled-lr): 0.002 "
              "here, 0.001 in the checkpoint" in p.stdout + p.stderr,
              f"another --decoupled-lr is refused naming the checkpoint's: {p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        p = run(*train, "--decoupled-lr", "2e-3", "--use-checkpoint-opt_param-scheduler", "--save",
                os.path.join(tmp, "decoupled-resumed"), ok=False)
        check(p.returncode == 0 and "decoupled learning rate (embedding and output layer) 0.001 (this command line: "
              "0.002)" in p.stdout + p.stderr,
              f"--use-checkpoint-opt_param-scheduler takes the checkpoint's rate: {p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        hr, _ = read_ptk(os.path.join(tmp, "decoupled-resumed"))
        check(hr["opt_param_scheduler"].get("decoupled_lr") == 1e-3, "the resumed run saves the checkpoint's rate")
        p = run(*train, "--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-4", ok=False)
        check(p.returncode == 0, f"the same rates resume: {p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        # --fp16: fp16 weights, fp32 masters, the dynamic loss scaler carried both ways.
        ptk_fp16, _ = import_matches_reference(tmp, "t1p1-fp16", ["--tp", "1", "--pp", "1", "--fp16"], 56)
        h16, arr16 = read_ptk(ptk_fp16)
        check(h16.get("loss_scale") == 65536.0 and h16.get("loss_scale_growth_tracker") == 3 and
              h16.get("loss_scale_hysteresis_tracker") == 2, f"fp16: the loss scaler carried: {h16.get('loss_scale')}")
        export_and_check(tmp, "x-t2p1-fp16", ptk_fp16, 2, 1, "transformer_engine", h16, arr16, torch.float16)
        gs = torch.load(os.path.join(tmp, "x-t2p1-fp16-meg", "iter_0000020", "mp_rank_00",
                                     "model_optim_rng.pt"))["optimizer"]["grad_scaler"]
        check(float(gs["scale"]) == 65536.0 and gs["growth_tracker"] == 3 and gs["hysteresis_tracker"] == 2,
              f"fp16: the loss scaler written as Megatron's grad_scaler: {gs}")
        # ptk -> megatron -> ptk at several sizes and both layer specs.
        # A bf16 run's checkpoint is written as Megatron's --bf16 saves it (bf16 weights, fp32 masters).
        for label, src, tp, pp, impl, precision in (
                ("x-t2p2", ptk1, 2, 2, "transformer_engine", torch.float32),
                ("x-t1p1-bf16", ptk22, 1, 1, "local", torch.bfloat16),
                ("x-t2p2-bf16", ptk22, 2, 2, "transformer_engine", torch.bfloat16),
                ("x-t2p1", ptk21, 2, 1, "transformer_engine", torch.float32),
                ("x-t1p4", ptk12, 1, 4, "local", torch.float32),
                ("x-t4p2", ptk12, 4, 2, "transformer_engine", torch.float32)):
            h, arr = read_ptk(src)
            export_and_check(tmp, label, src, tp, pp, impl, h, arr, precision)
        # Megatron -> ptk -> Megatron at the same size: every tensor and moment as Megatron wrote it
        # (fp32 run), the padded rows beyond ptk's aside.
        src = os.path.join(tmp, "t2p1-local-untied-meg")
        out = os.path.join(tmp, "again-meg")
        convert("ptk", "megatron", ptk21, out, "--target-tensor-parallel-size", "2", "--saver-transformer-impl",
                "local", "--make-vocab-size-divisible-by", "8")
        a = [torch.load(os.path.join(src, "iter_0000020", f"mp_rank_{t:02d}", "model_optim_rng.pt")) for t in range(2)]
        b = [torch.load(os.path.join(out, "iter_0000020", f"mp_rank_{t:02d}", "model_optim_rng.pt")) for t in range(2)]
        names = [k for k, v in a[0]["model"].items() if v is not None]
        decay = [k for k in names if a[0]["model"][k].dim() > 1]
        order = decay + [k for k in names if a[0]["model"][k].dim() == 1]
        for k in names:
            vocab = k in ("embedding.word_embeddings.weight", "output_layer.weight")
            dim = 1 if k.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0
            tensors = [(sd["model"][k], sd["optimizer"]["state"][order.index(k)]) for sd in a], \
                      [(sd["model"][k], sd["optimizer"]["state"][order.index(k)]) for sd in b]
            for which in ("weight", "exp_avg", "exp_avg_sq"):
                full = []
                for side in tensors:
                    parts = [w if which == "weight" else st[which] for w, st in side]
                    split = vocab or dim == 1 or k.endswith(("linear_qkv.weight", "linear_qkv.bias",
                                                               "linear_fc1.weight", "linear_fc1.bias"))
                    full.append(torch.cat(parts, dim=dim) if split else parts[0])
                if vocab:  # the rows beyond ptk's padded vocabulary (56) are Megatron's TP padding, not ptk's
                    full = [f[:56] for f in full]
                check(torch.equal(full[0], full[1]), f"megatron -> ptk -> megatron: {which} of {k}")
        # The same for a --bf16 run at T2 x P2: the bf16 weights (ptk rounds its fp32 masters to bf16 as
        # torch does), the fp32 masters and the moments as Megatron wrote them.
        for rank in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
            t = int(rank[8:10])
            a = torch.load(os.path.join(tmp, "t2p2-te-bf16-meg", "iter_0000020", rank, "model_optim_rng.pt"))
            b = torch.load(os.path.join(tmp, "x-t2p2-bf16-meg", "iter_0000020", rank, "model_optim_rng.pt"))
            names = [k for k, v in a["model"].items() if torch.is_tensor(v) and not k.endswith("_extra_state")]
            order = [k for k in names if a["model"][k].dim() > 1] + [k for k in names if a["model"][k].dim() == 1]
            decay = sum(1 for k in names if a["model"][k].dim() > 1)

            def rows(k, x):  # a vocabulary shard's rows within ptk's 56
                if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    return x[:max(0, min(x.shape[0], 56 - t * x.shape[0]))]
                return x
            for i, k in enumerate(order):
                g, pos = (0, i) if i < decay else (1, i - decay)
                pairs = [(a["model"][k], b["model"][k]),
                         (a["optimizer"]["fp32_from_fp16_params"][g][pos], b["optimizer"]["fp32_from_fp16_params"][g][pos]),
                         (a["optimizer"]["optimizer"]["state"][i]["exp_avg"], b["optimizer"]["optimizer"]["state"][i]["exp_avg"]),
                         (a["optimizer"]["optimizer"]["state"][i]["exp_avg_sq"],
                          b["optimizer"]["optimizer"]["state"][i]["exp_avg_sq"])]
                for which, (x, y) in zip(("bf16 weight", "fp32 master", "exp_avg", "exp_avg_sq"), pairs):
                    check(x.dtype == y.dtype and torch.equal(rows(k, x), rows(k, y)),
                          f"bf16 megatron -> ptk -> megatron: {which} of {k} in {rank}")
        # A rerun over the same directory replaces the iteration whole.
        convert("ptk", "megatron", ptk21, out, "--target-tensor-parallel-size", "2",
                "--make-vocab-size-divisible-by", "8")
        check(sorted(os.listdir(os.path.join(out, "iter_0000020"))) == ["mp_rank_00", "mp_rank_01"],
              "a rerun leaves the iteration's directory whole")
        check(not [x for x in os.listdir(out) if ".ptk-" in x], "a rerun leaves no temporaries")

        # A full disk (a file-size limit: EFBIG, as ENOSPC) is exit 3, and the directory keeps no
        # iteration, no tracker and no temporary.
        full = os.path.join(tmp, "full")
        p = subprocess.run(["bash", "-c", 'trap "" XFSZ; ulimit -f 16; exec "$@"', "x", CONVERT, "--loader", "ptk",
                            "--saver", "megatron", "--load-dir", ptk21, "--save-dir", full,
                            "--target-tensor-parallel-size", "2", "--make-vocab-size-divisible-by", "8"],
                           capture_output=True, text=True)
        check(p.returncode == 3 and "model_optim_rng.pt" in p.stderr, f"a full disk is exit 3: {p.returncode} {p.stderr}")
        left = [x for x in os.listdir(full) if not x.startswith("ptk-convert")] if os.path.isdir(full) else []
        check(left == [], f"a failed save leaves nothing: {left}")
        # Refusals.
        bad = os.path.join(tmp, "bad")
        shutil.copytree(os.path.join(tmp, "t2p2-te-bf16-meg"), bad)
        victim = os.path.join(bad, "iter_0000020", "mp_rank_01_001", "model_optim_rng.pt")
        shutil.rmtree(os.path.dirname(victim))
        expect_refusal(tmp, "missing shard", bad, "mp_rank_01_001", "missing")
        shutil.rmtree(bad)
        shutil.copytree(os.path.join(tmp, "t1p1-te-meg"), bad)
        victim = os.path.join(bad, "iter_0000020", "mp_rank_00", "model_optim_rng.pt")
        data = open(victim, "rb").read()
        open(victim, "wb").write(data[:len(data) // 2])
        expect_refusal(tmp, "truncated zip", bad, victim, "truncated")
        sd = torch.load(os.path.join(tmp, "t1p1-te-meg", "iter_0000020", "mp_rank_00", "model_optim_rng.pt"))
        sd["model"]["decoder.layers.1.mlp.linear_fc1.weight"] = torch.zeros(3, 16)
        torch.save(sd, victim)
        expect_refusal(tmp, "shape", bad, victim, "decoder.layers.1.mlp.linear_fc1.weight", "[3, 16]")
        sd = torch.load(os.path.join(tmp, "t1p1-te-meg", "iter_0000020", "mp_rank_00", "model_optim_rng.pt"))
        sd["unsafe"] = subprocess.Popen  # a global no checkpoint holds
        torch.save(sd, victim)
        expect_refusal(tmp, "unknown global", bad, victim, "unknown global", "Popen")
        # Megatron's unfused GELU MLP is the exact erf GELU: --no-bias-gelu-fusion, or no biases (which Megatron
        # leaves unfused), import as ptk's exact-GELU model (were refused), its settings and flags say so, and the
        # export writes args.bias_gelu_fusion False again.
        for label, flags, want_flag in (("unfused-gelu", ["--no-bias-gelu-fusion"], "--no-bias-gelu-fusion"),
                                        ("gelu-no-bias", ["--disable-bias-linear", "--impl", "local"],
                                         "--disable-bias-linear")):
            ptk, p = import_matches_reference(tmp, label, ["--tp", "2", "--pp", "1"] + flags, 56)
            h, _ = read_ptk(ptk)
            check(h["model"].get("bias_gelu_fusion") is False, f"{label}: the model is the exact GELU: {h['model']}")
            check(["--no-bias-gelu-fusion", "on (the exact erf GELU)"] in h["settings"],
                  f"{label}: the settings record the exact GELU")
            check(want_flag in p.stdout + p.stderr, f"{label}: ptk-train's flags carry {want_flag}: {p.stdout}")
            back = os.path.join(tmp, label + "-back")
            convert("ptk", "megatron", ptk, back, "--make-vocab-size-divisible-by", "8")
            sd = torch.load(os.path.join(back, "iter_0000020", "mp_rank_00", "model_optim_rng.pt"))
            check(sd["args"].bias_gelu_fusion is False, f"{label}: the export's args.bias_gelu_fusion is False")
        # A ptk checkpoint is not split for the other savers.
        p = run(CONVERT, "--loader", "megatron", "--saver", "ptk", "--load-dir", bad, "--save-dir", bad + "x",
                "--target-tensor-parallel-size", "2", ok=False)
        check(p.returncode == 2, "--target-tensor-parallel-size needs --saver megatron (usage error)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    finish("megatron checkpoint round trips: OK")


if __name__ == "__main__":
    main()
