// For hf_transformers_test.py: ptk's own logits (GPTModel::Forward on the CPU backend) of a ptk
// checkpoint for given token sequences, and greedy continuations (trainer/sampling).
// Usage: logits_tool CKPT_DIR SEQUENCES.txt OUT.f32   (one sequence of ids per line; OUT: for each
//          sequence its (t, vocab_size) logits as little-endian float32, the padded rows left out)
//        logits_tool CKPT_DIR SEQUENCES.txt OUT.f32 LOSSES.txt   (also each sequence's lm loss, one a line: its
//          tokens' next tokens as labels, every position but the last in the mask, the masked mean, %.9g; with
//          --mtp-num-layers N the N depths' masked mean losses after it on the line)
//        logits_tool CKPT_DIR --generate N ID...       (prints the N greedy ids that follow)
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/status.h"
#include "interop/hf_gpt2.h"
#include "trainer/backend.h"
#include "trainer/sampling.h"

namespace {

absl::Status Run(int argc, char** argv) {
  if (argc < 4) return absl::InvalidArgumentError("usage: logits_tool CKPT_DIR SEQUENCES.txt OUT.f32");
  PTK_ASSIGN_OR_RETURN(ptk::PtkCheckpoint ck, ptk::LoadPtkCheckpoint(argv[1]));
  ptk::GPTConfig c = ck.config;
  c.hidden_dropout = c.attention_dropout = 0;
  c.moe_router_enable_expert_bias = !ck.state.buffers.empty();  // the routers' expert biases choose experts too
  PTK_ASSIGN_OR_RETURN(auto model, ptk::CreateModel(c, ptk::BackendOptions{}));
  PTK_RETURN_IF_ERROR(model->WriteParams(ck.params));
  PTK_RETURN_IF_ERROR(model->WriteBuffers(ck.state.buffers));  // a router's expert_bias routes as trained
  if (std::string(argv[2]) == "--generate") {
    ptk::GenerateOptions g;
    g.new_tokens = std::stoll(argv[3]);
    std::vector<int32_t> prompt;
    for (int i = 4; i < argc; ++i) prompt.push_back(std::stoi(argv[i]));
    PTK_ASSIGN_OR_RETURN(std::vector<int32_t> ids, ptk::Generate(model.get(), prompt, g));
    for (int32_t id : ids) std::printf("%d ", id);
    std::printf("\n");
    return absl::OkStatus();
  }
  std::ifstream in(argv[2]);
  std::ofstream out(argv[3], std::ios::binary);
  std::FILE* losses = argc > 4 ? std::fopen(argv[4], "w") : nullptr;
  if (argc > 4 && !losses) return absl::InternalError(std::string("cannot write ") + argv[4]);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::vector<int32_t> tokens;
    for (int32_t id; ss >> id;) tokens.push_back(id);
    const int64_t t = static_cast<int64_t>(tokens.size());
    std::vector<int32_t> labels(tokens.size(), 0), pos(tokens.size());
    for (int64_t i = 0; i < t; ++i) pos[i] = static_cast<int32_t>(i);
    std::vector<float> mask(tokens.size(), 0.0f), logits;
    for (int64_t i = 0; losses && i + 1 < t; ++i) labels[i] = tokens[i + 1], mask[i] = 1.0f;
    ptk::ModelBatch b{1, t, tokens.data(), labels.data(), pos.data(), mask.data(), nullptr};
    PTK_ASSIGN_OR_RETURN(const ptk::LossSum loss, model->Forward(b, &logits));
    if (losses) std::fprintf(losses, "%.9g", loss.loss_sum / loss.tokens);
    if (losses && c.mtp_num_layers > 0) {  // the depths' losses: a pass as training makes it (no dropout here)
      PTK_ASSIGN_OR_RETURN(const ptk::LossSum mtp, model->ForwardBackward(b, 1.0, /*train=*/false, 0));
      for (double v : mtp.mtp_losses) std::fprintf(losses, " %.9g", v);
    }
    if (losses) std::fprintf(losses, "\n");
    for (int64_t i = 0; i < t; ++i)
      out.write(reinterpret_cast<const char*>(logits.data() + i * c.padded_vocab_size),
                static_cast<std::streamsize>(c.vocab_size * sizeof(float)));
  }
  if (!out.flush()) return absl::InternalError(std::string("cannot write ") + argv[3]);
  if (losses && std::fclose(losses) != 0) return absl::InternalError(std::string("cannot write ") + argv[4]);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::Status st = Run(argc, argv);
  if (!st.ok()) {
    std::fprintf(stderr, "logits_tool: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  return 0;
}
