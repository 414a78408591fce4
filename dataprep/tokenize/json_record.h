// Extracts the text fields of one JSON-lines record with Python json.loads semantics (what
// Megatron's preprocess_data.py applies): simdjson on the fast path; a hand-written parser for
// what simdjson rejects but Python accepts (lone surrogate escapes, NaN/Infinity, huge integers)
// and to repair invalid UTF-8 (U+FFFD per maximal ill-formed subpart) instead of dropping the record.
#pragma once

#include <deque>
#include <string>
#include <string_view>
#include <vector>

#include <simdjson.h>

namespace ptk {

enum class RecordStatus {
  kOk,
  kBlank,       // empty or whitespace-only line
  kMalformed,   // not valid JSON (message says where)
  kNotObject,   // valid JSON but not an object
  kMissingKey,  // a --json-keys key is absent
  kNotString,   // a key's value is neither a string nor a list of strings
};
const char* RecordStatusName(RecordStatus s);

struct RecordResult {
  RecordStatus status = RecordStatus::kOk;
  std::string message;         // details for a bad record
  size_t invalid_utf8 = 0;     // ill-formed UTF-8 subparts replaced by U+FFFD
  size_t lone_surrogates = 0;  // \uD800-style escapes without their pair, replaced by U+FFFD
};

// One parser per thread; the views it returns stay valid until the next Parse().
class JsonRecordParser {
 public:
  explicit JsonRecordParser(std::vector<std::string> keys);

  // `line` has no trailing newline. When `padded` is true, simdjson::SIMDJSON_PADDING readable
  // bytes follow it in memory (their contents do not matter), which avoids a copy.
  RecordResult Parse(std::string_view line, bool padded);

  // Per key (in the order given), the sentences: one for a string, several for a list of strings.
  const std::vector<std::vector<std::string_view>>& fields() const { return fields_; }

 private:
  bool FastPath(std::string_view line, bool padded, RecordResult* r);
  void SlowPath(std::string_view line, RecordResult* r);

  std::vector<std::string> keys_;
  std::vector<std::vector<std::string_view>> fields_;
  simdjson::dom::parser parser_;
  std::string padded_copy_, repaired_;
  std::deque<std::string> storage_;
};

}  // namespace ptk
