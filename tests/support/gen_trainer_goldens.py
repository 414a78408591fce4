"""Writes the trainer goldens: Megatron's GPT (learned positions, pre-LayerNorm, tanh GELU, fused
QKV in Megatron's per-head [q k v] layout, tied or untied output layer, padded vocabulary) built
in PyTorch (float64, CPU) from given weights and inputs; logits, loss, every gradient, and the
weights after 10 AdamW steps with clipping and Megatron's cosine schedule with warm-up.
gpt_gelu_exact is the tied model with torch's exact GELU (F.gelu, approximate="none"), what
Megatron's GELU MLP runs without its fused bias-GELU kernel (--no-bias-gelu-fusion).

Usage: /usr/bin/python3 tests/support/gen_trainer_goldens.py OUT_DIR [NAME...]
Writes OUT_DIR/NAME.json (configuration, per-step figures, tensor directory) and OUT_DIR/NAME.bin
(the tensors, little-endian float32 / int32) for NAME in gpt_tied, gpt_untied, gpt_gelu_exact
(all three without names).
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

from golden_common import Weights, train, write_golden

torch.set_default_dtype(torch.float64)


class GPT(Weights):
    def forward(self, tokens, positions):
        c = self.cfg
        C, NH = c["hidden_size"], c["num_attention_heads"]
        hd = C // NH
        eps = c["layernorm_epsilon"]
        B, T = tokens.shape
        x = self.w("embedding.word_embeddings.weight")[tokens] + self.w("embedding.position_embeddings.weight")[positions]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for l in range(c["num_layers"]):
            p = f"decoder.layers.{l}."
            h = F.layer_norm(x, (C,), self.w(p + "input_layernorm.weight"), self.w(p + "input_layernorm.bias"), eps)
            qkv = F.linear(h, self.w(p + "self_attention.linear_qkv.weight"), self.w(p + "self_attention.linear_qkv.bias"))
            qkv = qkv.view(B, T, NH, 3, hd)
            q, k, v = (qkv[:, :, :, i, :].permute(0, 2, 1, 3) for i in range(3))  # (B, NH, T, hd)
            s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)
            s = s.masked_fill(~causal, float("-inf"))
            a = torch.softmax(s, dim=-1)
            y = torch.matmul(a, v).permute(0, 2, 1, 3).reshape(B, T, C)
            x = x + F.linear(y, self.w(p + "self_attention.linear_proj.weight"), self.w(p + "self_attention.linear_proj.bias"))
            h = F.layer_norm(x, (C,), self.w(p + "pre_mlp_layernorm.weight"), self.w(p + "pre_mlp_layernorm.bias"), eps)
            gelu = "none" if c.get("gelu_exact") else "tanh"
            h = F.gelu(F.linear(h, self.w(p + "mlp.linear_fc1.weight"), self.w(p + "mlp.linear_fc1.bias")), approximate=gelu)
            x = x + F.linear(h, self.w(p + "mlp.linear_fc2.weight"), self.w(p + "mlp.linear_fc2.bias"))
        x = F.layer_norm(x, (C,), self.w("decoder.final_layernorm.weight"), self.w("decoder.final_layernorm.bias"), eps)
        out = self.w("output_layer.weight") if c["untie"] else self.w("embedding.word_embeddings.weight")
        return F.linear(x, out)


def param_shapes(c):
    C, Fh, Vp, L = c["hidden_size"], c["ffn_hidden_size"], c["padded_vocab_size"], c["num_layers"]
    out = [("embedding.word_embeddings.weight", (Vp, C), "w"), ("embedding.position_embeddings.weight", (c["max_position_embeddings"], C), "w")]
    for l in range(L):
        p = f"decoder.layers.{l}."
        out += [(p + "input_layernorm.weight", (C,), "ln"), (p + "input_layernorm.bias", (C,), "b"),
                (p + "self_attention.linear_qkv.weight", (3 * C, C), "w"), (p + "self_attention.linear_qkv.bias", (3 * C,), "b"),
                (p + "self_attention.linear_proj.weight", (C, C), "o"), (p + "self_attention.linear_proj.bias", (C,), "b"),
                (p + "pre_mlp_layernorm.weight", (C,), "ln"), (p + "pre_mlp_layernorm.bias", (C,), "b"),
                (p + "mlp.linear_fc1.weight", (Fh, C), "w"), (p + "mlp.linear_fc1.bias", (Fh,), "b"),
                (p + "mlp.linear_fc2.weight", (C, Fh), "o"), (p + "mlp.linear_fc2.bias", (C,), "b")]
    out += [("decoder.final_layernorm.weight", (C,), "ln"), ("decoder.final_layernorm.bias", (C,), "b")]
    if c["untie"]:
        out.append(("output_layer.weight", (Vp, C), "w"))
    return out


def generate(untie, out_dir, gelu_exact=False):
    c = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=96, seq_length=16,
             max_position_embeddings=16, vocab_size=100, make_vocab_size_divisible_by=64, padded_vocab_size=128,
             layernorm_epsilon=1e-5, untie=untie, micro_batch_size=2, num_micro_batches=2, steps=10,
             lr=1e-2, min_lr=1e-3, init_lr=0.0, warmup_iters=2, decay_iters=10, weight_decay=0.1,
             adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
    if gelu_exact:
        c["gelu_exact"] = True
    gbs = c["micro_batch_size"] * c["num_micro_batches"]
    c["global_batch_size"] = gbs
    c["warmup_samples"], c["decay_samples"] = c["warmup_iters"] * gbs, c["decay_iters"] * gbs
    rng = np.random.RandomState(1234 + untie + 2 * gelu_exact)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * c["num_layers"])
    weights = {}
    for name, shape, kind in param_shapes(c):
        if kind == "w":
            weights[name] = rng.normal(0, std, shape)
        elif kind == "o":
            weights[name] = rng.normal(0, out_std, shape)
        elif kind == "ln":
            weights[name] = 1.0 + rng.normal(0, 0.1, shape)
        else:  # biases non-zero so that their paths are exercised
            weights[name] = rng.normal(0, 0.02, shape)
    # float32 is what ptk holds: round the inputs first so both sides start from the same values.
    weights = {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}
    B, T, M, S = c["micro_batch_size"], c["seq_length"], c["num_micro_batches"], c["steps"]
    tokens = rng.randint(0, c["vocab_size"], size=(S, M, B, T)).astype(np.int32)
    labels = rng.randint(0, c["vocab_size"], size=(S, M, B, T)).astype(np.int32)
    loss_mask = (rng.uniform(size=(S, M, B, T)) > 0.1).astype(np.float32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))

    model = GPT(c, weights)
    pos_t = torch.tensor(positions, dtype=torch.long)
    names = [n for n, _, _ in param_shapes(c)]
    record = {}
    steps, final = train(model, names, c, tokens, labels, loss_mask, c, lambda m, tk: m(tk, pos_t), record)
    first_loss = record["first_loss"]
    tensors = {"logits": record["logits"]}
    for n in names:
        tensors["grad:" + n] = record["grads"][n].astype(np.float32)
    for n in names:
        tensors["init:" + n] = weights[n].astype(np.float32)
        tensors["final:" + n] = final[n].astype(np.float32)
    tensors["tokens"], tensors["labels"], tensors["loss_mask"] = tokens, labels, loss_mask

    name = "gpt_gelu_exact" if gelu_exact else "gpt_untied" if untie else "gpt_tied"
    meta = {"generator": "tests/support/gen_trainer_goldens.py", "torch": torch.__version__, "config": c,
            "first_micro_batch_loss": first_loss, "steps": steps}
    write_golden(out_dir, name, meta, tensors)
    print(name, "loss", first_loss, "steps", [round(s["lm_loss"], 4) for s in steps])


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "data", "trainer")
    os.makedirs(out, exist_ok=True)
    cases = {"gpt_tied": (False, False), "gpt_untied": (True, False), "gpt_gelu_exact": (False, True)}
    for name in sys.argv[2:] or list(cases):
        untie, gelu_exact = cases[name]
        generate(untie, out, gelu_exact)
