// GPT-2's tensors as Hugging Face names and lays them out, mapped to and from ptk's flat parameters.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "interop/hf_shards.h"
#include "interop/safetensors.h"
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

// Fills every tensor of `tensors` from the files of an HF directory's weights (`weights_path`: one file
// or the shards' index), whose tensors `present` holds by the names `tensors` uses (buffers that are not
// weights left out): each must be there with its shape and finite values, refused naming its file and
// it as `prefix` + its name (kLmHead as it is). A tied model's kLmHead may be there only as a copy of
// tensors[0] (the embedding); anything else left is refused, naming `model` (GPT-2's import and
// Llama's share this). `progress`, when given, gets the tensors and bytes to read as its totals and counts
// each one read.
absl::Status ReadPresentTensors(const std::string& weights_path, std::map<std::string, PresentTensor> present,
                                bool untied, const std::string& prefix, const std::string& model,
                                std::vector<HfTensor>* tensors, ProgressReporter* progress = nullptr);

}  // namespace ptk::hf_detail
