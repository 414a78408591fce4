"""ptk-convert --saver megatron / --loader megatron for Megatron's Llama line, read with PyTorch's torch.load.

A Llama-3-shaped model trained by ptk-train (RMSNorm, RoPE base 500000 with Llama 3.1's scaling, SwiGLU,
4 query heads in 2 groups, no biases, untied) is written as Megatron shards at several tensor x pipeline
sizes and both layer specs. Each shard is checked against an independent reference: the same model's
Hugging Face LlamaForCausalLM export (whose logits hf_llama_test.py checks against transformers), cut the
way megatron-core reads its tensors: SelfAttention.get_query_key_value_tensors views a rank's linear_qkv
output as [num_query_groups / TP, (heads / groups + 2) x head_dim] and splits each group into its query
heads, key and value; MLP's glu chunks a rank's linear_fc1 output in two (gate, then up); linear_proj and
linear_fc2 are split by columns. Those two functions of megatron-core 0.16.1 itself (taken out of its
source: its model code needs a newer torch than Debian's) also run on each rank's shards and must compute
what LlamaForCausalLM's projections and MLP compute from the HF tensors. The args carry Megatron-LM's names (normalization, position_embedding_type,
rotary_base, swiglu, group_query_attention, num_query_groups, kv_channels, add_bias_linear ...). Megatron ->
ptk gives back the weights, AdamW moments and model description bit for bit, and ptk-train resumed from the
round trip logs the same next loss as the run resumed from its own checkpoint. A mix no HF class holds
(LayerNorm with RoPE, biases, grouped heads, tied) round-trips the same way. Megatron's rotary variants
(rotary_interleaved, rope_scaling_factor, rotary_seq_len_interpolation_factor) come in as the model's
description and go back out in the args; an interpolation factor no run could use is refused by name.

Usage: megatron_llama_test.py BIN_DIR
"""
import ast
import os
import re
import shutil
import sys
import tempfile
import types

for p in ("/opt/ptk-pyref", os.environ.get("PTK_PYREF_DIR", "")):
    if p and os.path.isdir(p) and p not in sys.path:
        sys.path.insert(0, p)
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from megatron_test_common import BIN, CONVERT, check, convert, finish, read_ptk, run  # noqa: E402

TRAIN = [os.path.join(BIN, "ptk-train"), "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16384", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-iters", "10", "--mock-data", "--threads", "2",
         "--eval-iters", "0",
         "--log-interval", "1", "--position-embedding-type", "rope", "--swiglu", "--ffn-hidden-size", "48",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--init-method-std", "0.1"]
LLAMA3 = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "500000", "--use-rope-scaling",
          "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights"]
MIX = ["--normalization", "LayerNorm", "--group-query-attention", "--num-query-groups", "2"]  # biased, tied
HEADS, GROUPS, HD, H, F, LAYERS = 4, 2, 8, 32, 48, 4


def megatron_core_functions():
    """megatron-core's own code that reads a rank's fused tensors (PyPI megatron-core 0.16.1, whose model
    code needs a newer torch than Debian's, so the two functions are taken out of its source and run on
    stand-ins for the modules around them): SelfAttention.get_query_key_value_tensors (linear_qkv's
    output viewed per query group and split into query heads, key, value) and MLP's glu (linear_fc1's
    output chunked into gate and up). None when megatron-core is not installed."""
    for root in [p for p in os.environ.get("PYTHONPATH", "").split(":") if p] + ["/opt/ptk-pyref"]:
        core = os.path.join(root, "megatron", "core", "transformer")
        if os.path.exists(os.path.join(core, "attention.py")):
            break
    else:
        return None

    def method(path, cls, name):
        tree = ast.parse(open(path).read())
        c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        return next(n for n in ast.walk(c) if isinstance(n, ast.FunctionDef) and n.name == name)

    env = {"torch": torch, "Tensor": torch.Tensor, "SplitAlongDim": None, "apply_module": lambda m: m,
           "all_gather_last_dim_from_tensor_parallel_region": None}
    qkv = method(os.path.join(core, "attention.py"), "SelfAttention", "get_query_key_value_tensors")
    exec(compile("from __future__ import annotations\n" + ast.unparse(qkv), "attention.py", "exec"), env)
    glu = method(os.path.join(core, "mlp.py"), "MLP", "glu")  # defined in MLP.forward, over self.config
    exec(compile("def make_glu(self):\n" + "\n".join("    " + line for line in ast.unparse(glu).splitlines())
                 + "\n    return glu\n", "mlp.py", "exec"), env)
    return env["get_query_key_value_tensors"], env["make_glu"]


def check_with_megatron_core(label, model, hf, layer, local, t, tp, fns):
    """Rank t's linear_qkv and linear_fc1/fc2 shards run through megatron-core's own functions give what
    LlamaForCausalLM's q/k/v projections and MLP compute from the HF export's tensors."""
    qkv_fn, make_glu = fns
    m, x = f"decoder.layers.{local}.", f"model.layers.{layer}."
    gen = torch.Generator().manual_seed(layer)
    hidden = torch.randn(5, 2, H, generator=gen, dtype=torch.float64)  # [sq, b, h], Megatron's order
    w_qkv = model[m + "self_attention.linear_qkv.weight"].double()
    me = types.SimpleNamespace(
        linear_qkv=lambda h: (h @ w_qkv.t(), None), num_attention_heads_per_partition=HEADS // tp,
        num_query_groups_per_partition=GROUPS // tp, world_size=tp, hidden_size_per_attention_head=HD,
        q_layernorm=None, k_layernorm=None, config=types.SimpleNamespace(num_query_groups=GROUPS, test_mode=False))
    query, key, value = qkv_fn(me, hidden, None)
    heads = slice(t * HEADS // tp, (t + 1) * HEADS // tp)
    groups = slice(t * GROUPS // tp, (t + 1) * GROUPS // tp)

    def proj(name):  # LlamaAttention: [sq, b, heads, hn]
        return (hidden @ hf[x + f"self_attn.{name}.weight"].double().t()).view(5, 2, -1, HD)
    for what, got, want in (("query", query, proj("q_proj")[:, :, heads]), ("key", key, proj("k_proj")[:, :, groups]),
                            ("value", value, proj("v_proj")[:, :, groups])):
        check(got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-12),
              f"{label} t{t}: megatron-core's {what} of layer {layer} is transformers' ({tuple(got.shape)})")
    glu = make_glu(types.SimpleNamespace(config=types.SimpleNamespace(
        activation_func_clamp_value=None, activation_func=torch.nn.functional.silu, glu_linear_offset=0.0)))
    fc1, fc2 = (model[m + f"mlp.linear_fc{i}.weight"].double() for i in (1, 2))
    part = glu(hidden @ fc1.t()) @ fc2.t()
    fs = slice(t * F // tp, (t + 1) * F // tp)
    gate, up = (hidden @ hf[x + f"mlp.{n}.weight"][fs].double().t() for n in ("gate_proj", "up_proj"))
    want = (torch.nn.functional.silu(gate) * up) @ hf[x + "mlp.down_proj.weight"][:, fs].double().t()
    check(torch.allclose(part, want, rtol=0, atol=1e-12),
          f"{label} t{t}: megatron-core's glu over rank {t}'s fc1/fc2 is transformers' LlamaMLP's share")


def shard_path(meg, it, t, p, pp):
    rank = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    return os.path.join(meg, f"iter_{it:07d}", rank, "model_optim_rng.pt")


def expected_names(p, pp, per_stage, te, rms, bias, untie):
    names = ["embedding.word_embeddings.weight"] if p == 0 else []
    norm = ["weight"] if rms else ["weight", "bias"]
    for layer in range(per_stage):
        q = f"decoder.layers.{layer}."
        ln1 = [f"self_attention.linear_qkv.layer_norm_{n}" for n in norm] if te else \
            [f"input_layernorm.{n}" for n in norm]
        ln2 = [f"mlp.linear_fc1.layer_norm_{n}" for n in norm] if te else [f"pre_mlp_layernorm.{n}" for n in norm]
        lin = [f"{m}.{n}" for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                                    "mlp.linear_fc2") for n in (["weight", "bias"] if bias else ["weight"])]
        names += [q + n for n in ln1 + ln2 + lin]
    if p == pp - 1:
        names += [f"decoder.final_layernorm.{n}" for n in norm]
        if untie or pp > 1:
            names.append("output_layer.weight")
    return sorted(names)


def check_llama3_shards(label, meg, it, tp, pp, impl, hf, fns):
    """Every shard against the HF export, cut as megatron-core reads its tensors (and through
    megatron-core's own functions where they are installed)."""
    te = impl == "transformer_engine"
    per_stage = LAYERS // pp
    g_t, f_t, vocab = GROUPS // tp, F // tp, hf["model.embed_tokens.weight"].shape[0]
    for p in range(pp):
        for t in range(tp):
            sd = torch.load(shard_path(meg, it, t, p, pp), map_location="cpu")
            a, model = sd["args"], sd["model"]
            got = {k: getattr(a, k, None) for k in (
                "normalization", "norm_epsilon", "position_embedding_type", "add_position_embedding", "rotary_base",
                "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "rotary_interleaved",
                "rotary_seq_len_interpolation_factor", "swiglu", "group_query_attention", "num_query_groups",
                "kv_channels", "ffn_hidden_size", "add_bias_linear", "untie_embeddings_and_output_weights",
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "transformer_impl")}
            want = {"normalization": "RMSNorm", "norm_epsilon": 1e-6, "position_embedding_type": "rope",
                    "add_position_embedding": False, "rotary_base": 500000.0, "rotary_percent": 1.0,
                    "use_rope_scaling": True, "rope_scaling_factor": 8.0, "rotary_interleaved": False,
                    "rotary_seq_len_interpolation_factor": None, "swiglu": True, "group_query_attention": True, "num_query_groups": 2,
                    "kv_channels": HD, "ffn_hidden_size": F, "add_bias_linear": False,
                    "untie_embeddings_and_output_weights": True, "tensor_model_parallel_size": tp,
                    "pipeline_model_parallel_size": pp, "transformer_impl": impl}
            check(got == want, f"{label} t{t} p{p}: args {[(k, got[k], want[k]) for k in want if got[k] != want[k]]}")
            names = sorted(k for k in model if not k.endswith("_extra_state"))
            want_names = expected_names(p, pp, per_stage, te, True, False, True)
            check(names == want_names, f"{label} t{t} p{p}: names {sorted(set(names) ^ set(want_names))}")

            def same(x, y, what):
                check(tuple(x.shape) == tuple(y.shape) and torch.equal(x.float(), y.float()),
                      f"{label} t{t} p{p}: {what}")
            if p == 0:
                emb = model["embedding.word_embeddings.weight"]
                rows = emb.shape[0]
                full = hf["model.embed_tokens.weight"]
                lo, hi = t * rows, min((t + 1) * rows, vocab)
                if hi > lo:
                    same(emb[:hi - lo], full[lo:hi], "word embeddings (vocabulary-parallel rows)")
            if p == pp - 1:
                same(model["decoder.final_layernorm.weight"], hf["model.norm.weight"], "final RMSNorm")
                out = model["output_layer.weight"]
                rows = out.shape[0]
                lo, hi = t * rows, min((t + 1) * rows, vocab)
                if hi > lo:
                    same(out[:hi - lo], hf["lm_head.weight"][lo:hi], "output layer (untied)")
            for local in range(per_stage):
                layer = p * per_stage + local
                m, x = f"decoder.layers.{local}.", f"model.layers.{layer}."
                qkv = model[m + "self_attention.linear_qkv.weight"]
                check(tuple(qkv.shape) == ((HEADS + 2 * GROUPS) * HD // tp, H), f"{label}: qkv shape {qkv.shape}")
                # megatron-core: mixed_qkv.view(sq, b, ng/TP, (np/ng + 2) * hn), split [np/ng * hn, hn, hn].
                grouped = qkv.view(g_t, (HEADS // GROUPS + 2) * HD, H)
                q, k, v = torch.split(grouped, [HEADS // GROUPS * HD, HD, HD], dim=1)
                qs = slice(t * g_t * (HEADS // GROUPS) * HD, (t + 1) * g_t * (HEADS // GROUPS) * HD)
                kv = slice(t * g_t * HD, (t + 1) * g_t * HD)
                same(q.reshape(-1, H), hf[x + "self_attn.q_proj.weight"][qs], f"layer {layer}: query heads")
                same(k.reshape(-1, H), hf[x + "self_attn.k_proj.weight"][kv], f"layer {layer}: key heads")
                same(v.reshape(-1, H), hf[x + "self_attn.v_proj.weight"][kv], f"layer {layer}: value heads")
                # megatron-core's glu: torch.chunk(fc1 output, 2, dim=-1): gate, then up.
                gate, up = torch.chunk(model[m + "mlp.linear_fc1.weight"], 2, dim=0)
                fs = slice(t * f_t, (t + 1) * f_t)
                same(gate, hf[x + "mlp.gate_proj.weight"][fs], f"layer {layer}: SwiGLU gate")
                same(up, hf[x + "mlp.up_proj.weight"][fs], f"layer {layer}: SwiGLU up")
                same(model[m + "self_attention.linear_proj.weight"],
                     hf[x + "self_attn.o_proj.weight"][:, t * HEADS * HD // tp:(t + 1) * HEADS * HD // tp],
                     f"layer {layer}: linear_proj columns")
                same(model[m + "mlp.linear_fc2.weight"], hf[x + "mlp.down_proj.weight"][:, fs],
                     f"layer {layer}: linear_fc2 columns")
                ln1 = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
                ln2 = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
                same(model[m + ln1], hf[x + "input_layernorm.weight"], f"layer {layer}: input RMSNorm")
                same(model[m + ln2], hf[x + "post_attention_layernorm.weight"], f"layer {layer}: pre-MLP RMSNorm")
                if fns:
                    check_with_megatron_core(label, model, hf, layer, local, t, tp, fns)


def round_trip(label, ptk, meg, back):
    """megatron -> ptk gives back the weights, moments, layout, model and training state bit for bit."""
    convert("megatron", "ptk", meg, back)
    h, arr = read_ptk(ptk)
    h2, arr2 = read_ptk(back)
    check(arr2.tobytes() == arr.tobytes(), f"{label}: ptk -> megatron -> ptk bit for bit (weights and moments)")
    for k in ("tensors", "model", "iteration", "consumed_train_samples", "adam_step", "opt_param_scheduler_num_steps"):
        check(h2[k] == h[k], f"{label}: the round trip keeps {k}: {h[k]} -> {h2[k]}")


def last_loss(out, it):
    m = re.search(rf"iteration +{it}/.*?lm loss: ([0-9.E+-]+)", out)
    return m.group(1) if m else None


def main():
    tmp = tempfile.mkdtemp(prefix="ptk-megatron-llama-")
    fns = megatron_core_functions()
    if fns is None:
        print("megatron-core not installed: its query/key/value split and glu not run")
    try:
        ck, hf = os.path.join(tmp, "ck"), os.path.join(tmp, "hf")
        run(*TRAIN, *LLAMA3, "--train-iters", "3", "--save", ck)
        run(CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", hf)
        with safe_open(os.path.join(hf, "model.safetensors"), framework="pt") as f:
            ref = {k: f.get_tensor(k) for k in f.keys()}
        for tp, pp, impl in ((1, 1, "local"), (2, 1, "transformer_engine"), (2, 2, "local"),
                             (1, 4, "transformer_engine")):
            label = f"llama3 t{tp}p{pp}-{impl}"
            meg = os.path.join(tmp, label.replace(" ", "-") + "-meg")
            convert("ptk", "megatron", ck, meg, "--target-tensor-parallel-size", str(tp),
                    "--target-pipeline-parallel-size", str(pp), "--saver-transformer-impl", impl)
            check_llama3_shards(label, meg, 3, tp, pp, impl, ref, fns)
            round_trip(label, ck, meg, meg + "-back")
        # ptk-train resumed from the round trip: the same next loss as resumed from its own checkpoint.
        back = os.path.join(tmp, "llama3-t2p2-local-meg-back")
        p = convert("megatron", "ptk", os.path.join(tmp, "llama3-t2p2-local-meg"), os.path.join(tmp, "again"))
        flags = re.search(r"resume training with: ptk-train (.*) --load ", p.stdout + p.stderr)
        check(flags is not None and "--swiglu --group-query-attention --num-query-groups 2 --disable-bias-linear"
              in flags.group(1), f"ptk-convert prints ptk-train's Llama flags: {p.stdout + p.stderr}")
        losses = []
        for load in (ck, back):
            r = run(*TRAIN, *LLAMA3, "--train-iters", "5", "--override-opt_param-scheduler", "--load", load, "--save",
                    load + "-resumed")
            out = r.stdout + r.stderr
            check(" 4/" in out and " 3/" not in out, f"resumed at iteration 4 from {load}:\n{out[-1500:]}")
            losses.append((last_loss(out, 4), last_loss(out, 5)))  # the 5th after a step with the moments
        check(None not in losses[0] and losses[0] == losses[1],
              f"the losses at iterations 4 and 5 resumed from ptk / from megatron -> ptk: {losses}")

        # A mix no HF class holds: LayerNorm (weight and bias) with RoPE, every linear biased, grouped, tied.
        mix = os.path.join(tmp, "mix")
        run(*TRAIN, *MIX, "--train-iters", "2", "--save", mix)
        for tp, pp, impl in ((2, 2, "transformer_engine"), (2, 1, "local")):
            meg = os.path.join(tmp, f"mix-t{tp}p{pp}-{impl}")
            convert("ptk", "megatron", mix, meg, "--target-tensor-parallel-size", str(tp),
                    "--target-pipeline-parallel-size", str(pp), "--saver-transformer-impl", impl)
            for p in range(pp):
                sd = torch.load(shard_path(meg, 2, 0, p, pp), map_location="cpu")
                names = sorted(k for k in sd["model"] if not k.endswith("_extra_state"))
                want = expected_names(p, pp, LAYERS // pp, impl == "transformer_engine", False, True, False)
                check(names == want, f"mix t{tp}p{pp}: names {sorted(set(names) ^ set(want))}")
                a = sd["args"]
                check((a.normalization, a.position_embedding_type, a.add_bias_linear, a.num_query_groups,
                       a.untie_embeddings_and_output_weights) == ("LayerNorm", "rope", True, 2, False),
                      f"mix t{tp}p{pp}: args")
                qkv_b = sd["model"]["decoder.layers.0.self_attention.linear_qkv.bias"]
                check(tuple(qkv_b.shape) == ((HEADS + 2 * GROUPS) * HD // tp,), f"mix: qkv bias {qkv_b.shape}")
            round_trip(f"mix t{tp}p{pp}", mix, meg, meg + "-back")

        # Megatron's --squared-relu and --apply-layernorm-1p (without SwiGLU, which Megatron asserts against):
        # args name them, and the way back is bit for bit (the zero-centred norm weights as stored).
        relu = os.path.join(tmp, "relu")
        run(*[a for a in TRAIN if a != "--swiglu"], *MIX, "--squared-relu", "--apply-layernorm-1p", "--train-iters",
            "2", "--save", relu)
        meg = os.path.join(tmp, "relu-meg")
        convert("ptk", "megatron", relu, meg, "--target-tensor-parallel-size", "2", "--saver-transformer-impl", "local")
        a = torch.load(shard_path(meg, 2, 1, 0, 1), map_location="cpu")["args"]
        check((a.squared_relu, a.apply_layernorm_1p, a.swiglu) == (True, True, False), "relu: args")
        round_trip("squared relu, layernorm 1p", relu, meg, meg + "-back")
        sd = torch.load(shard_path(meg, 2, 0, 0, 1), map_location="cpu")
        sd["args"].swiglu = True
        torch.save(sd, shard_path(meg, 2, 0, 0, 1))
        p = convert("megatron", "ptk", meg, os.path.join(tmp, "relu-bad"), ok=False)
        check(p.returncode != 0 and "args.squared_relu with args.swiglu" in p.stderr,
              f"squared relu with swiglu refused: {p.returncode} {p.stderr}")

        # Megatron's rotary variants come in as the model's description (and go back out in the args); a
        # factor no run could use is refused by name, nothing written.
        bad = os.path.join(tmp, "bad")
        shutil.copytree(os.path.join(tmp, "llama3-t1p1-local-meg"), bad)
        victim = shard_path(bad, 3, 0, 0, 1)
        sd = torch.load(victim)
        variant = {"rotary_interleaved": True, "rope_scaling_factor": 32.0, "rotary_seq_len_interpolation_factor": 4}
        before = {k: getattr(sd["args"], k, None) for k in variant}
        for k, v in variant.items():
            setattr(sd["args"], k, v)
        torch.save(sd, victim)
        convert("megatron", "ptk", bad, os.path.join(tmp, "variant-ptk"))
        h, _ = read_ptk(os.path.join(tmp, "variant-ptk"))
        got = {k: h["model"].get(k) for k in variant}
        check(got == {"rotary_interleaved": True, "rope_scaling_factor": 32.0,
                      "rotary_seq_len_interpolation_factor": 4.0}, f"the rotary variants imported: {got}")
        convert("ptk", "megatron", os.path.join(tmp, "variant-ptk"), os.path.join(tmp, "variant-meg"))
        a = torch.load(shard_path(os.path.join(tmp, "variant-meg"), 3, 0, 0, 1), map_location="cpu")["args"]
        got = {k: getattr(a, k, None) for k in variant}
        check(got == {"rotary_interleaved": True, "rope_scaling_factor": 32.0,
                      "rotary_seq_len_interpolation_factor": 4.0}, f"the rotary variants exported: {got}")
        check(type(a.rotary_seq_len_interpolation_factor) is int, "the interpolation factor is an int (Megatron-LM's type)")
        for k, v in before.items():
            setattr(sd["args"], k, v)
        for attr, value, flag in (("rotary_seq_len_interpolation_factor", 0.0,
                                   "--rotary-seq-len-interpolation-factor 0"),
                                  ("rotary_seq_len_interpolation_factor", -2.0,
                                   "--rotary-seq-len-interpolation-factor -2")):
            before = getattr(sd["args"], attr, None)
            setattr(sd["args"], attr, value)
            torch.save(sd, victim)
            setattr(sd["args"], attr, before)
            p = convert("megatron", "ptk", bad, os.path.join(tmp, "bad-ptk"), ok=False)
            check(p.returncode != 0 and flag in p.stderr and len(p.stderr.strip().splitlines()) == 1,
                  f"{flag} refused in one line: {p.returncode} {p.stderr}")
            check(not os.path.exists(os.path.join(tmp, "bad-ptk", "latest_checkpointed_iteration.txt")),
                  "nothing written for a refused checkpoint")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    finish("megatron llama checkpoints: OK")


if __name__ == "__main__":
    main()
