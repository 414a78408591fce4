#!/usr/bin/env python3
"""ptk-convert's Qwen3MoeForCausalLM export of ptk-train's mixture-of-experts models (the Llama line with
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
  * shared experts are refused by the export (exit 1, one line naming the flag, nothing written).
Usage: hf_qwen3_moe_test.py BIN_DIR TEST_BIN_DIR
"""
import json
import os
import random
import tempfile

os.environ["PTK_HF_REFERENCE"] = "qwen3"  # hf_test_common: transformers 4.51.3 from transformers-qwen3
from hf_test_common import (BIN, TOL, check, check_finetune, compare_logits, finish, hf_logits, load_checked,  # noqa: E402
                            numpy, run)
from transformers import Qwen3MoeForCausalLM  # noqa: E402

rng = random.Random(46)
SEQS = [[50256], [464, 2106, 286, 262, 995, 318, 257]] + [[rng.randrange(50257) for _ in range(n)] for n in (33, 64)]
TRAIN = [os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "1024", "--micro-batch-size", "4", "--lr", "3e-3",
         "--mock-data", "--threads", "2", "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.2",
         "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
         "--ffn-hidden-size", "96", "--attention-dropout", "0", "--hidden-dropout", "0", "--disable-bias-linear",
         "--swiglu", "--qk-layernorm", "--kv-channels", "24", "--group-query-attention", "--num-query-groups", "2",
         "--rotary-base", "1000000", "--num-experts", "4", "--moe-ffn-hidden-size", "40", "--moe-router-topk", "2",
         "--moe-aux-loss-coeff", "0.01"]
CONVERT = os.path.join(BIN, "ptk-convert")


def export(ck, hf, expect=0):
    return run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", hf], expect)


def moved(hf, model, what, **kwargs):
    other = Qwen3MoeForCausalLM.from_pretrained(hf, **kwargs).eval()
    worst = max(float(numpy.abs(hf_logits(other, s) - hf_logits(model, s)).max()) for s in SEQS)
    check(worst > 10 * TOL, "{} changes the logits by only {}: too weak a test".format(what, worst))


with tempfile.TemporaryDirectory() as tmp:
    for tag, flags, want in (
            ("dense-first", ["--moe-layer-freq", "[0,1]", "--untie-embeddings-and-output-weights"],
             {"mlp_only_layers": [0], "norm_topk_prob": True, "tie_word_embeddings": False}),
            ("pre-softmax", ["--moe-router-pre-softmax"],
             {"mlp_only_layers": [], "norm_topk_prob": False, "tie_word_embeddings": True})):
        ck, hf = os.path.join(tmp, "ck-" + tag), os.path.join(tmp, "hf-" + tag)
        run(TRAIN + flags + ["--train-iters", "12", "--save", ck])
        export(ck, hf)
        model = load_checked(Qwen3MoeForCausalLM, hf)
        compare_logits(ck, model, SEQS, 50257, tmp, tag)
        config = json.load(open(os.path.join(hf, "config.json")))
        want.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 24,
                     "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                     "intermediate_size": 96, "decoder_sparse_step": 1, "num_key_value_heads": 2,
                     "rope_theta": 1000000.0, "use_sliding_window": False, "router_aux_loss_coef": 0.01})
        check(all(config.get(k) == v for k, v in want.items()),
              "{}: config.json: {}".format(tag, {k: config.get(k) for k in want if config.get(k) != want[k]}))
        moved(hf, model, tag + ": norm_topk_prob flipped", norm_topk_prob=not want["norm_topk_prob"])
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
finish("hf_qwen3_moe_test")
