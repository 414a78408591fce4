"""Writes tests/data/trainer/moe_shared*.{json,bin}: gen_moe_golden.py's megatron-core MoE GPT with shared experts
(--moe-shared-expert-intermediate-size: megatron-core's SharedExpertMLP beside the routed experts, its output added
to theirs; with --moe-shared-expert-gate its output scaled by sigmoid(x . gate_weight)), the golden of ptk's CPU
shared experts (tests/trainer/moe_model_golden_test.cpp).

The model, data, optimizer and what is written are gen_moe_golden.py's (its run()); this script only gives
the shared experts' two settings, which gen_moe_golden.py's build() passes to megatron-core's TransformerConfig
(its EXTRA_CONFIG) and records in the golden's config (moe_shared_expert_intermediate_size, moe_shared_expert_gate:
0 or 1).

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_moe_shared_golden.py tests/data/trainer [NAME ...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_moe_golden as base  # noqa: E402
import mcore_golden  # noqa: E402

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


def main():
    out_dir = sys.argv[1]
    with mcore_golden.one_cpu_rank(moe=True) as torch:
        for name in sys.argv[2:] or list(GOLDENS):
            base.run(torch, name, GOLDENS[name], out_dir)


if __name__ == "__main__":
    main()
