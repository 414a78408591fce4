// Megatron-LM's GPTFIMDataset sample rewrite: segments, fragments, the PSM/SPM permutation.
#include "indexed_dataset/fim_dataset.h"

#include <algorithm>

#include "common/status.h"

namespace ptk {

int64_t Utf8Length(std::string_view text) {
  int64_t n = 0;
  for (char ch : text) n += (static_cast<unsigned char>(ch) & 0xC0) != 0x80;
  return n;
}

size_t Utf8Offset(std::string_view text, int64_t cp) {
  int64_t seen = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) continue;
    if (seen == cp) return i;
    ++seen;
  }
  return text.size();
}

absl::Status FimTransform::Permute(std::span<const int64_t> seq, double rate, std::vector<int64_t>* out) {
  if (!Draw(rate)) {
    out->insert(out->end(), seq.begin(), seq.end());
    return absl::OkStatus();
  }
  PTK_ASSIGN_OR_RETURN(const std::string contents, c_.codec->Decode(seq));
  if (c_.no_prefix && contents.starts_with(*c_.no_prefix)) {
    out->insert(out->end(), seq.begin(), seq.end());
    return absl::OkStatus();
  }
  // randint(0, len + 1, size=2): two masked draws in [0, len], then sorted.
  const uint64_t len = static_cast<uint64_t>(Utf8Length(contents));
  int64_t b0 = static_cast<int64_t>(rng_.RandomInterval(len));
  int64_t b1 = static_cast<int64_t>(rng_.RandomInterval(len));
  if (b1 < b0) std::swap(b0, b1);
  const size_t o0 = Utf8Offset(contents, b0), o1 = Utf8Offset(contents, b1);
  const std::string_view text(contents);
  std::vector<int64_t> prefix, middle, suffix;
  PTK_RETURN_IF_ERROR(c_.codec->Encode(text.substr(0, o0), &prefix));
  PTK_RETURN_IF_ERROR(c_.codec->Encode(text.substr(o0, o1 - o0), &middle));
  PTK_RETURN_IF_ERROR(c_.codec->Encode(text.substr(o1), &suffix));
  auto append = [out](const std::vector<int64_t>& v) { out->insert(out->end(), v.begin(), v.end()); };
  if (Draw(c_.spm_rate)) {  // SPM: prefix and suffix sentinels, suffix, middle sentinel, prefix, middle
    out->push_back(c_.prefix);
    out->push_back(c_.suffix);
    append(suffix);
    out->push_back(c_.middle);
    append(prefix);
    append(middle);
  } else {  // PSM
    out->push_back(c_.prefix);
    append(prefix);
    out->push_back(c_.suffix);
    append(suffix);
    out->push_back(c_.middle);
    append(middle);
  }
  return absl::OkStatus();
}

absl::Status FimTransform::SplitAndPermute(std::span<const int64_t> seq, std::vector<int64_t>* out) {
  if (!c_.split_sample || std::find(seq.begin(), seq.end(), *c_.split_sample) == seq.end())
    return Permute(seq, c_.rate, out);
  if (!Draw(c_.rate)) {
    out->insert(out->end(), seq.begin(), seq.end());
    return absl::OkStatus();
  }
  size_t start = 0;
  for (size_t i = 0; i < seq.size(); ++i) {
    if (seq[i] != *c_.split_sample) continue;
    if (i > start) {  // empty fragments are left out, their split token kept
      PTK_RETURN_IF_ERROR(Permute(seq.subspan(start, i - start), c_.fragment_rate, out));
      out->push_back(*c_.split_sample);
    }
    start = i + 1;
  }
  return Permute(seq.subspan(start), c_.fragment_rate, out);
}

absl::Status FimTransform::Apply(std::vector<int64_t>* sample) {
  const std::span<const int64_t> s(*sample);
  std::vector<int64_t> out;
  out.reserve(s.size() + 16);
  if (std::find(s.begin(), s.end(), c_.eod) == s.end()) {
    PTK_RETURN_IF_ERROR(SplitAndPermute(s, &out));
  } else {
    size_t start = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != c_.eod) continue;
      if (i > start) {  // an empty segment (two EODs in a row) loses its EOD, as Megatron's
        PTK_RETURN_IF_ERROR(SplitAndPermute(s.subspan(start, i - start), &out));
        out.push_back(c_.eod);
      }
      start = i + 1;
    }
    PTK_RETURN_IF_ERROR(SplitAndPermute(s.subspan(start), &out));  // after the last EOD, even empty
  }
  out.resize(s.size(), c_.pad);
  *sample = std::move(out);
  return absl::OkStatus();
}

}  // namespace ptk
