#!/usr/bin/env python3
"""The golden of ptk-convert's MixtralForCausalLM import (tests/interop/hf_mixtral_convert_test.cpp,
HfMixtralGolden): a tiny random MixtralForCausalLM made and saved by Hugging Face transformers itself, and its
logits and loss on fixed tokens.

Run with transformers 4.44.2 on Debian's torch 1.13 (scripts/install-deps.sh --with-python-ref):
  PYTHONPATH=/opt/ptk-pyref /usr/bin/python3 tests/support/gen_mixtral_hf_golden.py tests/data/interop/mixtral_tiny
Writes OUT/config.json and OUT/model.safetensors (save_pretrained, fp32) and OUT/golden.json: the token sequences,
each one's logits (t x vocab_size, float32 values as float64 text) and its mean next-token cross-entropy loss.

The model: 2 layers, hidden 16, 4 query heads in 2 key/value groups, 4 SwiGLU experts of width 24, top 2, RoPE
base 10000, untied output layer, vocabulary 96; weights N(0, 0.2) (initializer_range), the RMSNorm weights moved
off their 1 init so that they are tested too.
"""
import sys

import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM

import hf_moe_golden


def main(out):
    assert transformers.__version__ == "4.44.2", transformers.__version__
    torch.manual_seed(46)
    config = MixtralConfig(vocab_size=96, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           initializer_range=0.2, rms_norm_eps=1e-5, rope_theta=10000.0, num_local_experts=4,
                           num_experts_per_tok=2, router_aux_loss_coef=0.02, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2)
    model = MixtralForCausalLM(config).eval()
    hf_moe_golden.save_with_golden(model, out)


if __name__ == "__main__":
    main(sys.argv[1])
