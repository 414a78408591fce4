// Escapes a string for the inside of a JSON string literal (ptk's own sidecars, plans and
// manifests): '"' and '\\' get a backslash, control characters become \u00XX, UTF-8 passes through.
#pragma once

#include <string>
#include <string_view>

#include <fmt/format.h>

namespace ptk {

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

}  // namespace ptk
