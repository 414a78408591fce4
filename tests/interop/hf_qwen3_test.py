#!/usr/bin/env python3
"""ptk-convert's Qwen3ForCausalLM export and import (Megatron's Llama line with --qk-layernorm) against Hugging Face
transformers itself: 4.51.3, the first release with Qwen3, from PyPI into /opt/ptk-pyref/transformers-qwen3 (by
scripts/install-deps.sh --with-python-ref, beside the 4.44.2 the other tests use), on Debian's torch 1.13 with
tests/support/torch2_shim.py. Without that folder the test says so in a banner and exits 77 (skipped); under CI
(CI=true) it fails instead.

Checks:
  * a Qwen3-shaped model trained by ptk-train (RMSNorm, --qk-layernorm, RoPE base 1000000, SwiGLU, 4 query heads
    in 2 groups of head_dim 24 (not hidden / heads), untied, no biases) and exported with --saver hf loads with
    AutoModelForCausalLM.from_pretrained as Qwen3ForCausalLM with no missing, unexpected or mismatched weight and no
    warning; the exported tokenizer loads with AutoTokenizer; its logits equal ptk's Forward (logits_tool)
    within TOL (1e-4) on several sequences (generate is
    hf_llama_test's: transformers 4.51's imports torch.distributed.fsdp, which Debian's torch 1.13 cannot import
    on Python 3.11);
  * a tied one with Llama 3.1's rope_scaling (Qwen3's rotary embedding takes any of transformers' rope types), the
    same;
  * config.json: every argument of Qwen3Config's constructor written (no value left to a transformers default),
    the values transformers reads as ptk's (head_dim, rope_theta, rope_scaling, rms_norm_eps,
    tie_word_embeddings, attention_bias, use_sliding_window, ...), and the test can tell (another rope_theta or no
    rope_scaling moves the logits past the tolerance);
  * a Qwen3ForCausalLM made by transformers (random init, query groups, head_dim 16 with hidden 48 and 6 heads,
    untied; a tied one with transformers' default sliding_window 4096 and use_sliding_window false; one saved in
    bfloat16; one whose
    config.json leaves out every key at Qwen3Config's default, num_key_value_heads 32 and head_dim 128 among them,
    with rope_scaling {"rope_type": "default"}) and saved with save_pretrained, imported with --saver ptk, gives
    the same logits; ptk-train --finetune trains on from it with the flags ptk-convert prints; hf -> ptk -> hf
    gives back every tensor bit for bit and the config's values.
Usage: hf_qwen3_test.py BIN_DIR TEST_BIN_DIR
"""
import inspect
import json
import os
import random
import tempfile

os.environ["PTK_HF_REFERENCE"] = "qwen3"  # hf_test_common: transformers 4.51.3 from transformers-qwen3
from hf_test_common import (BIN, TEST_BIN, TOL, check, check_finetune, compare_logits, finish, hf_logits, load_checked, numpy, run,
                            torch, transformers)
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

check(transformers.__version__ == "4.51.3", "transformers {} imported, 4.51.3 expected".format(transformers.__version__))
print("transformers {} from {}, torch {}".format(transformers.__version__, os.path.dirname(transformers.__file__),
                                                 torch.__version__))
CONVERT = os.path.join(BIN, "ptk-convert")
rng = random.Random(51)
SEQS = [[50256], [464, 2106, 286, 262, 995, 318, 257]] + [[rng.randrange(50257) for _ in range(n)] for n in (33, 64)]
TRAIN = [os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "4", "--lr", "3e-3", "--mock-data", "--threads", "2",
         "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.2", "--normalization", "RMSNorm",
         "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--swiglu", "--ffn-hidden-size", "96",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--qk-layernorm", "--disable-bias-linear"]
QWEN3 = ["--max-position-embeddings", "4096", "--rotary-base", "1000000", "--kv-channels", "24",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights"]
# max_position_embeddings above Llama 3.1's original context, as its configs have it (transformers warns otherwise).
TIED_SCALED = ["--max-position-embeddings", "16384", "--rotary-base", "500000", "--use-rope-scaling"]
# Qwen3Config's constructor arguments: each one is in ptk's config.json, so no value is transformers' default.
QWEN3_KEYS = sorted(k for k in inspect.signature(Qwen3Config.__init__).parameters if k not in ("self", "kwargs"))


def tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def export(ck, hf):
    return run([CONVERT, "--model-type", "GPT", "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", hf])


def check_config(hf, model, want, what):
    """config.json holds `want` and every Qwen3Config argument; transformers reads each value as written."""
    config = json.load(open(os.path.join(hf, "config.json")))
    check(not [k for k in QWEN3_KEYS if k not in config],
          "{}: config.json lacks {}".format(what, [k for k in QWEN3_KEYS if k not in config]))
    check(all(config.get(k) == v for k, v in want.items()),
          "{}: config.json {}".format(what, {k: config.get(k) for k in want if config.get(k) != want[k]}))
    read = model.config.to_dict()
    check(all(read.get(k) == config[k] for k in QWEN3_KEYS if k in config),
          "{}: transformers reads {}".format(what, {k: (config[k], read.get(k)) for k in QWEN3_KEYS
                                                   if k in config and read.get(k) != config[k]}))
    attention = model.model.layers[0].self_attn
    check(attention.head_dim == config["head_dim"] and attention.sliding_window is None,
          "{}: Qwen3Attention head_dim {} sliding_window {}".format(what, attention.head_dim, attention.sliding_window))


def check_sensitive(hf, model, changes, what):
    """The comparison can tell: each change of the config moves transformers' logits past 10 TOL."""
    for name, kwargs in changes:
        other = AutoModelForCausalLM.from_pretrained(hf, **kwargs).eval()
        worst = max(float(numpy.abs(hf_logits(other, s) - hf_logits(model, s)).max()) for s in SEQS)
        check(worst > 10 * TOL, "{}: {} changes the logits by only {}: too weak a test".format(what, name, worst))


def ptk_to_hf(tmp):
    """Models ptk-train trained, exported and loaded by transformers."""
    ck, hf = os.path.join(tmp, "ck"), os.path.join(tmp, "hf")
    run(TRAIN + QWEN3 + ["--train-iters", "20", "--save", ck])
    export(ck, hf)
    model = load_checked(AutoModelForCausalLM, hf)
    check(type(model) is Qwen3ForCausalLM, "AutoModelForCausalLM made a {}".format(type(model).__name__))
    compare_logits(ck, model, SEQS, 50257, tmp, "qwen3")
    check_config(hf, model, {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 96,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "vocab_size": 50257,
        "max_position_embeddings": 4096, "hidden_act": "silu", "torch_dtype": "float32"}, "qwen3")
    check(float((model.model.layers[1].self_attn.k_norm.weight - 1).abs().max()) > 1e-3,
          "k_norm's weights were trained away from 1")
    check_sensitive(hf, model, (("rope_theta 10000", {"rope_theta": 10000.0}),), "qwen3")
    ids = AutoTokenizer.from_pretrained(hf)("The history of the")["input_ids"]
    check(ids == [464, 2106, 286, 262], "the exported tokenizer encodes 'The history of the' as {}".format(ids))

    ckb, hfb = os.path.join(tmp, "ckb"), os.path.join(tmp, "hfb")
    run(TRAIN + TIED_SCALED + ["--train-iters", "6", "--save", ckb])
    export(ckb, hfb)
    mb = load_checked(AutoModelForCausalLM, hfb)
    compare_logits(ckb, mb, SEQS, 50257, tmp, "tied, rope_scaling")
    check_config(hfb, mb, {
        "num_key_value_heads": 4, "head_dim": 16, "tie_word_embeddings": True, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}}, "tied, rope_scaling")
    check(mb.lm_head.weight.data_ptr() == mb.model.embed_tokens.weight.data_ptr(), "tied: lm_head is not the embedding")
    check_sensitive(hfb, mb, (("no rope_scaling", {"rope_scaling": None}),), "tied, rope_scaling")


def made_by_transformers(tmp, name, seed, dtype=torch.float32, **config):
    """A Qwen3ForCausalLM of `config` and where it is saved in `dtype`."""
    torch.manual_seed(seed)
    src = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, hidden_size=48, intermediate_size=80, vocab_size=50257,
                                       initializer_range=0.1, **config)).eval()
    with torch.no_grad():  # the RMSNorm weights (q_norm and k_norm too) away from their 1 init, so they are tested
        for _, p in src.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    path = os.path.join(tmp, name)
    src.to(dtype).save_pretrained(path, safe_serialization=True)
    return src, path


def hf_to_ptk(tmp):
    """Qwen3 models transformers made, imported into ptk, trained on, and back."""
    src, hfsrc = made_by_transformers(tmp, "hfsrc", 51, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                      tie_word_embeddings=False)
    ckin, hfout = os.path.join(tmp, "ckin"), os.path.join(tmp, "hfout")
    out = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfsrc, "--save-dir", ckin])
    compare_logits(ckin, src, SEQS, 50257, tmp, "imported")
    export(ckin, hfout)
    a, b = tensors(hfsrc), tensors(hfout)
    check(sorted(a) == sorted(b), "hf -> ptk -> hf: tensors {}".format(sorted(set(a) ^ set(b))[:4]))
    for k in sorted(set(a) & set(b)):
        check(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), "hf -> ptk -> hf: {} differs".format(k))
    ca, cb = src.config.to_dict(), Qwen3Config.from_pretrained(hfout).to_dict()
    # With use_sliding_window false, ptk writes sliding_window null (no mask in any transformers: 4.51 masks
    # by sliding_window alone) and max_window_layers num_hidden_layers (as Qwen's own configs); neither
    # changes the model.
    for k in QWEN3_KEYS:
        check(k in ("sliding_window", "max_window_layers") or ca[k] == cb[k],
              "hf -> ptk -> hf: config {} {} -> {}".format(k, ca[k], cb[k]))
    check(cb["sliding_window"] is None and cb["max_window_layers"] == 2 and not cb["use_sliding_window"],
          "hf -> ptk -> hf: sliding_window {sliding_window} max_window_layers {max_window_layers}".format(**cb))
    check_finetune(out, ckin)

    # Tied, multi-head, Qwen3Config's defaults for what is not given (rope_theta 10000, rms_norm_eps 1e-6,
    # sliding_window 4096 with use_sliding_window false: full causal attention, as ptk computes).
    src2, hfsrc2 = made_by_transformers(tmp, "hfsrc2", 52, num_attention_heads=4, num_key_value_heads=4,
                                        head_dim=12, tie_word_embeddings=True)
    check(json.load(open(os.path.join(hfsrc2, "config.json"))).get("sliding_window") == 4096,
          "transformers' Qwen3Config no longer writes sliding_window 4096 by default")
    ckin2 = os.path.join(tmp, "ckin2")
    out = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfsrc2, "--save-dir", ckin2])
    check("sliding_window 4096 with use_sliding_window false: ptk attends over the whole sequence" in out,
          "ptk-convert notes transformers 4.51's mask beyond sliding_window:\n" + out)
    compare_logits(ckin2, src2, SEQS, 50257, tmp, "imported, tied")

    # Saved in bfloat16, as Qwen's own checkpoints are: widened to fp32 by the import, the logits of
    # from_pretrained's float32 model (the bfloat16 model itself has its RoPE frequencies rounded too).
    _, hfsrc4 = made_by_transformers(tmp, "hfsrc4", 54, dtype=torch.bfloat16, num_attention_heads=6,
                                     num_key_value_heads=3, head_dim=16)
    src4 = load_checked(AutoModelForCausalLM, hfsrc4)
    check(src4.model.embed_tokens.weight.dtype == torch.float32, "bfloat16: from_pretrained did not widen")
    check(json.load(open(os.path.join(hfsrc4, "config.json")))["torch_dtype"] == "bfloat16" and
          tensors(hfsrc4)["model.norm.weight"].dtype == torch.bfloat16, "bfloat16: not saved as bfloat16")
    ckin4 = os.path.join(tmp, "ckin4")
    run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfsrc4, "--save-dir", ckin4])
    compare_logits(ckin4, src4, SEQS, 50257, tmp, "imported, bfloat16")

    # A config.json that leaves every key at Qwen3Config's default out (num_key_value_heads 32, head_dim 128,
    # rope_theta, rms_norm_eps, ...) and has rope_scaling {"rope_type": "default"}: ptk reads what
    # transformers reads (it took num_key_value_heads absent as one per query head, and refused the
    # rope_scaling).
    src3, hfsrc3 = made_by_transformers(tmp, "hfsrc3", 53, num_attention_heads=64, tie_word_embeddings=True)
    check(src3.config.num_key_value_heads == 32 and src3.config.head_dim == 128, "Qwen3Config's defaults changed")
    path = os.path.join(hfsrc3, "config.json")
    config, defaults = json.load(open(path)), Qwen3Config().to_dict()
    config = {k: v for k, v in config.items() if k not in QWEN3_KEYS or k == "tie_word_embeddings" or v != defaults[k]}
    check(sorted(k for k in QWEN3_KEYS if k in config) == ["hidden_size", "initializer_range", "intermediate_size",
                                                          "num_attention_heads", "num_hidden_layers",
                                                          "tie_word_embeddings", "vocab_size"],
          "defaults: config.json keeps {}".format(sorted(config)))
    config["rope_scaling"] = {"rope_type": "default"}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    src3 = load_checked(AutoModelForCausalLM, hfsrc3)
    check(src3.config.num_key_value_heads == 32 and src3.config.head_dim == 128, "defaults: {}".format(src3.config))
    ckin3 = os.path.join(tmp, "ckin3")
    run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfsrc3, "--save-dir", ckin3])
    compare_logits(ckin3, src3, SEQS, 50257, tmp, "imported, Qwen3Config's defaults")


with tempfile.TemporaryDirectory() as tmp:
    ptk_to_hf(tmp)
    hf_to_ptk(tmp)

finish("hf_qwen3_test")
