"""Writes tests/data/trainer/moe_shared*.{json,bin}: gen_moe_golden.py's megatron-core MoE GPT with shared experts
(--moe-shared-expert-intermediate-size: megatron-core's SharedExpertMLP beside the routed experts, its output added
to theirs; with --moe-shared-expert-gate its output scaled by sigmoid(x . gate_weight)), the golden of ptk's CPU
shared experts (tests/trainer/moe_model_golden_test.cpp).

The model, data, optimizer and what is written are gen_moe_golden.py's (its run()); this script only adds
the shared experts' two settings to megatron-core's TransformerConfig (gen_moe_golden.py's build() names the
others), and records them in the golden's config (moe_shared_expert_intermediate_size, moe_shared_expert_gate:
0 or 1).

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_moe_shared_golden.py tests/data/trainer [NAME ...]
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_moe_golden as base  # noqa: E402
from make_torch_dist_distopt_fixture import cpu_shims  # noqa: E402

GOLDENS = {
    # GELU experts (top-2 of 4) and a shared expert of width 20, layers MoE, dense, MoE.
    "moe_shared": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                       moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1],
                       moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=0),
    # SwiGLU experts (top-2 of 4) and a gated SwiGLU shared expert of width 8, every layer MoE.
    "moe_shared_gate": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=True,
                            moe_router_pre_softmax=False, moe_layer_freq=1,
                            moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=1),
}
SHARED_KEYS = ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate")


def with_shared_experts(settings):
    """Wraps megatron-core's TransformerConfig so that build() makes it with `settings`' shared experts."""
    import megatron.core.transformer.transformer_config as tc
    plain = tc.TransformerConfig

    def make(**kw):
        kw["moe_shared_expert_intermediate_size"] = settings["moe_shared_expert_intermediate_size"]
        kw["moe_shared_expert_gate"] = bool(settings["moe_shared_expert_gate"])
        return plain(**kw)

    tc.TransformerConfig = make
    return lambda: setattr(tc, "TransformerConfig", plain)


def main():
    out_dir = sys.argv[1]
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core import parallel_state
        mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
        mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
        import megatron.core.transformer.moe.moe_utils as moe_utils
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        parallel_state.initialize_model_parallel(1, 1)
        mrandom.model_parallel_cuda_manual_seed(1234)
        for name in sys.argv[2:] or list(GOLDENS):
            restore = with_shared_experts(GOLDENS[name])
            try:
                base.run(torch, name, GOLDENS[name], out_dir)
            finally:
                restore()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
