"""Writes tests/data/trainer/rope_golden.json: megatron-core 0.16.1's own rotary embedding on small query/key
tensors, for ptk's rotary op (tests/trainer/rope_golden_test.cpp). Each case builds megatron-core's
RotaryEmbedding (kv_channels, rotary_percent, rotary_interleaved, seq_len_interpolation_factor,
rotary_base, rope_scaling, rope_scaling_factor: the arguments GPTModel passes from --rotary-interleaved,
--rotary-seq-len-interpolation-factor, --use-rope-scaling and --rope-scaling-factor), takes its
emb = rope(seq_len), and runs megatron-core's apply_rotary_pos_emb (the unfused bshd path every
non-fused run takes) on x (s, b, h, d) in float64; then autograd gives the gradient of
sum(apply_rotary_pos_emb(x) * r) with respect to x. The golden holds per case its settings, x, r, the
output y and the gradient dx (s, b, h, d row-major; 12 significant digits), and megatron-core's inv_freq.

megatron-core runs here on the CPU: RotaryEmbedding moves inv_freq to torch.cuda.current_device(), which
is pointed at the CPU; apply_rotary_pos_emb is given the context-parallel group of one rank it would
otherwise ask parallel_state for (the bshd path does not use it).

Usage (PyTorch 2.6 venv; megatron-core 0.16.1 in /opt/ptk-pyref):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_rope_golden.py tests/data/trainer/rope_golden.json
"""
import json
import sys
import types

import torch

torch.cuda.current_device = lambda: "cpu"  # RotaryEmbedding.get_emb's move to the GPU stays on the CPU

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402

# (name, kv_channels, rotary_percent, interleaved, interpolation, rotary_base, rope_scaling, factor)
CASES = [
    ("plain", 8, 1.0, False, None, 10000, False, 8.0),
    ("interleaved", 8, 1.0, True, None, 10000, False, 8.0),
    ("interleaved_partial", 12, 0.5, True, None, 10000, False, 8.0),
    ("interpolation_4", 8, 1.0, False, 4.0, 10000, False, 8.0),
    ("interpolation_2_5_interleaved", 8, 1.0, True, 2.5, 10000, False, 8.0),
    # Llama 3.2 1B/3B's factor: head dimension 32 so that the long wavelengths reach past 8192.
    ("llama3_factor_32", 32, 1.0, False, None, 500000, True, 32.0),
    ("llama3_factor_8", 32, 1.0, False, None, 500000, True, 8.0),
    ("llama3_factor_32_interleaved_interpolation_2", 32, 1.0, True, 2.0, 500000, True, 32.0),
]
SEQ = 7


def shape(d):
    """(batch, heads): two of each for the narrow heads, one of each for the 32-wide (a small file)."""
    return (2, 2) if d <= 12 else (1, 1)


class _OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


def case(name, d, percent, interleaved, interpolation, base, scaling, factor, seed):
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=percent, rotary_interleaved=interleaved,
                           seq_len_interpolation_factor=interpolation, rotary_base=base, rope_scaling=scaling,
                           rope_scaling_factor=factor, use_cpu_initialization=True, cp_group=_OneRank())
    emb = rope(SEQ)  # (s, 1, 1, rd), fp32
    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=interleaved,
                                   multi_latent_attention=False, mrope_section=None)
    g = torch.Generator().manual_seed(seed)
    batch, heads = shape(d)
    x = torch.randn(SEQ, batch, heads, d, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(SEQ, batch, heads, d, generator=g, dtype=torch.float64)
    y = apply_rotary_pos_emb(x, emb, config, cp_group=_OneRank())
    (y * r).sum().backward()
    flat = lambda t: [float("%.12g" % v) for v in t.detach().reshape(-1)]  # 12 digits: far below the tolerance
    return {"name": name, "kv_channels": d, "rotary_percent": percent, "rotary_interleaved": interleaved,
            "rotary_seq_len_interpolation_factor": interpolation or 0.0, "rotary_base": float(base),
            "use_rope_scaling": scaling, "rope_scaling_factor": factor, "seq": SEQ, "batch": batch, "heads": heads,
            "inv_freq": flat(rope.inv_freq), "x": flat(x), "r": flat(r), "y": flat(y), "dx": flat(x.grad)}


def main(out):
    cases = [case(*c, seed=i + 1) for i, c in enumerate(CASES)]
    with open(out, "w") as f:
        json.dump({"generator": "tests/support/gen_rope_golden.py", "reference": "megatron-core 0.16.1", "cases": cases}, f,
                  separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
