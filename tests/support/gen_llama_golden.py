"""Writes the Llama-shaped trainer golden: a small Llama 3.1-style decoder written from the Llama
papers (Touvron et al. 2023: pre-normalisation with RMSNorm, SwiGLU feed-forward, rotary position
embeddings; Llama 2: grouped-query attention; Llama 3.1's rope frequency scaling as published with
its weights) in PyTorch float64 on the CPU, with separate q, k, v, gate, up and down matrices and
no biases, an untied output layer. The weights and gradients are then stored in Megatron-core's
fused layout (Megatron's docs: linear_qkv holds per query group its query heads, then its key and
value head; linear_fc1 holds [gate; up]), which is what ptk must reproduce. Logits, loss, every
gradient, and the loss of 10 AdamW steps with clipping and Megatron's cosine schedule; then, from the
same weights, a 100-step loss curve on data the model can learn (each sequence a window of one fixed
token cycle, labels the next token) with warmup 10 and cosine decay to step 100.

The same for a Qwen3-shaped model (Megatron's --qk-layernorm: RMSNorm over each query and key head,
after the projections and before RoPE, one weight for all query heads and one for all key heads, as
transformers' Qwen3Attention; RoPE without Llama 3.1's scaling), its weights drawn after the Llama's
names in the same order plus q_norm and k_norm.

Usage: /usr/bin/python3 tests/support/gen_llama_golden.py [OUT_DIR]
Writes OUT_DIR/{llama,qwen3}.json and .bin (little-endian float32 / int32).
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

from golden_common import Weights, train, write_golden

torch.set_default_dtype(torch.float64)


def llama31_inv_freq(dim, base):
    """theta_i = base^(-2i/dim), then Llama 3.1's scaling: wavelengths above the original context /
    low_freq_factor slowed by `factor`, below original / high_freq_factor kept, blended between."""
    factor, low, high, original = 8.0, 1.0, 4.0, 8192.0
    out = []
    for i in range(dim // 2):
        f = base ** (-2.0 * i / dim)
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out)


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, cos, sin):
    """x (B, H, T, hd): pairs (i, i + hd/2) rotated by angle t * theta_i."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Llama(Weights):
    def forward(self, tokens):
        c = self.cfg
        NH, G, hd, eps = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"], c["norm_epsilon"]
        B, T = tokens.shape
        theta = llama31_inv_freq(hd, c["rotary_base"]) if c.get("use_rope_scaling", True) else \
            c["rotary_base"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * theta[None, :]
        cos, sin = torch.cos(ang), torch.sin(ang)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        x = self.w("tok_embeddings")[tokens]
        for l in range(c["num_layers"]):
            p = f"layers.{l}."
            h = rms_norm(x, self.w(p + "attention_norm"), eps)
            q = F.linear(h, self.w(p + "wq")).view(B, T, NH, hd).transpose(1, 2)
            k = F.linear(h, self.w(p + "wk")).view(B, T, G, hd).transpose(1, 2)
            if c.get("qk_layernorm"):  # Qwen3's q_norm / k_norm: RMSNorm over each head, before RoPE
                q, k = rms_norm(q, self.w(p + "q_norm"), eps), rms_norm(k, self.w(p + "k_norm"), eps)
            v = F.linear(h, self.w(p + "wv")).view(B, T, G, hd).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k = k.repeat_interleave(NH // G, dim=1)  # query head j uses key/value head j // (NH/G)
            v = v.repeat_interleave(NH // G, dim=1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            y = (a @ v).transpose(1, 2).reshape(B, T, NH * hd)
            x = x + F.linear(y, self.w(p + "wo"))
            h = rms_norm(x, self.w(p + "ffn_norm"), eps)
            x = x + F.linear(F.silu(F.linear(h, self.w(p + "w_gate"))) * F.linear(h, self.w(p + "w_up")),
                             self.w(p + "w_down"))
        x = rms_norm(x, self.w("norm"), eps)
        return F.linear(x, self.w("output"))


def shapes(c):
    C, Fh, Vp, NH, G, hd = (c["hidden_size"], c["ffn_hidden_size"], c["padded_vocab_size"], c["num_attention_heads"],
                            c["num_query_groups"], c["kv_channels"])
    out = [("tok_embeddings", (Vp, C), "w")]
    for l in range(c["num_layers"]):
        p = f"layers.{l}."
        out += [(p + "attention_norm", (C,), "ln"), (p + "wq", (NH * hd, C), "w"), (p + "wk", (G * hd, C), "w"),
                (p + "wv", (G * hd, C), "w"), (p + "wo", (C, NH * hd), "o"), (p + "ffn_norm", (C,), "ln"),
                (p + "w_gate", (Fh, C), "w"), (p + "w_up", (Fh, C), "w"), (p + "w_down", (C, Fh), "o")]
        if c.get("qk_layernorm"):
            out += [(p + "q_norm", (hd,), "ln"), (p + "k_norm", (hd,), "ln")]
    return out + [("norm", (C,), "ln"), ("output", (Vp, C), "w")]


def to_megatron(c, t):
    """The reference's tensors (dict name -> array) under Megatron-core's names and fused layout."""
    NH, G, hd = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    per = NH // G
    out = {"embedding.word_embeddings.weight": t["tok_embeddings"]}
    for l in range(c["num_layers"]):
        p, m = f"layers.{l}.", f"decoder.layers.{l}."
        rows = []
        for g in range(G):  # per query group: its query heads, its key head, its value head
            rows += [t[p + "wq"][g * per * hd:(g + 1) * per * hd], t[p + "wk"][g * hd:(g + 1) * hd],
                     t[p + "wv"][g * hd:(g + 1) * hd]]
        out[m + "input_layernorm.weight"] = t[p + "attention_norm"]
        out[m + "self_attention.linear_qkv.weight"] = np.concatenate(rows)
        out[m + "self_attention.linear_proj.weight"] = t[p + "wo"]
        if c.get("qk_layernorm"):
            out[m + "self_attention.q_layernorm.weight"] = t[p + "q_norm"]
            out[m + "self_attention.k_layernorm.weight"] = t[p + "k_norm"]
        out[m + "pre_mlp_layernorm.weight"] = t[p + "ffn_norm"]
        out[m + "mlp.linear_fc1.weight"] = np.concatenate([t[p + "w_gate"], t[p + "w_up"]])
        out[m + "mlp.linear_fc2.weight"] = t[p + "w_down"]
    out["decoder.final_layernorm.weight"] = t["norm"]
    out["output_layer.weight"] = t["output"]
    return out


def train_llama(c, weights, tokens, labels, loss_mask, lr_cfg, record=None):
    """golden_common.train on a fresh Llama from `weights` (reference names)."""
    return train(Llama(c, weights), [n for n, _, _ in shapes(c)], c, tokens, labels, loss_mask, lr_cfg,
                 lambda m, tk: m(tk), record)


def generate(out_dir, golden="llama"):
    """`golden` llama: the Llama 3.1 shape; qwen3: Qwen3's (--qk-layernorm: q_norm / k_norm, plain RoPE of
    base 1000000 without Llama 3.1's scaling), the same dimensions and data otherwise."""
    c = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
             ffn_hidden_size=40, seq_length=16, max_position_embeddings=16, vocab_size=100,
             make_vocab_size_divisible_by=64, padded_vocab_size=128, norm_epsilon=1e-5, rotary_base=500000.0,
             micro_batch_size=2, num_micro_batches=2, steps=10, lr=1e-2, min_lr=1e-3, init_lr=0.0,
             warmup_iters=2, decay_iters=10, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
             clip_grad=1.0, curve_steps=100, curve_warmup_iters=10)
    if golden == "qwen3":
        c.update(qk_layernorm=True, use_rope_scaling=False, rotary_base=1000000.0)
    gbs = c["micro_batch_size"] * c["num_micro_batches"]
    c["global_batch_size"] = gbs
    c["warmup_samples"], c["decay_samples"] = c["warmup_iters"] * gbs, c["decay_iters"] * gbs
    rng = np.random.RandomState(4321)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * c["num_layers"])
    weights = {}
    for name, shape, kind in shapes(c):
        if kind == "w":
            weights[name] = rng.normal(0, std * 10, shape)  # larger than init: attention far from uniform
        elif kind == "o":
            weights[name] = rng.normal(0, out_std * 10, shape)
        else:
            weights[name] = 1.0 + rng.normal(0, 0.1, shape)
    weights = {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}
    B, T, M, S = c["micro_batch_size"], c["seq_length"], c["num_micro_batches"], c["steps"]
    tokens = rng.randint(0, c["vocab_size"], size=(S, M, B, T)).astype(np.int32)
    labels = rng.randint(0, c["vocab_size"], size=(S, M, B, T)).astype(np.int32)
    loss_mask = (rng.uniform(size=(S, M, B, T)) > 0.1).astype(np.float32)

    tensors, record = {}, {}
    steps, final = train_llama(c, weights, tokens, labels, loss_mask, c, record)
    tensors["logits"], first_loss = record["logits"], record["first_loss"]
    for n, g in to_megatron(c, record["grads"]).items():
        tensors["grad:" + n] = g.astype(np.float32)
    for n, w in to_megatron(c, weights).items():
        tensors["init:" + n] = w.astype(np.float32)
    for n, w in to_megatron(c, final).items():
        tensors["final:" + n] = w.astype(np.float32)
    tensors["tokens"], tensors["labels"], tensors["loss_mask"] = tokens, labels, loss_mask

    # The curve: 100 steps from the same weights on a learnable task (its own random stream, so the
    # data above is as it was).
    crng = np.random.RandomState(100)
    CS = c["curve_steps"]
    cycle = crng.permutation(c["vocab_size"])[:64]
    starts = crng.randint(0, len(cycle), size=(CS, M, B))
    idx = (starts[..., None] + np.arange(T + 1)) % len(cycle)
    seqs = cycle[idx].astype(np.int32)
    ctokens, clabels = seqs[..., :-1].copy(), seqs[..., 1:].copy()
    cmask = (crng.uniform(size=(CS, M, B, T)) > 0.1).astype(np.float32)
    curve_lr = dict(c, warmup_samples=c["curve_warmup_iters"] * gbs, decay_samples=CS * gbs)
    curve, _ = train_llama(c, weights, ctokens, clabels, cmask, curve_lr)
    tensors["curve_tokens"], tensors["curve_labels"], tensors["curve_loss_mask"] = ctokens, clabels, cmask

    meta = {"generator": "tests/support/gen_llama_golden.py", "torch": torch.__version__, "config": c,
            "first_micro_batch_loss": first_loss, "steps": steps, "curve": curve}
    write_golden(out_dir, golden, meta, tensors)
    print(golden, "loss", first_loss, "steps", [round(s["lm_loss"], 4) for s in steps])
    print("curve", [round(s["lm_loss"], 3) for s in curve[::10]], "last", round(curve[-1]["lm_loss"], 4))


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "data", "trainer")
    os.makedirs(out, exist_ok=True)
    generate(out)
    generate(out, "qwen3")
