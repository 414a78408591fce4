// The small models the trainer's and the converters' tests build: a GPT of a few layers (its fields
// set, the rest GPTConfig's defaults, dropout included), and the Llama family's switches on it.
#pragma once

#include <cstdint>

#include "trainer/param_layout.h"

namespace ptk::testing {

// `layers` layers of `hidden` channels in `heads` heads, an MLP 4 x hidden wide, `seq` positions (the
// sequence length and the position table's), a vocabulary of `vocab` tokens padded to `padded`.
inline GPTConfig SmallGpt(int64_t layers, int64_t hidden, int64_t heads, int64_t seq, int64_t vocab, int64_t padded) {
  GPTConfig c;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.ffn_hidden_size = 4 * hidden;
  c.seq_length = c.max_position_embeddings = seq;
  c.vocab_size = vocab;
  c.padded_vocab_size = padded;
  return c;
}

// The Llama-family switches the model tests turn on together: RMSNorm, rotary positions, SwiGLU,
// `groups` query groups, QK LayerNorm, no linear biases, output weights untied from the embedding.
inline void SwitchToLlama(GPTConfig& c, int64_t groups) {
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.num_query_groups = groups;
  c.qk_layernorm = true;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
}

}  // namespace ptk::testing
