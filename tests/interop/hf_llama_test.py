#!/usr/bin/env python3
"""ptk-convert's LlamaForCausalLM export and import against Hugging Face transformers itself (4.44.2 from
PyPI on Debian's torch 1.13, CPU; installed by scripts/install-deps.sh --with-python-ref into /opt/ptk-pyref).

Checks:
  * a model of Megatron's Llama line trained by ptk-train (RMSNorm, RoPE with base 500000 and Llama 3.1's
    scaling, SwiGLU, 4 query heads in 2 groups, untied, no biases) and exported with --saver hf loads with
    LlamaForCausalLM.from_pretrained with no missing, unexpected or mismatched weight and no warning; its
    logits equal ptk's Forward (logits_tool) within 1e-4 on several sequences; transformers' generate
    (greedy) continues as ptk's sampler and ptk-train's printed sample;
  * a tied model with every linear bias (attention_bias, mlp_bias) and plain RoPE, the same;
  * a LlamaForCausalLM made by transformers (grouped heads, llama3 rope_scaling) imported with --saver ptk
    gives the same logits; ptk-train --finetune trains on from it with the flags ptk-convert prints;
    hf -> ptk -> hf gives back every tensor bit for bit and the config's values; ptk -> hf -> ptk -> hf
    is byte-identical; saved by save_pretrained(max_shard_size="100KB") it imports bit for bit as unsharded, and
    ptk's export with --max-shard-size 100KB loads to the same logits, sharded as save_pretrained shards it;
  * Megatron's rotary variants exported and imported back, each computing ptk's logits: --rope-scaling-factor 32
    (rope_scaling llama3 factor 32), --rotary-seq-len-interpolation-factor 4 (rope_scaling linear),
    --rotary-interleaved (the query and key rows permuted); without the variant the logits move;
  * what LlamaForCausalLM cannot compute is refused by the export (exit 1, the reason named).
Usage: hf_llama_test.py BIN_DIR TEST_BIN_DIR
"""
import json
import os
import random
import re
import tempfile

from hf_test_common import (BIN, TEST_BIN, TOL, check, check_finetune, check_sharded_export, check_sharded_import,
                            compare_logits, finish, hf_logits, load_checked, numpy, run, torch)
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def load_hf(path, **kwargs):
    return load_checked(LlamaForCausalLM, path, **kwargs)


def tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


rng = random.Random(44)
SEQS = [[50256], [464, 2106, 286, 262, 995, 318, 257]] + [[rng.randrange(50257) for _ in range(n)] for n in (33, 64)]
# max_position_embeddings above Llama 3.1's original context, as its configs have it (transformers warns
# about rope_scaling otherwise); RoPE has no weights that grow with it.
TRAIN = [os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "16384", "--micro-batch-size", "4", "--lr", "3e-3",
         "--mock-data", "--threads", "2", "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.2",
         "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--swiglu",
         "--ffn-hidden-size", "96", "--attention-dropout", "0", "--hidden-dropout", "0"]
LLAMA3 = ["--rotary-base", "500000", "--use-rope-scaling", "--group-query-attention", "--num-query-groups", "2",
          "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
CONVERT = os.path.join(BIN, "ptk-convert")


def export(ck, hf, expect=0):
    return run([CONVERT, "--model-type", "GPT", "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir",
                hf], expect)


with tempfile.TemporaryDirectory() as tmp:
    # ---- Llama 3's model: trained, sampled, exported, loaded, compared
    ck, hf = os.path.join(tmp, "ck"), os.path.join(tmp, "hf")
    prompt = "The history of the"
    out = run(TRAIN + LLAMA3 + ["--train-iters", "20", "--save", ck, "--sample-interval", "20", "--sample-prompt",
                                prompt, "--sample-length", "8"])
    sample = re.search(r' sample at iteration +20 \(greedy\): "The history of the" -> "(.*)"\n', out)
    check(sample is not None, "ptk-train printed its sample:\n" + out[-2000:])
    export(ck, hf)
    model = load_hf(hf)
    compare_logits(ck, model, SEQS, 50257, tmp, "llama3")
    config = json.load(open(os.path.join(hf, "config.json")))
    want = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "vocab_size": 50257, "max_position_embeddings": 16384, "hidden_act": "silu", "torch_dtype": "float32",
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}
    check(all(config.get(k) == v for k, v in want.items()),
          "config.json: {}".format({k: config.get(k) for k in want if config.get(k) != want[k]}))
    # The test can tell: another rotary base, or the scaling left out, moves the logits past the tolerance.
    for what, kwargs in (("rope_theta 10000", {"rope_theta": 10000.0}), ("no rope_scaling", {"rope_scaling": None})):
        other = LlamaForCausalLM.from_pretrained(hf, **kwargs).eval()
        worst = max(float(numpy.abs(hf_logits(other, s) - hf_logits(model, s)).max()) for s in SEQS)
        check(worst > 10 * TOL, "{} changes the logits by only {}: too weak a test".format(what, worst))
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(prompt)["input_ids"]
    check(ids == [464, 2106, 286, 262], "the exported tokenizer encodes {!r} as {}".format(prompt, ids))
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=50256, eos_token_id=None)[0, len(ids):]
    ptk_ids = [int(x) for x in run([os.path.join(TEST_BIN, "logits_tool"), ck, "--generate", "8"]
                                   + [str(i) for i in ids]).split()]
    check(gen.tolist() == ptk_ids, "greedy continuation: transformers {} ptk {}".format(gen.tolist(), ptk_ids))
    if sample and "\\" not in sample.group(1):
        check(tok.decode(gen) == sample.group(1),
              "transformers' greedy text {!r} vs ptk-train's sample {!r}".format(tok.decode(gen), sample.group(1)))

    # ---- ptk -> hf -> ptk -> hf, byte for byte
    back, hf2 = os.path.join(tmp, "back"), os.path.join(tmp, "hf2")
    run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hf, "--save-dir", back])
    export(back, hf2)
    for name in sorted(os.listdir(hf)):
        check(open(os.path.join(hf, name), "rb").read() == open(os.path.join(hf2, name), "rb").read(),
              "export -> import -> export: {} differs".format(name))

    # ---- tied, every linear biased, RoPE unscaled (base 10000), multi-head attention
    ckb, hfb = os.path.join(tmp, "ckb"), os.path.join(tmp, "hfb")
    run(TRAIN + ["--train-iters", "6", "--save", ckb])
    export(ckb, hfb)
    mb = load_hf(hfb)
    compare_logits(ckb, mb, SEQS, 50257, tmp, "tied, biased")
    check(mb.config.tie_word_embeddings and mb.config.attention_bias and mb.config.mlp_bias and
          mb.config.rope_scaling is None and mb.config.num_key_value_heads == 4, "tied, biased: {}".format(mb.config))
    check(float(mb.model.layers[1].mlp.up_proj.bias.abs().max()) > 0, "the biases were trained away from 0")

    # ---- a model transformers made, imported into ptk, and back
    torch.manual_seed(44)
    src = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=80,
        vocab_size=50257, max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=500000.0,
        initializer_range=0.1, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})).eval()
    with torch.no_grad():  # the RMSNorm weights away from their 1 init, so they are tested too
        for name, p in src.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    hfsrc, ckin, hfout = os.path.join(tmp, "hfsrc"), os.path.join(tmp, "ckin"), os.path.join(tmp, "hfout")
    src.save_pretrained(hfsrc, safe_serialization=True)
    out = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfsrc, "--save-dir", ckin])
    compare_logits(ckin, src, SEQS, 50257, tmp, "imported")
    export(ckin, hfout)
    a, b = tensors(hfsrc), tensors(hfout)
    check(sorted(a) == sorted(b), "hf -> ptk -> hf: tensors {} vs {}".format(sorted(set(a) ^ set(b))[:4], ""))
    for k in sorted(set(a) & set(b)):
        check(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), "hf -> ptk -> hf: {} differs".format(k))
    ca, cb = src.config.to_dict(), LlamaConfig.from_pretrained(hfout).to_dict()
    for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
              "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "initializer_range"):
        check(ca[k] == cb[k], "hf -> ptk -> hf: config {} {} -> {}".format(k, ca[k], cb[k]))
    check_finetune(out, ckin)
    # Sharded both ways: transformers' shards imported bit for bit; ptk's loaded and sharded as save_pretrained's.
    check_sharded_import(src, "100KB", ckin, tmp, "llama-imported-sharded")
    hfs = os.path.join(tmp, "hfs")
    run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ckin, "--save-dir", hfs, "--max-shard-size",
         "100KB"])
    check_sharded_export(hfs, compare_logits(ckin, load_hf(hfs), SEQS, 50257, tmp, "llama sharded"), "100KB", tmp,
                         "llama sharded")

    # ---- Megatron's rotary variants: Llama 3.2's factor 32 (rope_scaling llama3, factor 32), linear position
    # interpolation (rope_scaling linear), interleaved pairs (q/k rows permuted by the export). Each exported
    # model computes ptk's; imported back, ptk's logits again; each variant's own setting moves the logits.
    def permute_back(model):
        """The exported q/k rows put back in ptk's interleaved order: HF's Llama then computes another model."""
        other = LlamaForCausalLM.from_pretrained(model.name_or_path).eval()
        hd = other.config.hidden_size // other.config.num_attention_heads
        order = [j // 2 if j % 2 == 0 else hd // 2 + j // 2 for j in range(hd)]  # ptk's channel j is HF's order[j]
        with torch.no_grad():
            for layer in other.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    w = proj.weight.view(-1, hd, proj.weight.shape[1])
                    proj.weight.copy_(w[:, order, :].reshape(proj.weight.shape))
        return other

    variants = (
        ("rope_scaling factor 32", ["--rotary-base", "500000", "--use-rope-scaling", "--rope-scaling-factor", "32"],
         {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192},
         lambda hfv: LlamaForCausalLM.from_pretrained(hfv, rope_scaling={
             "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}).eval()),
        ("linear interpolation 4", ["--rotary-seq-len-interpolation-factor", "4"], {"type": "linear", "factor": 4.0},
         lambda hfv: LlamaForCausalLM.from_pretrained(hfv, rope_scaling=None).eval()),
        ("interleaved", ["--rotary-interleaved", "--rotary-base", "500000"], None, None))
    for i, (what, flags, scaling, other) in enumerate(variants):
        ckv, hfv, backv = (os.path.join(tmp, "{}{}".format(n, i)) for n in ("ckv", "hfv", "backv"))
        run(TRAIN + flags + ["--train-iters", "6", "--save", ckv])
        export(ckv, hfv)
        mv = load_hf(hfv)
        compare_logits(ckv, mv, SEQS, 50257, tmp, what)
        got = json.load(open(os.path.join(hfv, "config.json"))).get("rope_scaling")
        if scaling and scaling.get("type") == "linear":
            check(got.get("rope_type", got.get("type")) == "linear" and got.get("factor") == scaling["factor"],
                  "{}: rope_scaling {}".format(what, got))
        else:
            check(got == scaling, "{}: rope_scaling {}".format(what, got))
        changed = other(hfv) if other else permute_back(mv)
        worst = max(float(numpy.abs(hf_logits(changed, s) - hf_logits(mv, s)).max()) for s in SEQS)
        check(worst > 10 * TOL, "{}: without it the logits move by only {}: too weak a test".format(what, worst))
        run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfv, "--save-dir", backv])
        compare_logits(backv, mv, SEQS, 50257, tmp, what + ", imported back")

    # ---- what LlamaForCausalLM cannot compute: refused, nothing written
    for what, flags, reason in (
            ("llama3 and linear scaling", ["--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "2"],
             "--use-rope-scaling with --rotary-seq-len-interpolation-factor"),
            ("LayerNorm", ["--normalization", "LayerNorm"], "--normalization LayerNorm"),
            ("learned positions", ["--position-embedding-type", "learned_absolute"],
             "--position-embedding-type learned_absolute"),
            ("partial rotary", ["--rotary-percent", "0.5"], "--rotary-percent 0.5")):
        ckr, hfr = os.path.join(tmp, "ckr"), os.path.join(tmp, "hfr")
        run(TRAIN + flags + ["--train-iters", "1", "--save", ckr])
        msg = export(ckr, hfr, expect=1)
        check(reason in msg and "LlamaForCausalLM" in msg, "{}: refused with {!r}".format(what, msg))
        check(not os.path.exists(hfr), "{}: the refused export left {}".format(what, hfr))
        run(["rm", "-rf", ckr])

finish("hf_llama_test")
