// Parsing numbers from untrusted text (HTTP headers, URL lists, environment variables) without
// exceptions: nullopt for anything that is not a plain decimal number that fits.
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ptk {

// Decimal digits only (no sign, no spaces), at most 2^64-1.
inline std::optional<uint64_t> ParseUint64(std::string_view s) {
  if (s.empty()) return std::nullopt;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

// An optional '-' then decimal digits, within int64.
inline std::optional<int64_t> ParseInt64(std::string_view s) {
  if (s.empty() || s[0] == '+') return std::nullopt;
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

}  // namespace ptk
