// ptk-extract's --drop-set filter (extract_detail: named only by extract.cpp).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <simdjson.h>

namespace ptk::extract_detail {

// `line` as strict JSON that simdjson reads, where Python's json.loads (which NeMo's drop of
// RedPajamaBook runs) reads it: invalid UTF-8 becomes U+FFFD (as ptk-tokenize repairs it), a lone
// surrogate escape \uD800 becomes \uFFFD, NaN/Infinity/-Infinity outside strings become null.
std::string PythonJsonAsStrictJson(std::string_view line);

// Decides from meta.redpajama_set_name whether a record is dropped. A line Python's json.loads
// reads and simdjson does not (invalid UTF-8, a lone surrogate escape, NaN) is read as Python reads
// it: such a record of a dropped set was kept, and its text tokenized. Lines no JSON reader reads
// are kept (ptk-tokenize reports them).
class SetFilter {
 public:
  explicit SetFilter(const std::vector<std::string>& drops) : drops_(drops) {}
  // The index in `drops` of the set whose record `line` is, or -1 (kept).
  int Match(std::string_view line) {
    if (line.find("redpajama_set_name") == std::string_view::npos) return -1;
    simdjson::dom::element e;
    if (parser_.parse(line.data(), line.size(), true).get(e)) {
      repaired_ = PythonJsonAsStrictJson(line);
      if (parser_.parse(repaired_).get(e)) return -1;
    }
    // A key given twice: the last one counts, as in Python's json (and ptk-tokenize).
    auto last = [](simdjson::dom::element obj, std::string_view key) -> std::optional<simdjson::dom::element> {
      simdjson::dom::object o;
      if (obj.get(o)) return std::nullopt;
      std::optional<simdjson::dom::element> found;
      for (auto field : o)
        if (field.key == key) found = field.value;
      return found;
    };
    auto meta = last(e, "meta");
    if (!meta) return -1;
    auto name = last(*meta, "redpajama_set_name");
    std::string_view set;
    if (!name || name->get(set)) return -1;
    for (size_t k = 0; k < drops_.size(); ++k)
      if (set == drops_[k]) return static_cast<int>(k);
    return -1;
  }

 private:
  const std::vector<std::string>& drops_;
  simdjson::dom::parser parser_;
  std::string repaired_;
};

}  // namespace ptk::extract_detail
