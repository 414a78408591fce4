#!/usr/bin/env python3
"""ptk-convert's MixtralForCausalLM export of ptk-train's mixture-of-experts models against Hugging Face transformers
itself (4.44.2 from PyPI on Debian's torch 1.13, CPU; installed by scripts/install-deps.sh --with-python-ref into
/opt/ptk-pyref).

Checks:
  * Megatron's post-top-k softmax routing (the softmax over the k largest logits) is Mixtral's (the softmax over
    all experts, the top k, renormalised), on random logits; the pre-softmax routing is not;
  * a Llama-line MoE model trained by ptk-train (RMSNorm, RoPE base 500000, SwiGLU experts of another width
    than --ffn-hidden-size, 4 query heads in 2 groups, untied, no biases, 4 experts, top 2, the load-balancing
    loss on) and exported with --saver hf loads with MixtralForCausalLM.from_pretrained with no missing,
    unexpected or mismatched weight and no warning; its logits equal ptk's Forward (logits_tool) within 1e-4 on
    several sequences; config.json holds the experts' settings; routing to one expert, or another rotary base,
    moves the logits past the tolerance; greedy generation continues as ptk's sampler;
  * a tied model with top 1 and --rotary-interleaved, the same; sharded with --max-shard-size 100KB it loads to the
    same logits, sharded as save_pretrained shards it;
  * ptk -> hf -> ptk -> hf is byte-identical; a MixtralForCausalLM made by transformers (grouped heads, 4 experts
    of another width, top 2) imported with --loader hf gives the same logits in ptk; ptk-train --finetune trains on
    from it with the flags ptk-convert prints; hf -> ptk -> hf gives back every tensor bit for bit and the
    config's values; saved by save_pretrained(max_shard_size="100KB") it imports bit for bit as unsharded; with a
    sliding_window or router_jitter_noise ptk cannot honour it is refused (exit 1, one line, nothing written);
  * what Mixtral cannot compute is refused by the export (exit 1, the file and the reason named, nothing written);
  * --saver megatron at tensor and pipeline size 2 and --loader megatron back give the same Mixtral export byte for
    byte; --target-use-distributed-optimizer is refused for MoE.
Usage: hf_mixtral_test.py BIN_DIR TEST_BIN_DIR
"""
import json
import os
import random
import tempfile

from hf_test_common import (BIN, TEST_BIN, TOL, check, check_finetune, check_sharded_export, check_sharded_import,
                            compare_logits, finish, hf_logits, load_checked, numpy, run, torch)
from safetensors import safe_open
from transformers import MixtralConfig, MixtralForCausalLM


def load_hf(path, **kwargs):
    return load_checked(MixtralForCausalLM, path, **kwargs)


rng = random.Random(45)
SEQS = [[50256], [464, 2106, 286, 262, 995, 318, 257]] + [[rng.randrange(50257) for _ in range(n)] for n in (33, 64)]
TRAIN = [os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "1024", "--micro-batch-size", "4", "--lr", "3e-3",
         "--mock-data", "--threads", "2", "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.2",
         "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
         "--ffn-hidden-size", "96", "--attention-dropout", "0", "--hidden-dropout", "0", "--disable-bias-linear",
         "--num-experts", "4", "--moe-ffn-hidden-size", "40"]
MIXTRAL = ["--swiglu", "--rotary-base", "500000", "--group-query-attention", "--num-query-groups", "2",
           "--untie-embeddings-and-output-weights", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
CONVERT = os.path.join(BIN, "ptk-convert")


def export(ck, hf, expect=0, saver="hf", extra=()):
    return run([CONVERT, "--model-type", "GPT", "--loader", "ptk", "--saver", saver, "--load-dir", ck, "--save-dir",
                hf] + list(extra), expect)


def tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def routing_matches():
    """Megatron's --moe-router-topk k after the softmax (its default) against Mixtral's routing, on random logits:
    the same experts and probabilities; Megatron's pre-softmax probabilities (not renormalised) differ."""
    torch.manual_seed(45)
    for experts, k in ((4, 1), (4, 2), (8, 2), (8, 3)):
        logits = 3 * torch.randn(256, experts, dtype=torch.float64)
        top, idx = torch.topk(logits, k, dim=-1)
        megatron = torch.softmax(top, dim=-1)  # Megatron-core's topk_softmax_with_capacity, post-softmax
        scores = torch.softmax(logits, dim=-1)  # MixtralSparseMoeBlock.forward
        weights, chosen = torch.topk(scores, k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        check(torch.equal(idx, chosen), "E={} k={}: Mixtral chooses other experts".format(experts, k))
        diff = float((megatron - weights).abs().max())
        check(diff < 1e-12, "E={} k={}: Mixtral's probabilities differ from Megatron's by {}".format(experts, k, diff))
        pre = float((torch.gather(scores, 1, idx) - megatron).abs().max())
        check(pre > 1e-2, "E={} k={}: the pre-softmax probabilities differ by only {}".format(experts, k, pre))


routing_matches()
with tempfile.TemporaryDirectory() as tmp:
    # ---- a Llama-line MoE model: trained, exported, loaded, compared
    ck, hf = os.path.join(tmp, "ck"), os.path.join(tmp, "hf")
    prompt_ids = [464, 2106, 286, 262]
    run(TRAIN + MIXTRAL + ["--train-iters", "20", "--save", ck])
    out = export(ck, hf)
    check(": 2 layers, hidden 64, 4 heads, 4 experts of ffn 40 (top 2), 1024 positions, vocabulary 50257" in out,
          "the summary line: " + out)
    model = load_hf(hf)
    compare_logits(ck, model, SEQS, 50257, tmp, "mixtral")
    config = json.load(open(os.path.join(hf, "config.json")))
    want = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 40,
            "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01,
            "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None, "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 50257,
            "max_position_embeddings": 1024, "hidden_act": "silu", "torch_dtype": "float32"}
    check(all(config.get(k) == v for k, v in want.items()),
          "config.json: {}".format({k: config.get(k) for k in want if config.get(k) != want[k]}))
    gate = model.model.layers[1].block_sparse_moe.gate.weight
    check(tuple(gate.shape) == (4, 64) and len(model.model.layers[0].block_sparse_moe.experts) == 4,
          "the router's shape {}".format(tuple(gate.shape)))
    # The test can tell: routing each token to one expert, or another rotary base, moves the logits.
    for what, kwargs in (("top 1", {"num_experts_per_tok": 1}), ("rope_theta 10000", {"rope_theta": 10000.0})):
        other = MixtralForCausalLM.from_pretrained(hf, **kwargs).eval()
        worst = max(float(numpy.abs(hf_logits(other, s) - hf_logits(model, s)).max()) for s in SEQS)
        check(worst > 10 * TOL, "{} changes the logits by only {}: too weak a test".format(what, worst))
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=50256, eos_token_id=None)[0, len(prompt_ids):]
    ptk_ids = [int(x) for x in run([os.path.join(TEST_BIN, "logits_tool"), ck, "--generate", "8"]
                                   + [str(i) for i in prompt_ids]).split()]
    check(gen.tolist() == ptk_ids, "greedy continuation: transformers {} ptk {}".format(gen.tolist(), ptk_ids))

    # ---- ptk -> hf -> ptk -> hf, byte for byte
    back, hf2 = os.path.join(tmp, "back"), os.path.join(tmp, "hf2")
    run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hf, "--save-dir", back])
    export(back, hf2)
    for name in sorted(os.listdir(hf)):
        check(open(os.path.join(hf, name), "rb").read() == open(os.path.join(hf2, name), "rb").read(),
              "export -> import -> export: {} differs".format(name))

    # ---- a MixtralForCausalLM transformers made, imported into ptk, and back
    torch.manual_seed(45)
    src = MixtralForCausalLM(MixtralConfig(
        num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=80,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=50257, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=1e6, initializer_range=0.1, router_aux_loss_coef=0.001)).eval()
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
    check(sorted(a) == sorted(b), "hf -> ptk -> hf: tensors {}".format(sorted(set(a) ^ set(b))[:4]))
    for k in sorted(set(a) & set(b)):
        check(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), "hf -> ptk -> hf: {} differs".format(k))
    ca, cb = src.config.to_dict(), MixtralConfig.from_pretrained(hfout).to_dict()
    for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "vocab_size",
              "max_position_embeddings", "rms_norm_eps", "rope_theta", "sliding_window", "tie_word_embeddings",
              "hidden_act", "initializer_range", "router_jitter_noise"):
        check(ca[k] == cb[k], "hf -> ptk -> hf: config {} {} -> {}".format(k, ca[k], cb[k]))
    check_finetune(out, ckin)
    check_sharded_import(src, "100KB", ckin, tmp, "mixtral-imported-sharded")
    # A field ptk cannot honour: exit 1, one line naming config.json and the key, nothing written.
    cfg = json.load(open(os.path.join(hfsrc, "config.json")))
    for key, value, reason in (("sliding_window", 256, "sliding_window 256: ptk's attention is causal"),
                               ("router_jitter_noise", 0.01, "router_jitter_noise 0.01: ptk's router has no jitter")):
        bad, ckbad = os.path.join(tmp, "bad-" + key), os.path.join(tmp, "ckbad-" + key)
        os.makedirs(bad)
        json.dump(dict(cfg, **{key: value}), open(os.path.join(bad, "config.json"), "w"))
        os.symlink(os.path.join(hfsrc, "model.safetensors"), os.path.join(bad, "model.safetensors"))
        msg = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", bad, "--save-dir", ckbad], expect=1)
        check(reason in msg and os.path.join(bad, "config.json") in msg and len(msg.strip().splitlines()) == 1 and
              not os.path.exists(ckbad), "{}: refused with {!r}".format(key, msg))

    # ---- tied, top 1, interleaved rotary pairs; sharded as save_pretrained shards
    ckt, hft = os.path.join(tmp, "ckt"), os.path.join(tmp, "hft")
    run(TRAIN + ["--swiglu", "--moe-router-topk", "1", "--rotary-interleaved", "--train-iters", "6", "--save", ckt])
    export(ckt, hft, extra=["--max-shard-size", "100KB"])
    mt = load_hf(hft)
    check(mt.config.tie_word_embeddings and mt.config.num_experts_per_tok == 1 and
          mt.config.router_aux_loss_coef == 0.0, "tied, top 1: {}".format(mt.config))
    check_sharded_export(hft, compare_logits(ckt, mt, SEQS, 50257, tmp, "tied, top 1, interleaved, sharded"), "100KB",
                         tmp, "mixtral sharded")

    # ---- what MixtralForCausalLM cannot compute: refused naming the file and the reason, nothing written
    for what, flags, reason in (
            ("pre-softmax", MIXTRAL + ["--moe-router-pre-softmax"], "--moe-router-pre-softmax (Mixtral renormalises"),
            ("sigmoid", MIXTRAL + ["--moe-router-score-function", "sigmoid"], "--moe-router-score-function sigmoid"),
            ("dense layers", MIXTRAL + ["--moe-layer-freq", "2"], "--moe-layer-freq [1,0] with dense layers"),
            ("GELU experts", [], "GELU experts without --swiglu"),
            ("LayerNorm", ["--swiglu", "--normalization", "LayerNorm"], "--normalization LayerNorm"),
            ("learned positions", ["--swiglu", "--position-embedding-type", "learned_absolute"],
             "--position-embedding-type learned_absolute"),
            ("rope scaling", ["--swiglu", "--use-rope-scaling"], "--use-rope-scaling (transformers 4.44's Mixtral")):
        ckr, hfr = os.path.join(tmp, "ckr"), os.path.join(tmp, "hfr")
        run(TRAIN + flags + ["--train-iters", "1", "--save", ckr])
        msg = export(ckr, hfr, expect=1)
        check(reason in msg and "is not one Hugging Face's MixtralForCausalLM computes" in msg and
              os.path.join(ckr, "iter_0000001") in msg, "{}: refused with {!r}".format(what, msg))
        check(len(msg.strip().splitlines()) == 1, "{}: the refusal is one line: {!r}".format(what, msg))
        check(not os.path.exists(hfr), "{}: the refused export left {}".format(what, hfr))
        run(["rm", "-rf", ckr])
    # ---- through Megatron's torch format and back (tensor and pipeline size 2): the same Mixtral export
    mg, ckm, hfm = os.path.join(tmp, "megatron"), os.path.join(tmp, "ckm"), os.path.join(tmp, "hfm")
    msg = export(ck, mg, expect=1, saver="megatron", extra=["--target-use-distributed-optimizer"])
    check("--target-use-distributed-optimizer is not written for MoE checkpoints yet" in msg and
          not os.path.exists(os.path.join(mg, "iter_0000020")), "--saver megatron, distributed: {!r}".format(msg))
    export(ck, mg, saver="megatron", extra=["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size",
                                            "2"])
    out = run([CONVERT, "--loader", "megatron", "--saver", "ptk", "--load-dir", mg, "--save-dir", ckm])
    check("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 40 --moe-aux-loss-coeff 0.01" in out,
          "the Megatron import prints the experts' flags: " + out)
    export(ckm, hfm)
    check(open(os.path.join(hf, "model.safetensors"), "rb").read() ==
          open(os.path.join(hfm, "model.safetensors"), "rb").read(), "ptk -> megatron -> ptk -> hf: the weights differ")

finish("hf_mixtral_test")
