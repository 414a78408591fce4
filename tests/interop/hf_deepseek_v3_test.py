#!/usr/bin/env python3
"""ptk-convert's DeepseekV3ForCausalLM export and import of ptk-train's multi-latent attention models against Hugging
Face transformers itself: 4.51.3 (the first with DeepSeek-V3) from /opt/ptk-pyref/transformers-qwen3 on Debian's torch
1.13 with tests/support/torch2_shim.py, as hf_qwen3_moe_test.py. Without that folder the test says so in a banner and
exits 77 (skipped); under CI (CI=true) it fails instead.

Checks:
  * a DeepSeek-V3 model trained by ptk-train (MLA with a query latent of 16, a key/value latent of 12, 8 + 8 query
    and key channels per head, 6 value channels, --qk-layernorm's latent norms; YaRN at factor 4 with mscale 0.8
    and mscale_all_dim 0.6; the first layer dense, then 4 SwiGLU experts of 16 in 2 groups, top 2 of 1 group,
    sigmoid scores with the expert bias moved by a fast update rate, scaled by 2.5, 2 shared experts' width; untied)
    exported with --saver hf loads with DeepseekV3ForCausalLM.from_pretrained with no missing, unexpected or
    mismatched weight and no warning; its logits equal ptk's Forward (logits_tool) within 1e-4; zeroing the
    e_score_correction_bias, or rope_interleave false, moves the logits past the tolerance (the expert bias and the
    rotary layout are the ones ptk computes);
  * the same with plain RoPE, every layer a mixture without groups, top 1 (norm_topk_prob false), tied;
  * without --q-lora-rank (q_proj, which transformers 4.51.3's DeepseekV3Attention cannot build: it always makes
    q_a_proj) against transformers 4.53.3 from /opt/ptk-pyref/transformers-dsv3 in a subprocess, where that folder
    is there (it needs torch 2.1 or later; a banner says NOT CHECKED otherwise);
  * a dense MLA model (no experts: first_k_dense_replace = num_hidden_layers);
  * export -> import -> export is byte-identical; ptk-train --finetune trains on from the import with the flags
    ptk-convert prints;
  * what DeepSeek-V3 cannot compute is refused (exit 1, one line naming the flag, nothing written): MLA without
    --qk-layernorm, a softmax router, MTP layers.
Usage: hf_deepseek_v3_test.py BIN_DIR TEST_BIN_DIR
"""
import json
import os
import random
import subprocess
import sys
import tempfile

os.environ["PTK_HF_REFERENCE"] = "qwen3"  # hf_test_common: transformers 4.51.3 from transformers-qwen3
from hf_test_common import (BIN, TOL, check, check_finetune, compare_logits, finish, hf_logits, load_checked,  # noqa: E402
                            numpy, ptk_logits, run, torch)
from transformers import DeepseekV3ForCausalLM  # noqa: E402

rng = random.Random(47)
SEQS = [[50256], [464, 2106, 286, 262, 995, 318, 257]] + [[rng.randrange(50257) for _ in range(n)] for n in (33, 64)]
COMMON = [os.path.join(BIN, "ptk-train"), "--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "64", "--micro-batch-size", "4", "--lr", "3e-3", "--mock-data", "--threads", "2",
          "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.2", "--normalization", "RMSNorm",
          "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--ffn-hidden-size", "48",
          "--attention-dropout", "0", "--hidden-dropout", "0", "--disable-bias-linear", "--swiglu", "--qk-layernorm",
          "--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8",
          "--v-head-dim", "6", "--rotary-base", "10000"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
       "--moe-shared-expert-intermediate-size", "32"]
YARN = COMMON + MOE + ["--q-lora-rank", "16", "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.8",
                       "--mscale-all-dim", "0.6", "--max-position-embeddings", "16384", "--moe-router-topk", "2",
                       "--moe-router-topk-scaling-factor", "2.5", "--moe-layer-freq", "[0,1,1]",
                       "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                       "--untie-embeddings-and-output-weights"]
ROPE = COMMON + MOE + ["--q-lora-rank", "16", "--rope-type", "rope", "--max-position-embeddings", "1024",
                       "--moe-router-topk", "1"]
DENSE = COMMON + ["--q-lora-rank", "16", "--rope-type", "rope", "--max-position-embeddings", "1024"]
CONVERT = os.path.join(BIN, "ptk-convert")
# transformers 4.53.3 (q_proj without a query latent), run apart from 4.51.3: its logits of each sequence as float32.
DSV3 = [d for d in (os.path.join(r, "transformers-dsv3") for r in (os.environ.get("PTK_PYREF_DIR"), "/opt/ptk-pyref")
                    if r) if os.path.isdir(d)]
QPROJ = """
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy, torch, transformers
from transformers import DeepseekV3ForCausalLM
m = DeepseekV3ForCausalLM.from_pretrained(sys.argv[2]).eval()
with torch.no_grad():
    out = [m(torch.tensor([s]), use_cache=False).logits[0].numpy() for s in json.loads(sys.argv[3])]
numpy.concatenate(out).astype(numpy.float32).tofile(sys.argv[4])
print("transformers", transformers.__version__)
"""


def export(ck, hf, expect=0):
    return run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", hf], expect)


def moved(model, other, what):
    worst = max(float(numpy.abs(hf_logits(other, s) - hf_logits(model, s)).max()) for s in SEQS)
    check(worst > 10 * TOL, "{} changes the logits by only {}: too weak a test".format(what, worst))


with tempfile.TemporaryDirectory() as tmp:
    for tag, flags in (("yarn-grouped", YARN), ("rope-top1", ROPE), ("dense", DENSE)):
        ck, hf = os.path.join(tmp, "ck-" + tag), os.path.join(tmp, "hf-" + tag)
        run(flags + ["--train-iters", "12", "--save", ck])
        export(ck, hf)
        model = load_checked(DeepseekV3ForCausalLM, hf)
        compare_logits(ck, model, SEQS, 50257, tmp, tag)
        moved(model, DeepseekV3ForCausalLM.from_pretrained(hf, rope_interleave=False).eval(),
              tag + ": rope_interleave false")
        if tag != "dense":  # the expert bias chooses experts: zeroed, other experts answer
            unbiased = DeepseekV3ForCausalLM.from_pretrained(hf).eval()
            gates = [layer.mlp.gate for layer in unbiased.model.layers if hasattr(layer.mlp, "gate")]
            check(max(float(g.e_score_correction_bias.abs().max()) for g in gates) > 0,
                  tag + ": the exported expert biases are zero")
            with torch.no_grad():
                for g in gates:
                    g.e_score_correction_bias.zero_()
            moved(model, unbiased, tag + ": e_score_correction_bias zeroed")
        # ---- export -> import -> export, byte for byte; fine-tuning from the import
        back, hf2 = os.path.join(tmp, "back-" + tag), os.path.join(tmp, "hf2-" + tag)
        out = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hf, "--save-dir", back])
        check_finetune(out, back)
        export(back, hf2)
        for name in sorted(os.listdir(hf)):
            check(open(os.path.join(hf, name), "rb").read() == open(os.path.join(hf2, name), "rb").read(),
                  "{}: export -> import -> export: {} differs".format(tag, name))

    # ---- no query latent: q_proj, against transformers 4.53.3
    ck, hf, out = os.path.join(tmp, "ck-qproj"), os.path.join(tmp, "hf-qproj"), os.path.join(tmp, "qproj.f32")
    run(COMMON + MOE + ["--rope-type", "rope", "--max-position-embeddings", "1024", "--moe-router-topk", "2",
                        "--train-iters", "6", "--save", ck])
    export(ck, hf)
    r = subprocess.run([sys.executable, "-c", QPROJ, DSV3[0], hf, json.dumps(SEQS), out], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True) if DSV3 else None
    if r is None or r.returncode != 0:
        print("!" * 80 + "\nq_proj NOT CHECKED against transformers 4.53.3: {}\n".format(
            "no transformers-dsv3 folder" if r is None else r.stdout[-500:]) + "!" * 80)
    else:
        theirs, at = numpy.fromfile(out, dtype=numpy.float32), 0
        worst = 0.0
        for seq, ours in zip(SEQS, ptk_logits(ck, SEQS, 50257, tmp)):
            worst = max(worst, float(numpy.abs(theirs[at:at + ours.size] - ours.ravel()).max()))
            at += ours.size
        check(at == theirs.size and worst <= TOL, "q_proj: logits differ by {} ({})".format(worst, r.stdout))
        print("q_proj: ptk's and {}'s logits differ by at most {:.3g}".format(r.stdout.strip(), worst))

    # ---- refusals: one line naming the flag, nothing written
    for tag, flags, want in (
            ("no-latent-norms", [f for f in DENSE if f != "--qk-layernorm"], "without --qk-layernorm"),
            ("softmax", COMMON + ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "32",
                                  "--max-position-embeddings", "1024", "--rope-type", "rope"],
             "--moe-router-score-function softmax"),
            ("mtp", DENSE + ["--mtp-num-layers", "1"], "--mtp-num-layers 1")):
        ck, hf = os.path.join(tmp, "ck-" + tag), os.path.join(tmp, "hf-" + tag)
        run(flags + ["--train-iters", "1", "--save", ck])
        out = export(ck, hf, expect=1)
        check(want in out, "{}: {}".format(tag, out))
        check(not os.path.exists(hf), "a refused export wrote " + hf)
finish("hf_deepseek_v3_test")
