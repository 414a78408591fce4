"""ptk-train on one GPU beside the same model in PyTorch as its users write it, in one run.

Shapes (the issue's): GPT-2 124M at 16 x 1024, the tutorials' system check (12 layers, 512, 8 heads) at
32 x 1024, 350M (24 layers, 1024, 16 heads) at 8 x 2048; vocabulary 50257 padded to 50304, random tokens,
bf16 with fp32 master weights, no dropout, AdamW (0.9, 0.95), clip 1.0, one micro-batch per step.

- ptk: `ptk-train --device cuda --bf16 --mock-data ...`; its figure is the mean of its own log lines' "elapsed
  time per iteration" after the warm-up intervals.
- PyTorch (this file's own model: pre-LayerNorm blocks, fused QKV nn.Linear, scaled_dot_product_attention
  with is_causal, GELU tanh, learned positions, tied embeddings, bf16 autocast, AdamW(fused=True)), eager and
  torch.compile; CUDA events over the timed steps after warm-up.

Prints one JSON line per (shape, engine) and a summary line with tokens/s, MFU (Megatron's formula:
per token 6 x matrix parameters incl. the tied output layer + 12 x layers x hidden x seq, against 989.4
TFLOP/s dense bf16) and the ratios ptk / PyTorch compiled and ptk / PyTorch eager; with --profile, ptk's
per-op time split of one step (its --ptk-profile-ops table). Each ptk row names its cuBLASLt fallbacks (the
products cuBLASLt found no algorithm for, run by cublasGemmEx and separate epilogue kernels), as ptk-train
prints them ("cuBLASLt fallbacks: N"), "n/a" where it printed no count.

ptk-train runs with --ptk-library-path first on its LD_LIBRARY_PATH (the pack's libraries); PyTorch, in
this process, with the environment the bench was started with.

Usage (on the GPU machine: scripts/gpu-check.sh run starts it): python3 bench/bench_trainer_gpu.py
  [--bin ptk-train] [--ptk-library-path DIRS] [--shapes 124m,syscheck,350m] [--iters 30] [--no-torch]
  [--no-compile] [--profile] [--run-timeout S]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

PEAK = 989.4e12
VOCAB, PADDED = 50257, 50304
SHAPES = {
    "124m": dict(layers=12, hidden=768, heads=12, seq=1024, mbs=16),
    "syscheck": dict(layers=12, hidden=512, heads=8, seq=1024, mbs=32),
    "350m": dict(layers=24, hidden=1024, heads=16, seq=2048, mbs=8),
}


def flops_per_token(s):
    """Megatron's: 6 x matrix parameters (incl. the tied output layer) + 12 x L x h x s (attention)."""
    L, h, seq = s["layers"], s["hidden"], s["seq"]
    matrix = L * (12 * h * h) + PADDED * h  # qkv 3h^2 + proj h^2 + fc1/fc2 8h^2 per layer; output layer
    return 6 * matrix + 12 * L * h * seq


def fallbacks(text):
    """ptk-train's count of cuBLASLt fallbacks ("cuBLASLt fallbacks: N"), or "n/a" where it printed none."""
    counts = re.findall(r"cuBLASLt fallbacks: ([0-9]+)", text)
    return int(counts[-1]) if counts else "n/a"


def ptk_run(binary, s, iters, profile, library_path, timeout=None):
    cmd = [binary, "--device", "cuda", "--bf16", "--mock-data", "--num-layers", str(s["layers"]), "--hidden-size",
           str(s["hidden"]), "--num-attention-heads", str(s["heads"]), "--seq-length", str(s["seq"]),
           "--max-position-embeddings", str(s["seq"]), "--micro-batch-size", str(s["mbs"]), "--global-batch-size",
           str(s["mbs"]), "--train-iters", str(iters), "--log-interval", "5", "--lr", "6e-4", "--min-lr", "6e-5",
           "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--vocab-size", str(VOCAB)]
    if profile:
        cmd += ["--ptk-profile-ops"]
    env = dict(os.environ)
    if library_path:
        env["LD_LIBRARY_PATH"] = library_path
    t0 = time.time()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return dict(error=f"ptk-train did not finish within {timeout} s (--run-timeout): {tail[-2000:]}")
    if out.returncode != 0:
        return dict(error=f"ptk-train exit {out.returncode}: {(out.stderr or out.stdout)[-2000:]}")
    ms = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out.stdout)]
    loss = re.findall(r"lm loss: ([0-9.E+-]+)", out.stdout)
    if len(ms) < 3:
        return dict(error="too few log lines: " + out.stdout[-2000:])
    timed = ms[2:]  # the first two intervals (10 iterations) are warm-up
    r = dict(ms_step=sum(timed) / len(timed), loss=float(loss[-1]) if loss else None, wall_s=round(time.time() - t0, 1),
             cublaslt_fallbacks=fallbacks(out.stdout + out.stderr))
    if profile:
        table = out.stdout[out.stdout.find("ptk op profile"):] if "ptk op profile" in out.stdout else ""
        r["profile"] = table.strip()
    return r


def torch_run(s, iters, compile_):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Layer(nn.Module):
        def __init__(self, h, heads):
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.out = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            b, t, h = x.shape
            qkv = self.qkv(self.norm1(x)).view(b, t, self.heads, 3, h // self.heads)
            q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, h))
            return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            h = s["hidden"]
            self.tok, self.pos = nn.Embedding(PADDED, h), nn.Embedding(s["seq"], h)
            self.layers = nn.ModuleList(Layer(h, s["heads"]) for _ in range(s["layers"]))
            self.norm = nn.LayerNorm(h)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, tokens, labels):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            for layer in self.layers:
                x = layer(x)
            logits = self.norm(x) @ self.tok.weight.t()
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    model = Model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if compile_ else model
    data = torch.randint(0, VOCAB, (s["mbs"], s["seq"] + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(8):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        loss = step()
    end.record()
    torch.cuda.synchronize()
    r = dict(ms_step=start.elapsed_time(end) / iters, loss=round(float(loss), 3))
    del model, opt, fwd
    torch.cuda.empty_cache()
    return r


def guarded(run, *args):
    """run(*args), or its exception as the row's error (CUDA out of memory, a compile failure)."""
    try:
        return run(*args)
    except Exception as e:  # noqa: BLE001 - any failure is the row's, the bench goes on
        return dict(error=f"{type(e).__name__}: {e}"[-2000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=None, help="ptk-train, or a folder holding it (default: PATH)")
    ap.add_argument("--ptk-library-path", default="", help="LD_LIBRARY_PATH for ptk-train only (the pack's libraries)")
    ap.add_argument("--shapes", default="124m,syscheck,350m")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--profile", action="store_true", help="ptk's per-op time split (an extra run per shape)")
    ap.add_argument("--run-timeout", type=float, default=None,
                    help="seconds each ptk-train run may take (default: no limit); one past it is a failed row")
    a = ap.parse_args()
    binary = a.bin or shutil.which("ptk-train")
    if binary and os.path.isdir(binary):
        binary = os.path.join(binary, "ptk-train")
    if not binary or not os.access(binary, os.X_OK):
        sys.exit("bench_trainer_gpu: no ptk-train (give --bin, or run under .gpu/run.sh)")
    if a.iters < 15:
        sys.exit("bench_trainer_gpu: --iters must be at least 15 (10 are warm-up)")
    summary, failed = [], False
    for name in a.shapes.split(","):
        if name not in SHAPES:
            sys.exit(f"bench_trainer_gpu: unknown shape {name} (have {', '.join(SHAPES)})")
        s = SHAPES[name]
        tokens = s["mbs"] * s["seq"]
        line = dict(shape=name, **s)
        rows = {}

        def report(engine, r):
            """Each engine's row as soon as it ran: a later engine that fails or hangs takes none with it."""
            if "ms_step" in r:
                r["tok_s"] = int(tokens / (r["ms_step"] / 1e3))
                r["mfu_pct"] = round(100 * r["tok_s"] * flops_per_token(s) / PEAK, 1)
                r["ms_step"] = round(r["ms_step"], 2)
            print(json.dumps(dict(shape=name, engine=engine, **r)), flush=True)
            line[engine] = r.get("tok_s")
            rows[engine] = r

        report("ptk", ptk_run(binary, s, a.iters, False, a.ptk_library_path, a.run_timeout))
        if not a.no_torch:
            report("torch_eager", guarded(torch_run, s, a.iters, False))
            if not a.no_compile:
                report("torch_compiled", guarded(torch_run, s, a.iters, True))
        for ref in ("torch_compiled", "torch_eager"):
            if line.get("ptk") and line.get(ref):
                line[f"ptk_over_{ref}"] = round(line["ptk"] / line[ref], 3)
        if a.profile:
            p = ptk_run(binary, s, 15, True, a.ptk_library_path, a.run_timeout)
            print(p.get("profile") or p.get("error", ""), flush=True)
            if rows["ptk"].get("cublaslt_fallbacks") == "n/a":
                rows["ptk"]["cublaslt_fallbacks"] = p.get("cublaslt_fallbacks", "n/a")
        line["ptk_cublaslt_fallbacks"] = rows["ptk"].get("cublaslt_fallbacks", "n/a")
        print(f"{name}: cuBLASLt fallbacks: {line['ptk_cublaslt_fallbacks']}", flush=True)
        summary.append(line)
        failed = failed or any("error" in r for r in rows.values())
    print(json.dumps(dict(summary=summary)), flush=True)
    if failed:
        sys.exit("bench_trainer_gpu: a run failed (its row above has the error)")


if __name__ == "__main__":
    main()
