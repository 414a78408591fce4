#!/usr/bin/env python3
"""ptk-convert's Qwen3MoeForCausalLM and Qwen2MoeForCausalLM export of ptk-train's mixture-of-experts models (the Llama line with
--qk-layernorm) against Hugging Face transformers itself: 4.51.3 (the first with Qwen3-MoE) from
/opt/ptk-pyref/transformers-qwen3 on Debian's torch 1.13 with tests/support/torch2_shim.py, as hf_qwen3_test.py.
Without that folder the test says so in a banner and exits 77 (skipped); under CI (CI=true) it fails instead.

Checks:
  * a Qwen3-MoE model trained by ptk-train (RMSNorm, --qk-layernorm, 4 query heads of --kv-channels 24 in 2 groups,
    the first layer dense (--moe-layer-freq "[0,1]", --ffn-hidden-size 96), 4 SwiGLU experts of 40, top 2, untied,
    no biases) and exported with --saver hf loads with Qwen3MoeForCausalLM.from_pretrained with no missing,
    unexpected or mismatched weight and no warning; its logits equal ptk's Forward (logits_tool) within 1e-4;
    config.json holds the experts' settings (mlp_only_layers [0], norm_topk_prob true); flipping norm_topk_prob or
    mlp_only_layers moves the logits past the tolerance;
  * the same with --moe-router-pre-softmax (norm_topk_prob false), tied, every layer a mixture;
  * export -> import -> export is byte-identical; ptk-train --finetune trains on from the import with the flags
    ptk-convert prints;
  * a Qwen2-MoE model trained by ptk-train (--add-qkv-bias, a shared expert of 48 with --moe-shared-expert-gate,
    the first layer dense) exported loads with Qwen2MoeForCausalLM the same way, its logits within 1e-4; zeroing
    a shared_expert_gate (sigmoid 0.5) moves them, so Megatron's gate is HF's;
  * shared experts are refused by the Qwen3-MoE export, and ungated ones by the Qwen2-MoE export (exit 1, one line
    naming the flag, nothing written).
Usage: hf_qwen3_moe_test.py BIN_DIR TEST_BIN_DIR
"""
import json
import os
import random
import tempfile

os.environ["PTK_HF_REFERENCE"] = "qwen3"  # hf_test_common: transformers 4.51.3 from transformers-qwen3
from hf_test_common import (BIN, TOL, check, check_finetune, compare_logits, finish, hf_logits, load_checked,  # noqa: E402
                            numpy, run, torch)
from transformers import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

rng = random.Random(46)
SEQS = [[50256], [464, 2106, 286, 262, 995, 318, 257]] + [[rng.randrange(50257) for _ in range(n)] for n in (33, 64)]
COMMON = [os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "64", "--max-position-embeddings", "1024", "--micro-batch-size", "4", "--lr", "3e-3",
          "--mock-data", "--threads", "2", "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.2",
          "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
          "--ffn-hidden-size", "96", "--attention-dropout", "0", "--hidden-dropout", "0", "--disable-bias-linear",
          "--swiglu", "--group-query-attention", "--num-query-groups", "2", "--rotary-base", "1000000",
          "--num-experts", "4", "--moe-ffn-hidden-size", "40", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
TRAIN = COMMON + ["--qk-layernorm", "--kv-channels", "24"]
# Qwen2-MoE: no query/key norms, q, k, v biased, a shared expert of 48 with its sigmoid gate.
QWEN2 = COMMON + ["--add-qkv-bias", "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate"]
CONVERT = os.path.join(BIN, "ptk-convert")


def export(ck, hf, expect=0):
    return run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", hf], expect)


def moved(cls, hf, model, what, **kwargs):
    other = cls.from_pretrained(hf, **kwargs).eval()
    worst = max(float(numpy.abs(hf_logits(other, s) - hf_logits(model, s)).max()) for s in SEQS)
    check(worst > 10 * TOL, "{} changes the logits by only {}: too weak a test".format(what, worst))


with tempfile.TemporaryDirectory() as tmp:
    QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 24}
    for tag, cls, flags, want in (
            ("dense-first", Qwen3MoeForCausalLM, TRAIN + ["--moe-layer-freq", "[0,1]", "--untie-embeddings-and-output-weights"],
             dict(QWEN3, mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False)),
            ("pre-softmax", Qwen3MoeForCausalLM, TRAIN + ["--moe-router-pre-softmax"],
             dict(QWEN3, mlp_only_layers=[], norm_topk_prob=False, tie_word_embeddings=True)),
            ("qwen2-moe", Qwen2MoeForCausalLM, QWEN2 + ["--moe-layer-freq", "[0,1]"],
             {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "mlp_only_layers": [0],
              "norm_topk_prob": True, "qkv_bias": True, "shared_expert_intermediate_size": 48})):
        ck, hf = os.path.join(tmp, "ck-" + tag), os.path.join(tmp, "hf-" + tag)
        run(flags + ["--train-iters", "12", "--save", ck])
        export(ck, hf)
        model = load_checked(cls, hf)
        compare_logits(ck, model, SEQS, 50257, tmp, tag)
        config = json.load(open(os.path.join(hf, "config.json")))
        want.update({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                     "intermediate_size": 96, "decoder_sparse_step": 1, "num_key_value_heads": 2,
                     "rope_theta": 1000000.0, "use_sliding_window": False, "router_aux_loss_coef": 0.01})
        check(all(config.get(k) == v for k, v in want.items()),
              "{}: config.json: {}".format(tag, {k: config.get(k) for k in want if config.get(k) != want[k]}))
        moved(cls, hf, model, tag + ": norm_topk_prob flipped", norm_topk_prob=not want["norm_topk_prob"])
        if cls is Qwen2MoeForCausalLM:  # the gate matters: zeroed, sigmoid 0.5 scales the shared expert
            gated = cls.from_pretrained(hf).eval()
            with torch.no_grad():
                gated.model.layers[1].mlp.shared_expert_gate.weight.zero_()
            worst = max(float(numpy.abs(hf_logits(gated, s) - hf_logits(model, s)).max()) for s in SEQS)
            check(worst > 10 * TOL, "the shared expert's gate changes the logits by only {}".format(worst))
        # ---- export -> import -> export, byte for byte; fine-tuning from the import
        back, hf2 = os.path.join(tmp, "back-" + tag), os.path.join(tmp, "hf2-" + tag)
        out = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hf, "--save-dir", back])
        check_finetune(out, back)
        export(back, hf2)
        for name in sorted(os.listdir(hf)):
            check(open(os.path.join(hf, name), "rb").read() == open(os.path.join(hf2, name), "rb").read(),
                  "{}: export -> import -> export: {} differs".format(tag, name))

    # ---- shared experts: Qwen3-MoE has none
    ck, hf = os.path.join(tmp, "ck-shared"), os.path.join(tmp, "hf-shared")
    run(TRAIN + ["--moe-shared-expert-intermediate-size", "32", "--train-iters", "1", "--save", ck])
    out = export(ck, hf, expect=1)
    check("--moe-shared-expert-intermediate-size 32 (Qwen3-MoE has no shared experts)" in out, out)
    check(not os.path.exists(hf), "a refused export wrote " + hf)
    # ---- an ungated shared expert: Qwen2-MoE's is always gated
    ck, hf = os.path.join(tmp, "ck-ungated"), os.path.join(tmp, "hf-ungated")
    run(COMMON + ["--moe-shared-expert-intermediate-size", "32", "--train-iters", "1", "--save", ck])
    out = export(ck, hf, expect=1)
    check("without --moe-shared-expert-gate" in out, out)
    check(not os.path.exists(hf), "a refused export wrote " + hf)
finish("hf_qwen3_moe_test")
