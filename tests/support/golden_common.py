"""What the trainer's PyTorch golden generators share (gen_trainer_goldens.py, gen_llama_golden.py):
Megatron's cosine learning rate, a module holding named float64 weights, the AdamW loop with
Megatron's parameter groups and clipping, and the golden's file pair (NAME.json: configuration,
per-step figures, tensor directory; NAME.bin: the tensors, little-endian float32 / int32).
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F


def megatron_lr(num_steps, cfg):
    """OptimizerParamScheduler.get_lr for the cosine style (units: samples)."""
    warm, decay = cfg["warmup_samples"], cfg["decay_samples"]
    if warm > 0 and num_steps <= warm:
        return cfg["init_lr"] + (cfg["lr"] - cfg["init_lr"]) * num_steps / warm
    if num_steps > decay:
        return cfg["min_lr"]
    ratio = (num_steps - warm) / (decay - warm)
    return cfg["min_lr"] + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (cfg["lr"] - cfg["min_lr"])


class Weights(torch.nn.Module):
    """A model's parameters by name (dots allowed), float64, from a dict name -> array."""

    def __init__(self, cfg, weights):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict()
        for name, arr in weights.items():
            self.p[name.replace(".", "__")] = torch.nn.Parameter(torch.tensor(arr, dtype=torch.float64))

    def w(self, name):
        return self.p[name.replace(".", "__")]


def train(model, names, c, tokens, labels, loss_mask, lr_cfg, forward, record=None):
    """AdamW steps (Megatron's param groups: no decay on 1-D tensors) over tokens (S, M, B, T), each
    micro-batch's logits forward(model, tokens (B, T)); the per-step loss, grad norm and lr, and the
    final weights. `record` (a dict) receives the first logits and loss, and the first step's
    gradients (float64)."""
    S, M = tokens.shape[0], tokens.shape[1]
    named = {n: model.w(n) for n in names}
    decay = [p for p in named.values() if p.dim() > 1]
    no_decay = [p for p in named.values() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=0.0, betas=(c["adam_beta1"], c["adam_beta2"]), eps=c["adam_eps"])
    steps = []
    for s in range(S):
        opt.zero_grad()
        loss_sum, tok_sum = 0.0, 0.0
        for m in range(M):
            logits = forward(model, torch.tensor(tokens[s, m], dtype=torch.long))
            lb = torch.tensor(labels[s, m], dtype=torch.long)
            mask = torch.tensor(loss_mask[s, m], dtype=torch.float64)
            losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), lb.view(-1), reduction="none")
            ls = (losses * mask.view(-1)).sum()
            (ls / mask.sum() / M).backward()
            loss_sum += ls.item()
            tok_sum += mask.sum().item()
            if record is not None and s == 0 and m == 0:
                record["logits"] = logits.detach().numpy().astype(np.float32)
                record["first_loss"] = (ls / mask.sum()).item()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in named.values())).item()
        if record is not None and s == 0:
            record["grads"] = {n: p.grad.numpy().copy() for n, p in named.items()}
        torch.nn.utils.clip_grad_norm_(list(named.values()), c["clip_grad"])
        lr = megatron_lr(s * c["global_batch_size"], lr_cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        steps.append({"lm_loss": loss_sum / tok_sum, "grad_norm": norm, "lr": lr})
    return steps, {n: p.detach().numpy() for n, p in named.items()}


def write_golden(out_dir, name, meta, tensors):
    """OUT_DIR/NAME.bin (the tensors back to back) and OUT_DIR/NAME.json (`meta`, then the tensor
    directory: offset, shape, dtype)."""
    directory, blob, off = {}, bytearray(), 0
    for k, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dtype = "int32" if arr.dtype == np.int32 else "float32"
        data = arr.astype("<i4" if dtype == "int32" else "<f4").tobytes()
        directory[k] = {"offset": off, "shape": list(arr.shape), "dtype": dtype}
        blob += data
        off += len(data)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(dict(meta, tensors=directory), f, indent=1)
    with open(os.path.join(out_dir, name + ".bin"), "wb") as f:
        f.write(blob)
