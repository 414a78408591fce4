// The multi-latent attention model the MLA CLI tests train (mla_train_cli_test, mla_tp_train_cli_test): its
// ptk-train flags and its GPTConfig.
#pragma once

#include "tests/trainer/train_cli_support.h"
#include "trainer/param_layout.h"

namespace ptk::testing {

// Queries through a latent of 16, keys and values through one of 12, 8 + 4 query/key channels and 6 value channels
// per head, the latents normalised, RMSNorm, plain RoPE.
inline constexpr char kMlaLora[] =
    " --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4"
    " --v-head-dim 6 --qk-layernorm --normalization RMSNorm --rope-type rope";

// kMlaLora's model: TinyModel's shape with SmallVocabFlags' vocabulary, `layers` layers.
inline GPTConfig MlaLoraModel(int layers = 2) {
  GPTConfig c = TinyModel(1000, 1024);
  c.num_layers = layers;
  c.normalization = Normalization::kRMSNorm;
  c.qk_layernorm = true;
  c.multi_latent_attention = true;
  c.q_lora_rank = 16;
  c.kv_lora_rank = 12;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 6;
  c.mla_yarn = false;
  return c;
}

}  // namespace ptk::testing
