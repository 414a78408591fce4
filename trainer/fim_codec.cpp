// --fim-data: the flags checked, the FIM tokens looked up, and GPT-2 BPE as GPTFIMDataset calls it.
#include "trainer/fim_codec.h"

#include <mutex>
#include <unordered_map>
#include <vector>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "common/status.h"
#include "common/utf8.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {
namespace {

// GPT-2's bytes_to_unicode, inverted: the byte a vocab.json character stands for (-1: none).
int ByteOfChar(uint32_t cp) {
  static const std::vector<int> table = [] {
    std::vector<int> t(512, -1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      t[static_cast<size_t>(printable ? b : 256 + extra++)] = b;
    }
    return t;
  }();
  return cp < table.size() ? table[cp] : -1;
}

// Megatron's ids_to_text and text_to_ids (megatron-core 0.16.1's HuggingFaceTokenizer over the slow
// GPT2Tokenizer): tokens by vocab.json's spelling, the special token <|endoftext|> left out, characters
// to bytes, decoded with errors="replace"; text split at a literal <|endoftext|> (an added token), the
// rest byte-level BPE.
class Gpt2FimCodec : public FimTextCodec {
 public:
  Gpt2FimCodec(std::unique_ptr<Gpt2Tokenizer> tok, std::vector<std::string> bytes_of_id, std::vector<bool> special)
      : tok_(std::move(tok)),
        encoder_(*tok_, Gpt2Encoder::Options{}),
        bytes_(std::move(bytes_of_id)),
        special_(std::move(special)) {}

  absl::StatusOr<std::string> Decode(std::span<const int64_t> ids) override {
    std::string raw;
    for (int64_t id : ids) {
      if (id < 0 || id >= static_cast<int64_t>(bytes_.size()) || bytes_[static_cast<size_t>(id)].empty())
        return absl::DataLossError(fmt::format(
            "--fim-data: token id {} of the dataset is not in the vocabulary ({} tokens)", id, bytes_.size()));
      if (!special_[static_cast<size_t>(id)]) raw += bytes_[static_cast<size_t>(id)];
    }
    std::string text;
    AppendUtf8Replacing(raw, &text);
    return text;
  }

  absl::Status Encode(std::string_view text, std::vector<int64_t>* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.clear();
    encoder_.Encode(text, &ids_);
    out->insert(out->end(), ids_.begin(), ids_.end());
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<Gpt2Tokenizer> tok_;
  std::mutex mu_;
  Gpt2Encoder encoder_;
  std::vector<int32_t> ids_;
  std::vector<std::string> bytes_;  // a token's bytes ("" where the id has no token or its spelling no bytes)
  std::vector<bool> special_;
};

// Python's `contents` length and the JSON key decoded to code points: the token's bytes, or nullopt
// where a character is not one of bytes_to_unicode's (Python's byte_decoder would raise).
std::optional<std::string> TokenBytes(std::string_view spelling) {
  std::string out;
  for (size_t i = 0; i < spelling.size();) {
    const unsigned char c = static_cast<unsigned char>(spelling[i]);
    const int len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (int k = 1; k < len && i + static_cast<size_t>(k) < spelling.size(); ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(spelling[i + static_cast<size_t>(k)]) & 0x3F);
    const int b = ByteOfChar(cp);
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
    i += static_cast<size_t>(len);
  }
  return out;
}

absl::Status CheckRate(const char* flag, double rate) {
  if (!(rate >= 0.0 && rate <= 1.0))
    return UsageError(fmt::format("{} {}: a probability, in [0, 1] (numpy's binomial refuses it)", flag, rate));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const FimConfig>> MakeFimConfig(const FimOptions& o, const std::string& vocab_file,
                                                               const std::string& merge_file) {
  PTK_RETURN_IF_ERROR(CheckRate("--fim-rate", o.rate));
  PTK_RETURN_IF_ERROR(CheckRate("--fim-spm-rate", o.spm_rate));
  if (o.fragment_rate) {
    PTK_RETURN_IF_ERROR(CheckRate("--fim-fragment-rate", *o.fragment_rate));
  }
  if (o.split_sample && !o.split_sample->empty() && !o.fragment_rate)
    return UsageError(
        "--fim-split-sample needs --fim-fragment-rate (Megatron's default None fails at the first sample holding the "
        "split token)");
  std::string json;
  if (vocab_file.empty()) {
    json = std::string(Gpt2Tokenizer::DefaultVocabJson());
  } else {
    PTK_ASSIGN_OR_RETURN(json, ReadFileToString(vocab_file));
  }
  const std::string where = vocab_file.empty() ? "ptk's built-in GPT-2 vocab.json" : vocab_file;
  simdjson::dom::parser parser;
  simdjson::dom::object obj;
  if (parser.parse(json).get(obj)) return UsageError(where + ": --vocab-file is not a JSON object (GPT-2 vocab.json)");
  std::unordered_map<std::string, int64_t> ids;
  std::vector<std::string> bytes;
  std::vector<bool> special;
  for (auto [key, value] : obj) {
    int64_t id = 0;
    if (value.get(id) || id < 0 || id > (int64_t{1} << 31))
      return UsageError(fmt::format("{}: the id of {:?} is not a token id", where, std::string(key)));
    ids[std::string(key)] = id;
    if (static_cast<size_t>(id) >= bytes.size()) {
      bytes.resize(static_cast<size_t>(id) + 1);
      special.resize(static_cast<size_t>(id) + 1);
    }
    bytes[static_cast<size_t>(id)] = TokenBytes(key).value_or("");
    special[static_cast<size_t>(id)] = key == Gpt2Tokenizer::kEndOfText;
  }
  auto lookup = [&](const char* flag, const std::string& token) -> absl::StatusOr<int64_t> {
    auto it = ids.find(token);
    if (it == ids.end())
      return UsageError(fmt::format(
          "{} {:?}: not a token of {}: Megatron's tokenizer would give its unknown token <|endoftext|> for it, without "
          "a word; name a token of the vocabulary (as vocab.json spells it), or give a --vocab-file that has it",
          flag, token, where));
    return it->second;
  };
  auto c = std::make_shared<FimConfig>();
  c->rate = o.rate;
  c->spm_rate = o.spm_rate;
  c->fragment_rate = o.fragment_rate.value_or(0.0);
  c->no_prefix = o.no_prefix;
  PTK_ASSIGN_OR_RETURN(c->prefix, lookup("--fim-prefix-token", o.prefix_token));
  PTK_ASSIGN_OR_RETURN(c->middle, lookup("--fim-middle-token", o.middle_token));
  PTK_ASSIGN_OR_RETURN(c->suffix, lookup("--fim-suffix-token", o.suffix_token));
  PTK_ASSIGN_OR_RETURN(c->pad, lookup("--fim-pad-token", o.pad_token));
  PTK_ASSIGN_OR_RETURN(c->eod, lookup("--fim-eod-token", o.eod_token));
  // Megatron tests the string's truth: an empty --fim-split-sample is none.
  if (o.split_sample && !o.split_sample->empty()) {
    PTK_ASSIGN_OR_RETURN(c->split_sample, lookup("--fim-split-sample", *o.split_sample));
  }
  PTK_ASSIGN_OR_RETURN(auto tok, Gpt2Tokenizer::LoadOrDefault(vocab_file, merge_file));
  c->codec = std::make_shared<Gpt2FimCodec>(std::move(tok), std::move(bytes), std::move(special));
  return std::shared_ptr<const FimConfig>(std::move(c));
}

}  // namespace ptk
