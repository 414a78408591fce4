// JSON-lines record parsing with Python json semantics.
#include "dataprep/tokenize/json_record.h"

#include <cstring>

#include <fmt/core.h>

#include "common/utf8.h"

namespace ptk {

const char* RecordStatusName(RecordStatus s) {
  switch (s) {
    case RecordStatus::kOk: return "ok";
    case RecordStatus::kBlank: return "blank line";
    case RecordStatus::kMalformed: return "malformed JSON";
    case RecordStatus::kNotObject: return "not a JSON object";
    case RecordStatus::kMissingKey: return "missing key";
    case RecordStatus::kNotString: return "key not a string";
  }
  return "?";
}

JsonRecordParser::JsonRecordParser(std::vector<std::string> keys) : keys_(std::move(keys)), fields_(keys_.size()) {}

RecordResult JsonRecordParser::Parse(std::string_view line, bool padded) {
  RecordResult r;
  for (auto& f : fields_) f.clear();
  storage_.clear();
  // Python's json.loads refuses a str that starts with U+FEFF before it reads anything else (the reader
  // drops the one that starts a file, as the utf-8-sig codec would).
  if (line.starts_with(kUtf8Bom)) {
    r.status = RecordStatus::kMalformed;
    r.message = "Unexpected UTF-8 BOM";
    return r;
  }
  size_t i = 0;
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r' || line[i] == '\n')) ++i;
  if (i == line.size()) {
    r.status = RecordStatus::kBlank;
    r.message = line.empty() ? "empty line" : "whitespace-only line";
    return r;
  }
  if (!FastPath(line, padded, &r)) SlowPath(line, &r);
  return r;
}

bool JsonRecordParser::FastPath(std::string_view line, bool padded, RecordResult* r) {
  simdjson::dom::element root;
  simdjson::error_code err;
  if (padded) {
    err = parser_.parse(line.data(), line.size(), false).get(root);
  } else {
    err = parser_.parse(line.data(), line.size(), true).get(root);
  }
  if (err) return false;  // the slow path decides what Python would have done
  simdjson::dom::object obj;
  if (root.get_object().get(obj)) {
    r->status = RecordStatus::kNotObject;
    r->message = "the line is valid JSON but not an object";
    return true;
  }
  std::vector<simdjson::dom::element> found(keys_.size());
  std::vector<bool> have(keys_.size(), false);
  for (auto field : obj) {
    for (size_t k = 0; k < keys_.size(); ++k) {
      if (field.key == keys_[k]) {  // later duplicates win, as in Python's dict
        found[k] = field.value;
        have[k] = true;
      }
    }
  }
  for (size_t k = 0; k < keys_.size(); ++k) {
    if (!have[k]) {
      r->status = RecordStatus::kMissingKey;
      r->message = fmt::format("no key \"{}\"", keys_[k]);
      return true;
    }
    std::string_view sv;
    if (!found[k].get_string().get(sv)) {
      fields_[k].push_back(sv);
      continue;
    }
    simdjson::dom::array arr;
    if (!found[k].get_array().get(arr)) {
      for (auto el : arr) {
        if (el.get_string().get(sv)) {
          r->status = RecordStatus::kNotString;
          r->message = fmt::format("key \"{}\" holds a list with a non-string element", keys_[k]);
          return true;
        }
        fields_[k].push_back(sv);
      }
      continue;
    }
    r->status = RecordStatus::kNotString;
    r->message = fmt::format("key \"{}\" is not a string", keys_[k]);
    return true;
  }
  return true;
}

namespace {

// Recursive-descent JSON parser with CPython json.loads semantics (strict=True): accepts NaN,
// Infinity, -Infinity and integers of any size, rejects raw control characters in strings, keeps
// lone surrogate escapes (here replaced by U+FFFD and counted).
class PyJson {
 public:
  PyJson(std::string_view s, RecordResult* r) : s_(s), r_(r) {}

  struct Value {
    enum Kind { kOther, kString, kArray, kObject } kind = kOther;
  };

  bool Fail(const std::string& what) {
    if (error_.empty()) error_ = fmt::format("{} at column {}", what, pos_ + 1);
    return false;
  }
  const std::string& error() const { return error_; }

  void Ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool AtEnd() const { return pos_ >= s_.size(); }
  size_t pos() const { return pos_; }

  static int Hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  bool Hex4(size_t at, uint32_t* v) {
    if (at + 4 > s_.size()) return false;
    uint32_t x = 0;
    for (size_t i = 0; i < 4; ++i) {
      int h = Hex(s_[at + i]);
      if (h < 0) return false;
      x = x * 16 + static_cast<uint32_t>(h);
    }
    *v = x;
    return true;
  }

  // pos_ at the opening quote. Appends the decoded string to *out when out != nullptr.
  bool String(std::string* out) {
    ++pos_;
    size_t run = pos_;
    while (true) {
      if (pos_ >= s_.size()) return Fail("Unterminated string starting");
      unsigned char c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        if (out) out->append(s_.data() + run, pos_ - run);
        ++pos_;
        return true;
      }
      if (c < 0x20) return Fail("Invalid control character");
      if (c != '\\') {
        ++pos_;
        continue;
      }
      if (out) out->append(s_.data() + run, pos_ - run);
      if (pos_ + 1 >= s_.size()) return Fail("Unterminated string starting");
      char e = s_[pos_ + 1];
      const char* simple = nullptr;
      switch (e) {
        case '"': simple = "\""; break;
        case '\\': simple = "\\"; break;
        case '/': simple = "/"; break;
        case 'b': simple = "\b"; break;
        case 'f': simple = "\f"; break;
        case 'n': simple = "\n"; break;
        case 'r': simple = "\r"; break;
        case 't': simple = "\t"; break;
        default: break;
      }
      if (simple) {
        if (out) out->push_back(*simple);
        pos_ += 2;
      } else if (e == 'u') {
        uint32_t cp;
        if (!Hex4(pos_ + 2, &cp)) {
          pos_ += 1;
          return Fail("Invalid \\uXXXX escape");
        }
        pos_ += 6;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          uint32_t lo;
          if (pos_ + 1 < s_.size() && s_[pos_] == '\\' && s_[pos_ + 1] == 'u' && Hex4(pos_ + 2, &lo) && lo >= 0xDC00 &&
              lo <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            pos_ += 6;
          } else {
            cp = 0xFFFD;
            ++r_->lone_surrogates;
          }
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
          cp = 0xFFFD;
          ++r_->lone_surrogates;
        }
        if (out) AppendUtf8(cp, out);
      } else {
        return Fail("Invalid \\escape");
      }
      run = pos_;
    }
  }

  bool Literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) == lit) {
      pos_ += lit.size();
      return true;
    }
    return false;
  }

  bool Number() {
    size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (pos_ < s_.size() && s_[pos_] >= '1' && s_[pos_] <= '9') {
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    } else {
      pos_ = start;
      return Fail("Expecting value");
    }
    if (pos_ + 1 < s_.size() && s_[pos_] == '.' && s_[pos_ + 1] >= '0' && s_[pos_ + 1] <= '9') {
      pos_ += 1;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      size_t save = pos_;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
        while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      } else {
        pos_ = save;  // Python's regex leaves the exponent out; what follows is extra data
      }
    }
    return true;
  }

  // Parses any value; *kind reports its type. `sink` receives a string value's text.
  bool AnyValue(int depth, Value::Kind* kind, std::string* sink, std::vector<std::string>* list_sink, bool* list_ok) {
    if (depth > 1000) return Fail("nesting too deep");
    Ws();
    if (pos_ >= s_.size()) return Fail("Expecting value");
    char c = s_[pos_];
    if (c == '"') {
      *kind = Value::kString;
      return String(sink);
    }
    if (c == '{') {
      *kind = Value::kObject;
      return Object(depth + 1, nullptr);
    }
    if (c == '[') {
      *kind = Value::kArray;
      return Array(depth + 1, list_sink, list_ok);
    }
    *kind = Value::kOther;
    if (Literal("null") || Literal("true") || Literal("false") || Literal("NaN") || Literal("Infinity") ||
        Literal("-Infinity"))
      return true;
    return Number();
  }

  bool Array(int depth, std::vector<std::string>* list_sink, bool* list_ok) {
    ++pos_;
    Ws();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return true;
    }
    while (true) {
      Value::Kind k;
      std::string item;
      if (!AnyValue(depth, &k, list_sink ? &item : nullptr, nullptr, nullptr)) return false;
      if (list_sink) {
        if (k == Value::kString)
          list_sink->push_back(std::move(item));
        else if (list_ok)
          *list_ok = false;
      }
      Ws();
      if (pos_ >= s_.size()) return Fail("Expecting ',' delimiter");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == ']') {
        ++pos_;
        return true;
      }
      return Fail("Expecting ',' delimiter");
    }
  }

  // Top-level object (handler != nullptr) or a nested one.
  struct Handler {
    const std::vector<std::string>* keys;
    std::vector<int>* state;  // per key: 0 missing, 1 string, 2 list of strings, 3 other
    std::vector<std::string>* strings;
    std::vector<std::vector<std::string>>* lists;
  };
  bool Object(int depth, Handler* h) {
    ++pos_;
    Ws();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return true;
    }
    while (true) {
      Ws();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Fail("Expecting property name enclosed in double quotes");
      std::string key;
      if (!String(&key)) return false;
      Ws();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Fail("Expecting ':' delimiter");
      ++pos_;
      int want = -1;
      if (h) {
        for (size_t k = 0; k < h->keys->size(); ++k)
          if ((*h->keys)[k] == key) want = static_cast<int>(k);
      }
      Value::Kind kind;
      if (want >= 0) {
        std::string text;
        std::vector<std::string> list;
        bool list_ok = true;
        if (!AnyValue(depth, &kind, &text, &list, &list_ok)) return false;
        (*h->state)[want] = kind == Value::kString ? 1 : (kind == Value::kArray && list_ok) ? 2 : 3;
        (*h->strings)[want] = std::move(text);
        (*h->lists)[want] = std::move(list);
      } else {
        if (!AnyValue(depth, &kind, nullptr, nullptr, nullptr)) return false;
      }
      Ws();
      if (pos_ >= s_.size()) return Fail("Expecting ',' delimiter");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == '}') {
        ++pos_;
        return true;
      }
      return Fail("Expecting ',' delimiter");
    }
  }

 private:
  std::string_view s_;
  RecordResult* r_;
  size_t pos_ = 0;
  std::string error_;
};

}  // namespace

void JsonRecordParser::SlowPath(std::string_view line, RecordResult* r) {
  std::string_view text = line;
  if (!IsValidUtf8(line)) {
    repaired_.clear();
    r->invalid_utf8 = AppendUtf8Replacing(line, &repaired_);
    text = repaired_;
  }
  PyJson p(text, r);
  std::vector<int> state(keys_.size(), 0);
  std::vector<std::string> strings(keys_.size());
  std::vector<std::vector<std::string>> lists(keys_.size());
  p.Ws();
  bool ok;
  bool is_object = !p.AtEnd() && text[p.pos()] == '{';
  if (is_object) {
    PyJson::Handler h{&keys_, &state, &strings, &lists};
    ok = p.Object(1, &h);
  } else {
    PyJson::Value::Kind kind;
    ok = p.AnyValue(1, &kind, nullptr, nullptr, nullptr);
  }
  if (ok) {
    p.Ws();
    if (!p.AtEnd()) ok = p.Fail("Extra data");
  }
  if (!ok) {
    r->status = RecordStatus::kMalformed;
    r->message = p.error();
    return;
  }
  if (!is_object) {
    r->status = RecordStatus::kNotObject;
    r->message = "the line is valid JSON but not an object";
    return;
  }
  for (size_t k = 0; k < keys_.size(); ++k) {
    if (state[k] == 0) {
      r->status = RecordStatus::kMissingKey;
      r->message = fmt::format("no key \"{}\"", keys_[k]);
      return;
    }
    if (state[k] == 3) {
      r->status = RecordStatus::kNotString;
      r->message = fmt::format("key \"{}\" is not a string or a list of strings", keys_[k]);
      return;
    }
    if (state[k] == 1) {
      storage_.push_back(std::move(strings[k]));
      fields_[k].push_back(storage_.back());
    } else {
      for (auto& s : lists[k]) {
        storage_.push_back(std::move(s));
        fields_[k].push_back(storage_.back());
      }
    }
  }
}

}  // namespace ptk
