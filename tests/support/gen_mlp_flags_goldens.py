"""Writes the goldens of Megatron's --squared-relu, --apply-layernorm-1p and --init-method-xavier-uniform
ops in float64 on the CPU (tests/data/trainer/mlp_flags_ops.{json,bin}):

  squared_relu   megatron.core.activations.squared_relu itself (torch.pow(F.relu(x), 2)) on inputs with
                 exact zeros and both signs, and its autograd gradient for an output gradient dy.
  layernorm_1p   megatron-core's FusedLayerNorm with layernorm_zero_centered_gamma: weight + 1, then
                 LayerNorm (its forward adds 1 to the zero-centred weight before the kernel; apex is not
                 needed for the formula: F.layer_norm with that weight); gradients of x, gamma, beta.
  rmsnorm_1p     Transformer Engine's RMSNorm with zero_centered_gamma (what megatron-core's TENorm
                 builds for --normalization RMSNorm --apply-layernorm-1p): x * rsqrt(mean(x^2) + eps) *
                 (1 + gamma); gradients of x and gamma.
  xavier         torch.nn.init.xavier_uniform_'s bound for (rows, cols) tensors (what Megatron's
                 --init-method-xavier-uniform passes as init_method and output_layer_init_method):
                 rows, cols, bound = gain * sqrt(6 / (fan_in + fan_out)) from torch's own fan
                 computation, and the largest magnitude of one draw (below the bound).

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_mlp_flags_goldens.py [OUT_DIR]
(megatron-core 0.16.1 on the CPU). OUT_DIR defaults to tests/data/trainer.
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

from golden_common import write_golden

torch.set_default_dtype(torch.float64)
GENERATOR = "tests/support/gen_mlp_flags_goldens.py"


def squared_relu_case(tensors):
    from megatron.core.activations import squared_relu
    g = torch.Generator().manual_seed(1)
    x = torch.randn(61, generator=g) * 2.0
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-3, -1e-3])])
    x = x.to(torch.float32).to(torch.float64).requires_grad_(True)  # exact in float32 too
    dy = torch.randn(x.shape[0], generator=g).to(torch.float32).to(torch.float64)
    y = squared_relu(x)
    y.backward(dy)
    tensors.update(sr_x=x.detach().numpy(), sr_dy=dy.numpy(), sr_y=y.detach().numpy(), sr_dx=x.grad.numpy())


def norm_inputs(seed, n, c):
    g = torch.Generator().manual_seed(seed)
    f32 = lambda t: t.to(torch.float32).to(torch.float64)  # float32-exact inputs
    x = f32(torch.randn(n, c, generator=g) * 1.5 + 0.3).requires_grad_(True)
    gamma = f32(torch.randn(c, generator=g) * 0.1).requires_grad_(True)
    beta = f32(torch.randn(c, generator=g) * 0.1).requires_grad_(True)
    dy = f32(torch.randn(n, c, generator=g))
    return x, gamma, beta, dy


def layernorm_1p_case(tensors, n, c, eps):
    x, gamma, beta, dy = norm_inputs(2, n, c)
    y = F.layer_norm(x, (c,), gamma + 1, beta, eps)
    y.backward(dy)
    tensors.update(ln_x=x.detach().numpy(), ln_gamma=gamma.detach().numpy(), ln_beta=beta.detach().numpy(),
                   ln_dy=dy.numpy(), ln_y=y.detach().numpy(), ln_dx=x.grad.numpy(), ln_dgamma=gamma.grad.numpy(),
                   ln_dbeta=beta.grad.numpy())


def rmsnorm_1p_case(tensors, n, c, eps):
    x, gamma, _, dy = norm_inputs(3, n, c)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + gamma)
    y.backward(dy)
    tensors.update(rms_x=x.detach().numpy(), rms_gamma=gamma.detach().numpy(), rms_dy=dy.numpy(),
                   rms_y=y.detach().numpy(), rms_dx=x.grad.numpy(), rms_dgamma=gamma.grad.numpy())


def xavier_case(tensors):
    # A tiny GPT (vocabulary 100, hidden 16, 4 heads, ffn 64, 7 positions): wte, wpe, QKV, proj, fc1, fc2.
    shapes = [(100, 16), (7, 16), (48, 16), (16, 16), (64, 16), (16, 64)]
    rows = []
    for r, c in shapes:
        w = torch.empty(r, c)
        fan_in, fan_out = torch.nn.init._calculate_fan_in_and_fan_out(w)
        bound = 1.0 * math.sqrt(6.0 / float(fan_in + fan_out))
        torch.manual_seed(4)
        torch.nn.init.xavier_uniform_(w)
        assert float(w.abs().max()) <= bound
        rows.append([r, c, bound, float(w.abs().max())])
    tensors["xavier"] = np.array(rows)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "data", "trainer")
    n, c, eps = 6, 10, 1e-5
    tensors = {}
    squared_relu_case(tensors)
    layernorm_1p_case(tensors, n, c, eps)
    rmsnorm_1p_case(tensors, n, c, eps)
    xavier_case(tensors)
    import megatron.core.package_info as info
    meta = {"generator": GENERATOR, "megatron_core": info.__version__, "torch": torch.__version__,
            "config": {"n": n, "c": c, "eps": eps}}
    write_golden(out_dir, "mlp_flags_ops", meta, tensors)


if __name__ == "__main__":
    main()
