"""ptk-train's loss curve beside PyTorch's on the same samples.

The issue's run: GPT with 2 layers, hidden 128, 4 heads, seq 128, batch 8, 300 iterations, cosine
1e-3 -> 1e-4 after 30 warm-up iterations, AdamW beta2 0.95, weight decay 0.1, clip 1.0, no
dropout. The samples are megatron-core's own GPTDataset (PyPI megatron-core through
tests/support/megatron_shim.py) over the same .bin/.idx files, in Megatron's order; ptk-train reads
the same files with its own GPTDataset. The PyTorch model is tests/support/gen_trainer_goldens.py's
(float32 here), initialised as Megatron does with torch's RNG (not the same initial weights as
ptk: the comparison is of training behaviour, the goldens test the arithmetic).

Usage: /usr/bin/python3 bench/compare_loss_curve.py --bin build/bin --data PREFIX [PREFIX ...]
       [--iters 300] [--out DIR]
Writes DIR/ptk.jsonl, DIR/pytorch.jsonl, DIR/loss_curves.png and prints the mean lm loss of the
last 50 iterations of each and their difference (target: within 0.1).
"""
import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
sys.path.insert(0, os.environ.get("PTK_PYREF_DIR", "/opt/ptk-pyref"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gen_trainer_goldens as ref  # noqa: E402
import megatron_shim  # noqa: E402
import ref_env  # noqa: E402

torch.set_default_dtype(torch.float32)

CFG = dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=128,
           max_position_embeddings=128, vocab_size=50257, padded_vocab_size=50304, layernorm_epsilon=1e-5,
           untie=False)
MBS = 8
LR, MIN_LR, WARMUP = 1e-3, 1e-4, 30


def megatron_samples(prefixes, n_samples, seed, work):
    megatron_shim.install(training_args=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    class Gpt2Ids:  # what GPTDataset asks of the tokenizer: GPT-2's sizes and end-of-document id
        vocab_size = 50257
        eod = 50256
        unique_identifiers = {"class": "GPT2BPETokenizer", "vocab_file": ref_env.VOCAB}

    tok = Gpt2Ids()
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=CFG["seq_length"], blend=get_blend_from_list(prefixes),
                           split="98,2,0", path_to_cache=os.path.join(work, "mcache"), tokenizer=tok,
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [n_samples, 0, 0], lambda: True, cfg).build()
    return train


def megatron_lr(step_samples, decay_samples, warm_samples):
    if step_samples <= warm_samples:
        return LR * step_samples / warm_samples
    if step_samples > decay_samples:
        return MIN_LR
    r = (step_samples - warm_samples) / (decay_samples - warm_samples)
    return MIN_LR + 0.5 * (math.cos(math.pi * r) + 1.0) * (LR - MIN_LR)


def train_pytorch(ds, iters, out_path, threads):
    torch.manual_seed(1234)
    torch.set_num_threads(threads)
    rng = np.random.RandomState(1234)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * CFG["num_layers"])
    weights = {}
    for name, shape, kind in ref.param_shapes(CFG):
        if kind == "w":
            weights[name] = rng.normal(0, std, shape)
        elif kind == "o":
            weights[name] = rng.normal(0, out_std, shape)
        elif kind == "ln":
            weights[name] = np.ones(shape)
        else:
            weights[name] = np.zeros(shape)
    model = ref.GPT(CFG, {k: v.astype(np.float32) for k, v in weights.items()}).float()
    named = {n: model.w(n) for n, _, _ in ref.param_shapes(CFG)}
    opt = torch.optim.AdamW([{"params": [p for p in named.values() if p.dim() > 1], "weight_decay": 0.1},
                             {"params": [p for p in named.values() if p.dim() == 1], "weight_decay": 0.0}],
                            lr=0.0, betas=(0.9, 0.95), eps=1e-8)
    positions = torch.arange(CFG["seq_length"]).expand(MBS, -1)
    t0 = time.time()
    with open(out_path, "w") as f:
        for it in range(iters):
            batch = [ds[it * MBS + b] for b in range(MBS)]
            tokens = torch.tensor(np.stack([s["tokens"] for s in batch]), dtype=torch.long)
            labels = torch.tensor(np.stack([s["labels"] for s in batch]), dtype=torch.long)
            mask = torch.tensor(np.stack([s["loss_mask"] for s in batch]), dtype=torch.float32)
            opt.zero_grad()
            logits = model(tokens, positions)
            losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="none")
            loss = (losses * mask.view(-1)).sum() / mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(named.values()), 1.0)
            for g in opt.param_groups:
                g["lr"] = megatron_lr(it * MBS, iters * MBS, WARMUP * MBS)
            opt.step()
            f.write(json.dumps({"iteration": it + 1, "lm_loss": loss.item()}) + "\n")
    return time.time() - t0


def last_mean(path, n=50):
    records = [json.loads(line) for line in open(path) if line.strip()]
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]  # not the evaluations' records
    return sum(losses[-n:]) / len(losses[-n:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="loss-curve-compare")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)
    work = tempfile.mkdtemp(prefix="ptk-curve-")
    try:
        ptk_metrics = os.path.join(out, "ptk.jsonl")
        if os.path.exists(ptk_metrics):
            os.remove(ptk_metrics)
        cmd = [os.path.join(args.bin, "ptk-train"), "--num-layers", "2", "--hidden-size", "128",
               "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
               "--micro-batch-size", str(MBS), "--global-batch-size", str(MBS), "--train-iters", str(args.iters),
               "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine", "--lr-warmup-iters", str(WARMUP),
               "--adam-beta2", "0.95", "--weight-decay", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0",
               "--attention-dropout", "0", "--split", "98,2,0", "--eval-iters", "0", "--log-interval", "50",
               "--seed", "1234", "--data-cache-path", os.path.join(work, "pcache"), "--metrics-file", ptk_metrics,
               "--threads", str(args.threads), "--data-path"] + args.data
        t0 = time.time()
        subprocess.run(cmd, check=True)
        ptk_s = time.time() - t0
        ds = megatron_samples(args.data, args.iters * MBS, 1234, work)
        torch_s = train_pytorch(ds, args.iters, os.path.join(out, "pytorch.jsonl"), args.threads)
        a, b = last_mean(ptk_metrics), last_mean(os.path.join(out, "pytorch.jsonl"))
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot-loss.py"), ptk_metrics,
                        os.path.join(out, "pytorch.jsonl"), "-o", os.path.join(out, "loss_curves.png"),
                        "--title", "lm loss: ptk-train vs PyTorch, same samples"], check=False)
        res = {"iters": args.iters, "ptk_last50_mean": a, "pytorch_last50_mean": b, "difference": a - b,
               "within_0.1": abs(a - b) <= 0.1, "ptk_seconds": ptk_s, "pytorch_seconds": torch_s,
               "torch": torch.__version__}
        print(json.dumps(res, indent=1))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(res, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
