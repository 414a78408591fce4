// GPT-2's tensors as Hugging Face names and lays them out, mapped to and from ptk's flat parameters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/param_layout.h"

// Implementation details of interop's Hugging Face conversion (hf_gpt2.cpp).
namespace ptk::hf_detail {

// HF's names, as GPT2LMHeadModel.save_pretrained writes them.
inline constexpr char kPrefix[] = "transformer.";
inline constexpr char kLmHead[] = "lm_head.weight";

// One HF tensor: its name (without the "transformer." prefix for the body), shape and values.
struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// The HF tensors of a model, in GPT2LMHeadModel's order, with their shapes (data empty).
std::vector<HfTensor> HfTensorsOf(const GPTConfig& c);

// Between ptk's flat parameters (layout order) and HF's tensors, one direction or the other:
// to_hf fills hf[i].data from params; else fills params from hf[i].data (padded vocabulary rows
// copied from the last real row, as Megatron's saver pads).
void MapParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf);

}  // namespace ptk::hf_detail
