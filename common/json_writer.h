// Writes ptk's own JSON (checkpoint headers, sidecars, plans, manifests, metrics): one value built
// call by call, keys in the order given, separators as Python's json.dumps (", " and ": "),
// strings escaped ('"', '\\' and control characters; UTF-8 passes through), floats as Python's
// repr. An array begun with one_per_line puts each element on its own line.
//
//   JsonWriter w;
//   w.BeginObject().Field("iteration", 10).Key("tensors").BeginArray();
//   for (...) w.BeginObject().Field("name", name).EndObject();
//   std::string json = w.EndArray().EndObject().str();
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "common/py_format.h"

namespace ptk {

// The inside of a JSON string literal.
inline std::string JsonEscape(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      o += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
    } else {
      o += c;
    }
  }
  return o;
}

class JsonWriter {
 public:
  JsonWriter& BeginObject() { return Open('{', false); }
  JsonWriter& EndObject() { return Close('}'); }
  JsonWriter& BeginArray(bool one_per_line = false) { return Open('[', one_per_line); }
  JsonWriter& EndArray() { return Close(']'); }

  JsonWriter& Key(std::string_view key) {
    Separate();
    out_ += '"' + JsonEscape(key) + "\": ";
    after_key_ = true;
    return *this;
  }
  JsonWriter& Value(std::string_view s) { return Put('"' + JsonEscape(s) + '"'); }
  JsonWriter& Value(const char* s) { return Value(std::string_view(s)); }
  JsonWriter& Value(const std::string& s) { return Value(std::string_view(s)); }
  JsonWriter& Value(bool b) { return Put(b ? "true" : "false"); }
  JsonWriter& Value(int v) { return Put(std::to_string(v)); }
  JsonWriter& Value(long v) { return Put(std::to_string(v)); }
  JsonWriter& Value(long long v) { return Put(std::to_string(v)); }
  JsonWriter& Value(unsigned v) { return Put(std::to_string(v)); }
  JsonWriter& Value(unsigned long v) { return Put(std::to_string(v)); }
  JsonWriter& Value(unsigned long long v) { return Put(std::to_string(v)); }
  JsonWriter& Value(double v) { return Put(py::FloatRepr(v)); }
  // A float that Python holds as an int when it is whole (Megatron's lr_warmup_steps: iterations x batch,
  // or a fraction of the decay): written as that int, else as Value(double).
  JsonWriter& WholeOrFloat(double v) {
    if (v == std::floor(v) && std::abs(v) < 9e15) return Value(static_cast<long long>(v));
    return Value(v);
  }
  // A value that is JSON already (e.g. an object written by another JsonWriter).
  JsonWriter& Raw(std::string_view json) { return Put(json); }
  template <typename T>
  JsonWriter& Field(std::string_view key, const T& value) {
    Key(key);
    return Value(value);
  }

  const std::string& str() const { return out_; }

 private:
  struct Level {
    bool first = true;
    bool one_per_line = false;
  };
  void Separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (levels_.empty()) return;
    Level& l = levels_.back();
    if (!l.first) out_ += l.one_per_line ? "," : ", ";
    l.first = false;
    if (l.one_per_line) NewLine(levels_.size() - 1);
  }
  // A line break and `depth` levels of indent, appended in place (no temporary string: GCC 12
  // reports -Wrestrict on "\n" + std::string(n, ' ') at -O3, a false positive).
  void NewLine(size_t depth) {
    out_ += '\n';
    out_.append(2 * depth, ' ');
  }
  JsonWriter& Put(std::string_view token) {
    Separate();
    out_ += token;
    return *this;
  }
  JsonWriter& Open(char bracket, bool one_per_line) {
    Separate();
    out_ += bracket;
    levels_.push_back({true, one_per_line});
    return *this;
  }
  JsonWriter& Close(char bracket) {
    const bool lines = levels_.back().one_per_line;
    levels_.pop_back();
    if (lines) NewLine(levels_.empty() ? 0 : levels_.size() - 1);
    out_ += bracket;
    return *this;
  }

  std::string out_;
  std::vector<Level> levels_;
  bool after_key_ = false;
};

}  // namespace ptk
