// UTF-8 validation and repair with Python's bytes.decode("utf-8", "replace") semantics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ptk {

// The UTF-8 byte order mark (U+FEFF) Windows tools put before a file's text. Every data stage reads
// it as Python's utf-8-sig codec does: dropped where it starts a file, a character anywhere else
// (before a record's JSON: a record Python's json.loads refuses, "Unexpected UTF-8 BOM").
inline constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";

// True if `s` is well-formed UTF-8 (no surrogates, no overlongs, nothing above U+10FFFF).
bool IsValidUtf8(std::string_view s);

// Appends `in` to `out`, replacing every maximal ill-formed subpart with U+FFFD (EF BF BD), exactly
// as CPython's UTF-8 decoder with errors="replace": "\xE2\x82a" -> "\uFFFDa", "\xED\xA0\x80" -> three
// U+FFFD. Returns the number of replacements made.
size_t AppendUtf8Replacing(std::string_view in, std::string* out);

// Appends the UTF-8 encoding of code point cp (cp <= 0x10FFFF, not a surrogate).
void AppendUtf8(uint32_t cp, std::string* out);

}  // namespace ptk
