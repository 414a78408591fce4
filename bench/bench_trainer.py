"""ptk-train's training throughput against PyTorch on the CPU, in the same run.

Same model (Megatron's GPT as ptk builds it, tests/support/gen_trainer_goldens.py's PyTorch twin),
same threads, micro-batch, sequence length and vocabulary, fp32, no dropout; one full training
step each (forward, backward, clipping, AdamW). ptk's figure comes from its own log lines (elapsed
time per iteration), PyTorch's from a timer around the step; the first iterations (warm-up, and
torch.compile's compilation) are left out and the median of the rest is kept.

Each PyTorch runs in a process of its own: the interpreter running this script (Debian's
/usr/bin/python3 has bookworm's PyTorch 1.13, OpenBLAS, no torch.compile) and each --torch-python
(e.g. /opt/ptk-torch26/bin/python: PyPI's PyTorch 2.6, MKL/oneDNN), eager and, where the torch has
it, torch.compile (inductor: C++ kernels built with the system's g++). A torch with
scaled_dot_product_attention runs the attention through it (causal; what a PyTorch 2 model calls),
and one with a fused CPU AdamW (2.4+) uses it: the anchor is the fastest step that torch offers
without changing the math. --rounds N repeats the whole set, the engines taking turns, so that a
shared machine's drifts reach all of them alike; the ratios are taken within a round.

--ptk-env NAME=VALUE (repeatable) times ptk-train once more with those environment variables, e.g.
OPENBLAS_CORETYPE=SkylakeX: Debian bookworm's OpenBLAS 0.3.21 runs its AVX2 (Haswell) kernels on
AMD's AVX-512 Zen 4/5, which it does not know; the anchors' ratios to that run are given too.
--baseline-bin DIR times another ptk-train build (DIR/ptk-train, e.g. the commit before a change)
in the same rounds: a change's before and after, with the machine's load alike.

Usage: /usr/bin/python3 bench/bench_trainer.py --bin build/bin [--threads N] [--iters 12]
           [--torch-python /opt/ptk-torch26/bin/python] [--rounds 3] [--models 2L-h128-s128,...]
           [--baseline-bin DIR] [--ptk-env OPENBLAS_CORETYPE=SkylakeX]
Prints one JSON object: tokens/s of each, the ratio anchor time / ptk time (target >= 1.0) per
round, their ranges, and the load average around each round.
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {
    # the small model, also the bundled main job's (scripts/run-main-job.sh)
    "2L-h128-s128": dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=128,
                         mbs=8),
    # deeper and wider: the transformer blocks, not the vocabulary projection, dominate
    "6L-h384-s256": dict(num_layers=6, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1536, seq_length=256,
                         mbs=4),
}


def torch_worker(name, threads, iters, compile_model):
    """Runs in the anchor's interpreter: the median step time of one model, as JSON on stdout."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
    import numpy as np
    import torch
    import torch.nn.functional as F

    import gen_trainer_goldens as ref

    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = MODELS[name]
    cfg = dict(m, max_position_embeddings=m["seq_length"], vocab_size=50257, padded_vocab_size=50304,
               layernorm_epsilon=1e-5, untie=False)
    rng = np.random.RandomState(0)
    weights = {n: (rng.normal(0, 0.02, s) if k in ("w", "o") else (np.ones(s) if k == "ln" else np.zeros(s))).astype(np.float32)
               for n, s, k in ref.param_shapes(cfg)}
    model = ref.GPT(cfg, weights).float()
    sdpa = hasattr(F, "scaled_dot_product_attention")
    if sdpa:
        model.forward = lambda tokens, pos: sdpa_forward(model, tokens, pos, F)
    params = list(model.parameters())
    fused = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 4)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **({"fused": True} if fused else {}))

    def loss_of(tokens, pos, labels):
        logits = model(tokens, pos)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))

    step_loss = torch.compile(loss_of) if compile_model else loss_of
    b, t = m["mbs"], m["seq_length"]
    tokens = torch.randint(0, 50257, (b, t))
    labels = torch.randint(0, 50257, (b, t))
    pos = torch.arange(t).expand(b, -1)
    times, losses = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = step_loss(tokens, pos, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    skip = 3 if compile_model else 2
    steady = sorted(times[skip:])
    print(json.dumps({"torch": torch.__version__, "step_s": steady[len(steady) // 2], "first_loss": losses[0],
                      "attention": "sdpa" if sdpa else "matmul+softmax", "adamw": "fused" if fused else "for-loop"}))


def sdpa_forward(self, tokens, positions, F):
    """gen_trainer_goldens.GPT.forward with the attention through F.scaled_dot_product_attention."""
    c = self.cfg
    C, NH = c["hidden_size"], c["num_attention_heads"]
    hd = C // NH
    eps = c["layernorm_epsilon"]
    B, T = tokens.shape
    x = self.w("embedding.word_embeddings.weight")[tokens] + self.w("embedding.position_embeddings.weight")[positions]
    for layer in range(c["num_layers"]):
        p = f"decoder.layers.{layer}."
        h = F.layer_norm(x, (C,), self.w(p + "input_layernorm.weight"), self.w(p + "input_layernorm.bias"), eps)
        qkv = F.linear(h, self.w(p + "self_attention.linear_qkv.weight"), self.w(p + "self_attention.linear_qkv.bias"))
        qkv = qkv.view(B, T, NH, 3, hd)
        q, k, v = (qkv[:, :, :, i, :].permute(0, 2, 1, 3) for i in range(3))  # (B, NH, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(0, 2, 1, 3).reshape(B, T, C)
        x = x + F.linear(y, self.w(p + "self_attention.linear_proj.weight"), self.w(p + "self_attention.linear_proj.bias"))
        h = F.layer_norm(x, (C,), self.w(p + "pre_mlp_layernorm.weight"), self.w(p + "pre_mlp_layernorm.bias"), eps)
        h = F.gelu(F.linear(h, self.w(p + "mlp.linear_fc1.weight"), self.w(p + "mlp.linear_fc1.bias")), approximate="tanh")
        x = x + F.linear(h, self.w(p + "mlp.linear_fc2.weight"), self.w(p + "mlp.linear_fc2.bias"))
    x = F.layer_norm(x, (C,), self.w("decoder.final_layernorm.weight"), self.w("decoder.final_layernorm.bias"), eps)
    return F.linear(x, self.w("embedding.word_embeddings.weight"))


def torch_step(python, name, threads, iters, compile_model):
    """One anchor run in a fresh process of `python`: its JSON, or {"failed": why}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    cmd = [python, os.path.abspath(__file__), "--worker", name, "--threads", str(threads), "--iters", str(iters)]
    if compile_model:
        cmd.append("--compile")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
        return {"failed": lines[-1] if lines else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def torch_info(python):
    """The anchor's torch version and whether it has torch.compile (None: no torch there)."""
    p = subprocess.run([python, "-c", "import torch, json; print(json.dumps([torch.__version__, "
                        "hasattr(torch, 'compile')]))"], capture_output=True, text=True)
    return json.loads(p.stdout) if p.returncode == 0 else None


def ptk_step(bin_dir, m, threads, iters, env=None):
    cmd = [os.path.join(bin_dir, "ptk-train"), "--num-layers", str(m["num_layers"]), "--hidden-size",
           str(m["hidden_size"]), "--num-attention-heads", str(m["num_attention_heads"]), "--ffn-hidden-size",
           str(m["ffn_hidden_size"]), "--seq-length", str(m["seq_length"]), "--micro-batch-size", str(m["mbs"]),
           "--train-iters", str(iters), "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
           "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, **(env or {}))).stdout
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    loss = re.search(r"lm loss: ([0-9.E+-]+)", out)
    steady = sorted(ms[2:])
    return {"step_s": steady[len(steady) // 2] / 1000.0, "first_loss": float(loss.group(1)) if loss else None}


def anchors_of(args):
    """(label, python, compile) for every anchor run: eager each, compiled where the torch has it."""
    out, info = [], {}
    pythons = ([] if args.no_local_torch else [sys.executable]) + args.torch_python
    for py in pythons:
        ti = torch_info(py)
        if ti is None:
            info[py] = "no torch"
            continue
        version, has_compile = ti
        label = f"torch {version}"
        info[label] = py
        out.append((f"{label} eager", py, False))
        if has_compile:
            out.append((f"{label} compile", py, True))
        else:
            info[f"{label} compile"] = "not in this torch"
    return out, info


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def openblas_core(bin_dir):
    """The kernels OpenBLAS picks here (what ptk-train's products run), and with OPENBLAS_CORETYPE if set."""
    code = ("import ctypes; l = ctypes.CDLL('libopenblas.so.0'); l.openblas_get_corename.restype = ctypes.c_char_p; "
            "print(l.openblas_get_corename().decode())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else "unknown"


def span(xs):
    return [min(xs), max(xs)] if xs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the set, the engines taking turns")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated names of MODELS")
    ap.add_argument("--torch-python", action="append", default=[],
                    help="another interpreter whose torch is an anchor too (repeatable)")
    ap.add_argument("--baseline-bin", help="another ptk-train build's bin directory, timed in the same rounds")
    ap.add_argument("--ptk-env", action="append", default=[],
                    help="NAME=VALUE: time ptk-train once more with this environment (repeatable)")
    ap.add_argument("--no-local-torch", action="store_true", help="no anchor from this script's own interpreter")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        torch_worker(args.worker, args.threads, args.iters, args.compile)
        return
    if not args.bin:
        ap.error("--bin is required")
    names = args.models.split(",")
    env = dict(kv.split("=", 1) for kv in args.ptk_env)
    variant = "ptk " + " ".join(args.ptk_env)
    anchors, info = anchors_of(args)
    res = {"cpu": cpu_name(), "threads": args.threads, "iters": args.iters, "openblas": openblas_core(args.bin),
           "anchors": info, "rounds": [], "models": {}}
    for r in range(args.rounds):
        rnd = {"loadavg_before": list(os.getloadavg()), "models": {}}
        for name in names:
            m = MODELS[name]
            tokens = m["mbs"] * m["seq_length"]
            p = ptk_step(args.bin, m, args.threads, args.iters)
            row = {"ptk_tokens_per_s": round(tokens / p["step_s"]), "ptk_first_loss": p["first_loss"]}
            if args.baseline_bin:
                q = ptk_step(args.baseline_bin, m, args.threads, args.iters)
                row["ptk baseline"] = {"tokens_per_s": round(tokens / q["step_s"]),
                                       "ratio": round(q["step_s"] / p["step_s"], 2), "first_loss": q["first_loss"]}
            if env:
                v = ptk_step(args.bin, m, args.threads, args.iters, env)
                row[variant] = {"tokens_per_s": round(tokens / v["step_s"]), "ratio": round(p["step_s"] / v["step_s"], 2),
                                "first_loss": v["first_loss"]}
            for label, py, comp in anchors:
                a = torch_step(py, name, args.threads, args.iters, comp)
                if "failed" in a:
                    row[label] = "failed: " + a["failed"]
                    continue
                row[label] = {"tokens_per_s": round(tokens / a["step_s"]), "ratio": round(a["step_s"] / p["step_s"], 2),
                              "first_loss": round(a["first_loss"], 4), "attention": a["attention"],
                              "adamw": a["adamw"]}
                if env:
                    row[label]["ratio_vs_" + variant] = round(a["step_s"] / v["step_s"], 2)
            rnd["models"][name] = row
            print(f"round {r + 1} {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
        rnd["loadavg_after"] = list(os.getloadavg())
        res["rounds"].append(rnd)
    for name in names:
        rows = [rnd["models"][name] for rnd in res["rounds"]]
        s = {"ptk_tokens_per_s": span([x["ptk_tokens_per_s"] for x in rows])}
        extra = (["ptk baseline"] if args.baseline_bin else []) + ([variant] if env else [])
        for label in extra + [a[0] for a in anchors]:
            ok = [x[label] for x in rows if isinstance(x.get(label), dict)]
            s[label] = {"tokens_per_s": span([x["tokens_per_s"] for x in ok]), "ratio": span([x["ratio"] for x in ok])}
            if env and label not in extra:
                s[label]["ratio_vs_" + variant] = span([x["ratio_vs_" + variant] for x in ok])
            if len(ok) < len(rows):
                s[label]["failed"] = next(x[label] for x in rows if not isinstance(x.get(label), dict))
        res["models"][name] = s
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
