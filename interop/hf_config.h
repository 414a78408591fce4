// Hugging Face config.json, written as transformers writes it and read as transformers reads it:
// what the GPT-2 and Llama conversions share.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <simdjson.h>

#include "absl/status/status.h"
#include "trainer/model_limits.h"

namespace ptk::hf_detail {

// config.json's limits: a dimension as ptk-train's flags take it; the reals as GPTConfig::Validate.
inline constexpr int64_t kMaxDimension = (int64_t{1} << 31) - 1;
inline constexpr double kMaxLayerNormEpsilon = kGptConfigMaxLayerNormEpsilon;
inline constexpr double kMaxInitMethodStd = kGptConfigMaxInitMethodStd;

// A shape as "[a, b]".
std::string Shape(const std::vector<int64_t>& s);

// A JSON object as transformers writes config.json: keys sorted, two-space indent; each value is
// its JSON text (an object's own lines indented by `indent` levels).
std::string PrettyConfig(std::vector<std::pair<std::string, std::string>> fields, int indent = 0);
std::string Num(double v);  // Python's repr of a float (1e-06, 500000.0)
std::string Int(int64_t v);
std::string Str(std::string_view s);
std::string Bool(bool b);

// config.json's keys as transformers reads them (Python's json.load), each refusal naming the file
// and the key. A key that is absent (or null) takes HF's default; one of another type is an error.
class HfConfigReader {
 public:
  explicit HfConfigReader(std::string path) : path_(std::move(path)) {}
  HfConfigReader(const HfConfigReader&) = delete;
  HfConfigReader& operator=(const HfConfigReader&) = delete;

  absl::Status Parse(const std::string& text);
  absl::Status Bad(const std::string& why) const;
  const std::string& path() const { return path_; }
  // A dimension: a positive integer as ptk-train's flags take it (at most 2^31 - 1).
  absl::Status GetInt(const char* key, int64_t* out, std::optional<int64_t> fallback) const;
  template <typename V>
  absl::Status Get(const char* key, V fallback, V* out, const char* what) const {
    simdjson::dom::element e;
    if (!Find(key, &e)) {
      *out = fallback;
      return absl::OkStatus();
    }
    if (e.get(*out)) return Bad(std::string(key) + " is not " + what);
    return absl::OkStatus();
  }
  // A real number in [lo, hi] (lo excluded when lo_open, hi when hi_open), as the model can use it.
  absl::Status GetReal(const char* key, double fallback, double* out, double lo, bool lo_open, double hi,
                       bool hi_open) const;
  // The value of `key` (false when absent or null).
  bool Find(const char* key, simdjson::dom::element* e) const;
  // Whether config.json has `key`, null too (where a config class tells null from absent).
  bool Present(const char* key) const { return fields_.count(key) != 0; }

 private:
  std::string path_;
  simdjson::dom::parser parser_;
  std::map<std::string_view, simdjson::dom::element> fields_;
};

}  // namespace ptk::hf_detail
