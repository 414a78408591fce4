"""What the Hugging Face MoE golden generators share (gen_mixtral_hf_golden.py, gen_qwen2_moe_hf_golden.py,
gen_qwen3_moe_hf_golden.py): the token sequences, and a tiny random model saved by transformers with its golden.json
(each sequence's logits and mean next-token cross-entropy loss). A script that needs torch2_shim installs it before
importing this module.
"""
import json
import os

import torch
import transformers

SEQS = [[3, 17, 41, 88, 5, 60, 2, 95, 33],
        [int(x) for x in torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(7))]]


def save_with_golden(model, out):
    """Moves `model`'s 1-D weights (norms from 1, biases from 0) off their init so that they are tested too, saves it
    in OUT (save_pretrained, fp32; generation_config.json, which the import does not read, kept out of the fixture)
    and writes OUT/golden.json: the token sequences, each one's logits (t x vocab_size, float32 values as float64
    text) and its loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra)):
            os.remove(os.path.join(out, extra))
    golden = {"transformers": transformers.__version__, "torch": torch.__version__, "sequences": []}
    for seq in SEQS:
        ids = torch.tensor([seq])
        with torch.no_grad():
            res = model(ids, labels=ids, use_cache=False)
        logits = res.logits[0]
        golden["sequences"].append({"tokens": seq, "loss": float(res.loss),
                                    "logits": [float(x) for x in logits.reshape(-1)]})
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
