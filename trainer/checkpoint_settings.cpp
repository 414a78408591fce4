// The run's settings recorded in a checkpoint's header (for --use-checkpoint-args and the convert tool),
// and how a saved model differs from a run's.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "common/status.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_header.h"

namespace ptk {

absl::StatusOr<std::string> ReadCheckpointHeaderText(const std::string& file) {
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: corrupt checkpoint: {}", file, why));
  };
  {
    PTK_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(file));  // a FIFO refused, not waited on
    ::close(fd);
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(fmt::format("{}: cannot open", file));
  char magic[sizeof kMagic];
  uint64_t len = 0;
  if (!in.read(magic, sizeof magic) || std::memcmp(magic, kMagic, sizeof kMagic) != 0)
    return corrupt(NotAPtkCheckpoint(std::string_view(magic, static_cast<size_t>(in.gcount()))));
  if (!in.read(reinterpret_cast<char*>(&len), sizeof len) || len > (uint64_t{1} << 30))
    return corrupt("bad header length");
  std::string header(len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(len))) return corrupt("header past the end");
  return header;
}

bool ReadHeaderSettings(simdjson::dom::element header, std::vector<std::pair<std::string, std::string>>* out) {
  out->clear();
  simdjson::dom::array settings;
  if (header["settings"].get(settings)) return true;
  for (simdjson::dom::element pair : settings) {
    simdjson::dom::array kv;
    std::string_view name, value;
    if (pair.get(kv) || kv.size() != 2 || kv.at(0).get(name) || kv.at(1).get(value)) return false;
    out->emplace_back(std::string(name), std::string(value));
  }
  return true;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ReadCheckpointSettings(const std::string& load,
                                                                                        int64_t iteration) {
  const std::string file = CheckpointFile(load, iteration);
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: corrupt checkpoint: {}", file, why));
  };
  absl::StatusOr<std::string> header = ReadCheckpointHeaderText(file);
  if (absl::IsNotFound(header.status()))
    return absl::NotFoundError(fmt::format("{}: cannot open (the tracker names iteration {})", file, iteration));
  PTK_RETURN_IF_ERROR(header.status());
  simdjson::dom::parser parser;
  simdjson::dom::element h;
  if (parser.parse(*header).get(h)) return corrupt("header is not JSON");
  std::vector<std::pair<std::string, std::string>> out;
  if (!ReadHeaderSettings(h, &out)) return corrupt("malformed settings in the header");
  if (!out.empty()) return out;
  simdjson::dom::object model;
  if (h["model"].get(model)) return corrupt("header misses the model");
  const std::pair<const char*, const char*> names[] = {{"num_layers", "--num-layers"},
                                                       {"hidden_size", "--hidden-size"},
                                                       {"num_attention_heads", "--num-attention-heads"},
                                                       {"ffn_hidden_size", "--ffn-hidden-size"},
                                                       {"max_position_embeddings", "--max-position-embeddings"}};
  for (const auto& [key, flag] : names) {
    int64_t v = 0;
    if (!model[key].get(v)) out.emplace_back(flag, std::to_string(v));
  }
  bool untie = false;
  if (!model["untie_embeddings_and_output_weights"].get(untie))
    out.emplace_back("--untie-embeddings-and-output-weights", untie ? "on" : "off");
  return out;
}

std::string ModelDifferences(simdjson::dom::element saved, simdjson::dom::element mine) {
  simdjson::dom::object a, b;
  if (saved.get(a) || mine.get(b)) return "another description";
  std::string out;
  auto add = [&](std::string_view key, const std::string& was, const std::string& now) {
    std::string flag = "--" + std::string(key);
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (key == "padded_vocab_size") flag = "a padded vocabulary of";
    out += fmt::format("{}{} {} (this run: {})", out.empty() ? "" : ", ", flag, was, now);
  };
  for (auto field : a) {
    simdjson::dom::element other;
    const std::string was = simdjson::minify(field.value);
    if (b[field.key].get(other)) {
      add(field.key, was, "the default");
    } else if (const std::string now = simdjson::minify(other); now != was) {
      add(field.key, was, now);
    }
  }
  for (auto field : b) {
    simdjson::dom::element other;
    if (a[field.key].get(other)) add(field.key, "the default", simdjson::minify(field.value));
  }
  return out.empty() ? "the same settings, another parameter count" : out;
}

}  // namespace ptk
