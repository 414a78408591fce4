// Hugging Face config.json: written with transformers' layout, read with its defaults and the refusals named.
#include "interop/hf_config.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

#include "common/json_writer.h"
#include "common/py_format.h"
#include "common/status.h"

namespace ptk::hf_detail {

std::string Shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string PrettyConfig(std::vector<std::pair<std::string, std::string>> fields, int indent) {
  std::sort(fields.begin(), fields.end());
  const std::string pad(static_cast<size_t>(2 * indent), ' ');
  std::string out = "{\n";
  for (size_t i = 0; i < fields.size(); ++i)
    out += fmt::format("{}  \"{}\": {}{}\n", pad, fields[i].first, fields[i].second, i + 1 < fields.size() ? "," : "");
  return out + pad + "}" + (indent == 0 ? "\n" : "");
}
std::string Num(double v) { return py::FloatRepr(v); }
std::string Int(int64_t v) { return std::to_string(v); }
std::string Str(std::string_view s) { return fmt::format("\"{}\"", JsonEscape(s)); }
std::string Bool(bool b) { return b ? "true" : "false"; }

absl::Status HfConfigReader::Parse(const std::string& text) {
  simdjson::dom::object object;
  if (parser_.parse(text).get(object)) return Bad("not a JSON object");
  // A key given twice takes its last value (as json.load); simdjson's lookup would find the first.
  for (auto field : object) fields_[field.key] = field.value;
  return absl::OkStatus();
}

absl::Status HfConfigReader::Bad(const std::string& why) const {
  return absl::InvalidArgumentError(fmt::format("{}: {}", path_, why));
}

absl::Status HfConfigReader::GetInt(const char* key, int64_t* out, std::optional<int64_t> fallback) const {
  simdjson::dom::element e;
  if (!Find(key, &e)) {
    if (fallback) {
      *out = *fallback;
      return absl::OkStatus();
    }
    return Bad(fmt::format("{} is missing", key));
  }
  if (e.get(*out) || *out < 1 || *out > kMaxDimension)
    return Bad(fmt::format("{} is not a positive integer of at most {}", key, kMaxDimension));
  return absl::OkStatus();
}

absl::Status HfConfigReader::GetReal(const char* key, double fallback, double* out, double lo, bool lo_open, double hi,
                                     bool hi_open) const {
  PTK_RETURN_IF_ERROR(Get(key, fallback, out, "a number"));
  if (!std::isfinite(*out) || (lo_open ? *out <= lo : *out < lo) || (hi_open ? *out >= hi : *out > hi))
    return Bad(fmt::format("{} {} is outside {}{}, {}{}", key, Num(*out), lo_open ? "(" : "[", Num(lo), Num(hi),
                           hi_open ? ")" : "]"));
  return absl::OkStatus();
}

bool HfConfigReader::Find(const char* key, simdjson::dom::element* e) const {
  auto it = fields_.find(key);
  if (it == fields_.end() || it->second.is_null()) return false;
  *e = it->second;
  return true;
}

}  // namespace ptk::hf_detail
