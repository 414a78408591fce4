// ptk-extract's --drop-set: a record's JSON read as Python's json.loads reads it.
#include "dataprep/extract/set_filter.h"

#include "common/utf8.h"

namespace ptk::extract_detail {

// `line` as strict JSON that simdjson reads, where Python's json.loads (which NeMo's drop of
// RedPajamaBook runs) reads it: invalid UTF-8 becomes U+FFFD (as ptk-tokenize repairs it), a lone
// surrogate escape \uD800 becomes \uFFFD, NaN/Infinity/-Infinity outside strings become null.
std::string PythonJsonAsStrictJson(std::string_view line) {
  std::string utf8;
  AppendUtf8Replacing(line, &utf8);
  std::string out;
  out.reserve(utf8.size());
  auto hex4 = [&](size_t at) -> int {  // the 4 hex digits at `at`, or -1
    if (at + 4 > utf8.size()) return -1;
    int v = 0;
    for (size_t i = at; i < at + 4; ++i) {
      const char c = utf8[i];
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0) return -1;
      v = v * 16 + d;
    }
    return v;
  };
  bool in_string = false;
  for (size_t i = 0; i < utf8.size();) {
    const char c = utf8[i];
    if (in_string) {
      if (c == '"') in_string = false;
      if (c == '\\' && i + 1 < utf8.size()) {
        if (utf8[i + 1] == 'u') {
          const int u = hex4(i + 2);
          if (u >= 0xD800 && u <= 0xDBFF && i + 12 <= utf8.size() && utf8[i + 6] == '\\' && utf8[i + 7] == 'u' &&
              hex4(i + 8) >= 0xDC00 && hex4(i + 8) <= 0xDFFF) {
            out.append(utf8, i, 12);  // a pair
            i += 12;
            continue;
          }
          if (u >= 0xD800 && u <= 0xDFFF) {
            out += "\\uFFFD";
            i += 6;
            continue;
          }
        }
        out.append(utf8, i, 2);
        i += 2;
        continue;
      }
      out += c;
      ++i;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (std::string_view word : {"-Infinity", "Infinity", "NaN"})
      if (std::string_view(utf8).substr(i, word.size()) == word) {
        out += "null";
        i += word.size();
        replaced = true;
        break;
      }
    if (!replaced) {
      out += c;
      ++i;
    }
  }
  return out;
}

}  // namespace ptk::extract_detail
