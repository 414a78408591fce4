#!/usr/bin/env python3
"""The golden of ptk-convert's Qwen3MoeForCausalLM import (tests/interop/hf_qwen3_moe_convert_test.cpp,
HfQwen3MoeGolden): a tiny random Qwen3MoeForCausalLM made and saved by Hugging Face transformers itself, and its
logits and loss on fixed tokens.

Run with transformers 4.51.3 (the first with Qwen3-MoE) on Debian's torch 1.13 with tests/support/torch2_shim.py
(scripts/install-deps.sh --with-python-ref puts it in /opt/ptk-pyref/transformers-qwen3):
  PYTHONPATH=tests/support:/opt/ptk-pyref/transformers-qwen3:/opt/ptk-pyref /usr/bin/python3 \
    tests/support/gen_qwen3_moe_hf_golden.py tests/data/interop/qwen3_moe_tiny
Writes OUT/config.json and OUT/model.safetensors (save_pretrained, fp32) and OUT/golden.json: the token sequences,
each one's logits (t x vocab_size, float32 values as float64 text) and its mean next-token cross-entropy loss.

The model: 3 layers, the first dense (mlp_only_layers [0], intermediate_size 20), the others 4 SwiGLU experts of
moe_intermediate_size 12, top 2, norm_topk_prob false (Qwen3MoeConfig's default: the chosen softmax probabilities
not renormalised, Megatron's --moe-router-pre-softmax); hidden 16, 4 query heads of head_dim 8 (not hidden / heads)
in 2 key/value groups with q_norm and k_norm, RoPE base 10000, untied output layer, vocabulary 96; weights N(0, 0.2)
(initializer_range), the RMSNorm weights moved off their 1 init so that they are tested too.
"""
import sys

import torch2_shim

torch2_shim.install()
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import hf_moe_golden  # noqa: E402


def main(out):
    assert transformers.__version__ == "4.51.3", transformers.__version__
    torch.manual_seed(47)
    config = Qwen3MoeConfig(vocab_size=96, hidden_size=16, intermediate_size=20, moe_intermediate_size=12,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            max_position_embeddings=64, initializer_range=0.2, rms_norm_eps=1e-6, rope_theta=10000.0,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                            mlp_only_layers=[0], router_aux_loss_coef=0.02, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2)
    model = Qwen3MoeForCausalLM(config).eval()
    hf_moe_golden.save_with_golden(model, out)


if __name__ == "__main__":
    main(sys.argv[1])
