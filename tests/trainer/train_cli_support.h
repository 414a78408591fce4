// What ptk-train's end-to-end tests (train_cli_test, dp_train_cli_test) share: the dataset they
// train on and a reader for the checkpoints their tiny model saves.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "indexed_dataset/indexed_dataset.h"
#include "trainer/checkpoint.h"

namespace ptk::testing {

// `documents` learnable documents at PREFIX: runs of consecutive ids (50 apart at most) from a
// document-specific start, 20 to 169 tokens, each ending in EOD (50256). The same bytes every call.
inline void WriteLearnableDataset(const std::string& prefix, int documents) {
  auto b = IndexedDatasetBuilder::Create(prefix, OptimalDType(50257));
  ASSERT_TRUE(b.ok()) << b.status();
  uint64_t h = 12345;
  for (int d = 0; d < documents; ++d) {
    h = h * 6364136223846793005ULL + 1442695040888963407ULL;
    int len = 20 + static_cast<int>((h >> 33) % 150), start = static_cast<int>((h >> 13) % 900);
    std::vector<int32_t> doc;
    for (int i = 0; i < len; ++i) doc.push_back(start + i % 50);
    doc.push_back(50256);
    std::vector<int32_t> lengths = {static_cast<int32_t>(doc.size())};
    ASSERT_TRUE((*b)->AddDocument(doc, lengths).ok());
  }
  ASSERT_TRUE((*b)->Finalize().ok());
}

// Model, moments, scheduler and data position of a saved checkpoint.
struct SavedCheckpoint {
  std::vector<float> params, m, v;
  TrainState state;
};

// Iteration `iteration` of DIR, saved by the tests' model (--num-layers 2 --hidden-size 32
// --num-attention-heads 4 --seq-length 32, GPT-2's vocabulary).
inline SavedCheckpoint LoadTinyCheckpoint(const std::string& dir, int64_t iteration) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 128;
  c.seq_length = c.max_position_embeddings = 32;
  c.vocab_size = 50257;
  c.padded_vocab_size = 50304;
  auto layout = ParamLayout::Create(c);
  EXPECT_TRUE(layout.ok());
  SavedCheckpoint s;
  absl::Status st = LoadCheckpoint(dir, iteration, *layout, &s.params, &s.m, &s.v, &s.state);
  EXPECT_TRUE(st.ok()) << st;
  return s;
}

}  // namespace ptk::testing
