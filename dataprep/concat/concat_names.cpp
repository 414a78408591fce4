// ptk-concat's chunk names: --name-pattern formatted for one chunk, refused where no later stage would read it.
#include <cctype>

#include <fmt/core.h>
#include <fmt/format.h>

#include "common/status.h"
#include "dataprep/concat/concat.h"
#include "dataprep/input/byte_source.h"
#include "dataprep/input/input_list.h"

namespace ptk::concat_detail {

absl::StatusOr<std::string> ChunkName(const std::string& pattern, int64_t index, int64_t count) {
  std::string pat = pattern;
  if (pat.empty()) {
    int width = 2;
    for (int64_t n = count - 1; n >= 100; n /= 10) ++width;
    pat = fmt::format("train_{{:0{}d}}.jsonl", width);
  }
  // A width or precision in the thousands asks fmt for that many bytes: refuse before formatting.
  for (size_t i = 0; i < pat.size(); ++i) {
    if (pat[i] != '{') continue;
    if (i + 1 < pat.size() && pat[i + 1] == '{') {
      ++i;  // "{{" is a literal brace
      continue;
    }
    size_t run = 0;
    for (size_t j = i + 1; j < pat.size() && pat[j] != '}'; ++j) {
      run = std::isdigit(static_cast<unsigned char>(pat[j])) ? run + 1 : 0;
      if (run > 3)
        return UsageError(
            fmt::format("--name-pattern {:?}: a width or precision that large makes no file name", pattern));
    }
  }
  try {
    std::string name = fmt::format(fmt::runtime(pat), index);
    if (name.size() > 255)
      return UsageError(fmt::format("--name-pattern {:?} gives a name longer than 255 bytes", pattern));
    if (name.empty() || name.find('/') != std::string::npos)
      return UsageError(fmt::format("--name-pattern {:?} gives an invalid file name", pattern));
    // A chunk is plain jsonl: under a compression suffix ptk-tokenize refuses it (named .zst, not
    // compressed), and under a hidden or ptk-owned name every directory walk leaves it out unsaid.
    for (std::string_view suffix : kCompressionSuffixes)
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        return UsageError(fmt::format(
            "--name-pattern {:?} gives {:?}: a chunk is plain jsonl, and ptk-tokenize refuses a file named {} "
            "that is not compressed; name chunks .jsonl",
            pattern, name, suffix));
    if (name[0] == '.' || IsPtkOwnName(name))
      return UsageError(fmt::format(
          "--name-pattern {:?} gives {:?}, a {} name that every ptk directory walk leaves out; name chunks "
          "like train_{{}}.jsonl",
          pattern, name, name[0] == '.' ? "hidden" : "ptk bookkeeping (.ptk-done, .ptk-lock, .ptk-tmp-...)"));
    return name;
  } catch (const fmt::format_error& e) {
    return UsageError(fmt::format("--name-pattern {:?}: {}", pattern, e.what()));
  }
}

}  // namespace ptk::concat_detail
