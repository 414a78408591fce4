"""ptk-train's training throughput against PyTorch on the CPU, in the same run.

Same model (Megatron's GPT as ptk builds it, tests/support/gen_trainer_goldens.py's PyTorch twin),
same threads, micro-batch, sequence length and vocabulary, fp32, no dropout; one full training
step each (forward, backward, clipping, AdamW). PyTorch eager always, torch.compile where the
installed torch has it (Debian bookworm's 1.13 does not). ptk's figure comes from its own log lines
(elapsed time per iteration), the first interval (warm-up) left out.

Usage: /usr/bin/python3 bench/bench_trainer.py --bin build/bin [--threads N] [--iters 12]
Prints one JSON object: tokens/s of each and the ratio ptk / PyTorch (target >= 1.0).
"""
import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gen_trainer_goldens as ref  # noqa: E402

torch.set_default_dtype(torch.float32)

MODELS = {
    # the small model
    "2L-h128-s128": dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=128,
                         mbs=8),
    # deeper and wider: the transformer blocks, not the vocabulary projection, dominate
    "6L-h384-s256": dict(num_layers=6, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1536, seq_length=256,
                         mbs=4),
}


def torch_step_time(m, threads, iters, compile_model):
    torch.set_num_threads(threads)
    cfg = dict(m, max_position_embeddings=m["seq_length"], vocab_size=50257, padded_vocab_size=50304,
               layernorm_epsilon=1e-5, untie=False)
    rng = np.random.RandomState(0)
    weights = {n: (rng.normal(0, 0.02, s) if k in ("w", "o") else (np.ones(s) if k == "ln" else np.zeros(s))).astype(np.float32)
               for n, s, k in ref.param_shapes(cfg)}
    model = ref.GPT(cfg, weights).float()
    fwd = torch.compile(model) if compile_model else model
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    b, t = m["mbs"], m["seq_length"]
    tokens = torch.randint(0, 50257, (b, t))
    labels = torch.randint(0, 50257, (b, t))
    pos = torch.arange(t).expand(b, -1)
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = fwd(tokens, pos)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[2:])
    return steady[len(steady) // 2]


def ptk_step_time(bin_dir, m, threads, iters):
    cmd = [os.path.join(bin_dir, "ptk-train"), "--num-layers", str(m["num_layers"]), "--hidden-size",
           str(m["hidden_size"]), "--num-attention-heads", str(m["num_attention_heads"]), "--ffn-hidden-size",
           str(m["ffn_hidden_size"]), "--seq-length", str(m["seq_length"]), "--micro-batch-size", str(m["mbs"]),
           "--train-iters", str(iters), "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
           "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    steady = sorted(ms[2:])
    return steady[len(steady) // 2] / 1000.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args()
    has_compile = hasattr(torch, "compile")
    res = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
           "models": {}}
    for name, m in MODELS.items():
        tokens = m["mbs"] * m["seq_length"]
        p = ptk_step_time(args.bin, m, args.threads, args.iters)
        e = torch_step_time(m, args.threads, args.iters, False)
        row = {"ptk_tokens_per_s": round(tokens / p), "pytorch_eager_tokens_per_s": round(tokens / e),
               "ratio_vs_eager": round(e / p, 2)}
        if has_compile:
            try:
                c = torch_step_time(m, args.threads, args.iters, True)
                row["pytorch_compile_tokens_per_s"] = round(tokens / c)
                row["ratio_vs_compile"] = round(c / p, 2)
            except Exception as ex:  # noqa: BLE001
                row["pytorch_compile"] = f"failed: {type(ex).__name__}"
        else:
            row["pytorch_compile"] = "not in this torch"
        res["models"][name] = row
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
