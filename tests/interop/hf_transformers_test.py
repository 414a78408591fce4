#!/usr/bin/env python3
"""ptk-convert against Hugging Face transformers itself (4.44.2 from PyPI on Debian's torch 1.13,
CPU; installed by scripts/install-deps.sh --with-python-ref into /opt/ptk-pyref).

Checks:
  * a model trained by ptk-train (tied, and untied) and exported with --saver hf loads with
    GPT2LMHeadModel.from_pretrained with no missing, unexpected or mismatched weight and no warning;
    its logits equal ptk's Forward (logits_tool) within 1e-4 on several sequences (1 to 64 tokens);
  * the exported tokenizer (AutoTokenizer on the directory) encodes as ptk's, and HF's greedy
    generation continues ptk-train's --sample-prompt with ptk-train's printed sample;
  * a model saved by transformers (save_pretrained, safetensors) imported with --saver ptk gives
    ptk the same logits within 1e-4, and ptk-train --load ... --finetune (and --no-load-optim)
    trains on from it with the flags ptk-convert prints; export -> import -> export is byte-identical;
  * sharded: an export with --max-shard-size 100KB loads with from_pretrained to the same logits and is sharded
    as save_pretrained(max_shard_size="100KB") shards it (files, tensors, index byte for byte); transformers'
    model saved with max_shard_size="200KB" imports bit for bit as its unsharded save;
  * safetensors' own reader opens ptk's file;
  * a --squared-relu --apply-layernorm-1p model exports as relu2 with 1 + gamma norms, logits as ptk's;
  * a --no-bias-gelu-fusion model (the exact erf GELU) exports as gelu, logits as ptk's, and imports back.
Usage: hf_transformers_test.py BIN_DIR TEST_BIN_DIR
"""
import os
import random
import re
import tempfile

from hf_test_common import (BIN, TEST_BIN, TOL, check, check_finetune, check_sharded_export, check_sharded_import,
                            finish, hf_logits, load_checked, numpy, run, torch, train_from_import,
                            compare_logits as compare_with)
from safetensors import safe_open
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel


def load_hf(path):
    return load_checked(GPT2LMHeadModel, path)


def compare_logits(ckpt, hf_dir, seqs, vocab, tmp, what):
    return compare_with(ckpt, load_hf(hf_dir) if isinstance(hf_dir, str) else hf_dir, seqs, vocab, tmp, what)


rng = random.Random(31)
SEQS = [[50256], [464, 2106, 286, 262, 995, 318, 257]] + [[rng.randrange(50257) for _ in range(n)] for n in (33, 64)]
SEQS.append([50256] * 5 + [rng.randrange(50257) for _ in range(20)])
TRAIN = [os.path.join(BIN, "ptk-train"), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "4", "--lr", "3e-3", "--mock-data", "--threads", "2",
         "--eval-iters", "0", "--log-interval", "10", "--layernorm-epsilon", "1e-6", "--init-method-std", "0.2"]
CONVERT = os.path.join(BIN, "ptk-convert")

with tempfile.TemporaryDirectory() as tmp:
    # ---- tied: trained, sampled, exported, loaded, compared
    ck, hf = os.path.join(tmp, "ck"), os.path.join(tmp, "hf")
    prompt = "The history of the"
    out = run(TRAIN + ["--train-iters", "20", "--save", ck, "--sample-interval", "20", "--sample-prompt", prompt,
                       "--sample-length", "8"])
    sample = re.search(r' sample at iteration +20 \(greedy\): "The history of the" -> "(.*)"\n', out)
    check(sample is not None, "ptk-train printed its sample:\n" + out[-2000:])
    run([CONVERT, "--model-type", "GPT", "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", hf])
    model = compare_logits(ck, hf, SEQS, 50257, tmp, "tied")
    # The test can tell: the exact GELU in place of the tanh one moves the logits past the tolerance.
    exact = GPT2LMHeadModel.from_pretrained(hf, activation_function="gelu").eval()
    worst = max(float(numpy.abs(hf_logits(exact, s) - hf_logits(model, s)).max()) for s in SEQS)
    check(worst > 10 * TOL, "the exact GELU changes the logits by only {}: the model is too weak a test".format(worst))
    config = GPT2Config.from_pretrained(hf)
    check(config.activation_function == "gelu_new" and config.n_positions == 64 and config.vocab_size == 50257
          and config.layer_norm_epsilon == 1e-6 and config.tie_word_embeddings, "config.json: {}".format(config))
    with safe_open(os.path.join(hf, "model.safetensors"), framework="pt") as f:
        check(f.metadata() == {"format": "pt"} and "transformer.h.1.attn.c_attn.weight" in f.keys(),
              "safetensors' reader: {} {}".format(f.metadata(), sorted(f.keys())[:3]))
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(prompt)["input_ids"]
    check(ids == [464, 2106, 286, 262], "the exported tokenizer encodes {!r} as {}".format(prompt, ids))
    gen = list(ids)  # greedy through transformers' forward, past <|endoftext|> as ptk-train's sample goes
    for _ in range(8):
        gen.append(int(hf_logits(model, gen)[-1].argmax()))
    gen = torch.tensor(gen[len(ids):])
    ptk_ids = [int(x) for x in run([os.path.join(TEST_BIN, "logits_tool"), ck, "--generate", "8"]
                                   + [str(i) for i in ids]).split()]
    check(gen.tolist() == ptk_ids, "greedy continuation: transformers {} ptk {}".format(gen.tolist(), ptk_ids))
    if sample and "\\" not in sample.group(1):  # the printed text is escaped ({:?}) only where it must be
        check(tok.decode(gen) == sample.group(1),
              "transformers' greedy text {!r} vs ptk-train's sample {!r}".format(tok.decode(gen), sample.group(1)))

    # ---- export -> import -> export, byte for byte
    back, hf2 = os.path.join(tmp, "back"), os.path.join(tmp, "hf2")
    run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hf, "--save-dir", back])
    run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", back, "--save-dir", hf2])
    for name in sorted(os.listdir(hf)):
        check(open(os.path.join(hf, name), "rb").read() == open(os.path.join(hf2, name), "rb").read(),
              "export -> import -> export: {} differs".format(name))

    # ---- sharded: a tiny --max-shard-size, loaded by from_pretrained; the shards save_pretrained writes;
    # re-exported with fewer shards, none of the earlier ones left
    hfs = os.path.join(tmp, "hfs")
    run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", hfs, "--max-shard-size", "100KB"])
    check_sharded_export(hfs, compare_logits(ck, hfs, SEQS, 50257, tmp, "sharded"), "100KB", tmp, "sharded")
    run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ck, "--save-dir", hfs, "--max-shard-size", "1MB"])
    check(sorted(f for f in os.listdir(hfs) if f.startswith("model")) ==
          ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"],
          "re-exported with 1MB shards: {}".format(sorted(os.listdir(hfs))))
    compare_logits(ck, hfs, SEQS[:2], 50257, tmp, "sharded 1MB")

    # ---- untied output layer: lm_head.weight with tie_word_embeddings false
    cku, hfu = os.path.join(tmp, "cku"), os.path.join(tmp, "hfu")
    run(TRAIN + ["--train-iters", "6", "--save", cku, "--untie-embeddings-and-output-weights"])
    run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", cku, "--save-dir", hfu])
    mu = compare_logits(cku, hfu, SEQS, 50257, tmp, "untied")
    check(not mu.config.tie_word_embeddings and
          not torch.equal(mu.lm_head.weight, mu.transformer.wte.weight), "untied: lm_head is its own tensor")

    # ---- Megatron's --squared-relu (GPT-2's relu2) and --apply-layernorm-1p (1 + gamma folded into the
    # exported norm weights): transformers computes ptk's logits
    ckr, hfr = os.path.join(tmp, "ckr"), os.path.join(tmp, "hfr")
    run(TRAIN + ["--train-iters", "6", "--save", ckr, "--squared-relu", "--apply-layernorm-1p"])
    run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", ckr, "--save-dir", hfr])
    mr = compare_logits(ckr, hfr, SEQS, 50257, tmp, "squared relu, layernorm 1p")
    check(mr.config.activation_function == "relu2", "squared relu: config {}".format(mr.config))
    # ... and back: relu2 imports as --squared-relu (its norms plain ones), the logits kept, and ptk-train
    # --finetune loads it with the flags the import prints.
    ckr2 = os.path.join(tmp, "ckr2")
    out = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfr, "--save-dir", ckr2])
    compare_logits(ckr2, mr, SEQS, 50257, tmp, "relu2 imported")
    check("--squared-relu" in (check_finetune(out, ckr2) or []), "relu2's import flags:\n" + out)

    # ---- Megatron's unfused GELU MLP (--no-bias-gelu-fusion): torch's exact erf GELU, GPT-2's "gelu"
    # (GELUActivation, F.gelu): transformers computes ptk's logits, and "gelu" imports back as it.
    cke, hfe = os.path.join(tmp, "cke"), os.path.join(tmp, "hfe")
    run(TRAIN + ["--train-iters", "6", "--save", cke, "--no-bias-gelu-fusion"])
    run([CONVERT, "--loader", "ptk", "--saver", "hf", "--load-dir", cke, "--save-dir", hfe])
    me = compare_logits(cke, hfe, SEQS, 50257, tmp, "exact gelu")
    check(me.config.activation_function == "gelu", "exact gelu: config {}".format(me.config))
    cke2 = os.path.join(tmp, "cke2")
    out = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfe, "--save-dir", cke2])
    compare_logits(cke2, me, SEQS, 50257, tmp, "gelu imported")
    check("--no-bias-gelu-fusion" in (check_finetune(out, cke2) or []), "gelu's import flags:\n" + out)

    # ---- a model transformers made, imported into ptk
    torch.manual_seed(31)
    src = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=48, n_head=3, n_positions=40, vocab_size=50257,
                                     initializer_range=0.1, layer_norm_epsilon=1e-5)).eval()
    with torch.no_grad():  # LayerNorms and biases away from their 1/0 init, so they are tested too
        for name, p in src.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    hfsrc, ckin = os.path.join(tmp, "hfsrc"), os.path.join(tmp, "ckin")
    src.save_pretrained(hfsrc, safe_serialization=True)
    out = run([CONVERT, "--loader", "hf", "--saver", "ptk", "--load-dir", hfsrc, "--save-dir", ckin])
    compare_logits(ckin, src, [s for s in SEQS if len(s) <= 40], 50257, tmp, "imported")
    check_sharded_import(src, "200KB", ckin, tmp, "imported-sharded")
    flags = check_finetune(out, ckin)
    if flags:
        tr = train_from_import(flags, ckin, "--no-load-optim")
        check("loaded checkpoint" in tr and " iteration        2/       2 |" in tr,
              "ptk-train --no-load-optim from the import:\n" + tr)

finish("hf_transformers_test")
