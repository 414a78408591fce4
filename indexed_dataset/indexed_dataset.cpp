// Megatron MMIDIDX v1 reader (the writer: indexed_dataset_builder.cpp).
#include "indexed_dataset/indexed_dataset.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/status.h"
#include "indexed_dataset/dataset_prefix_hints.h"

namespace ptk {

absl::StatusOr<std::string> ResolveDatasetPrefix(const std::string& arg, bool accept_file_names) {
  std::string prefix = arg;
  for (std::string_view ext : {".bin", ".idx"})
    if (prefix.size() > ext.size() && prefix.compare(prefix.size() - ext.size(), ext.size(), ext) == 0)
      prefix.resize(prefix.size() - ext.size());
  const bool has_idx = PathExists(IdxPath(prefix)), has_bin = PathExists(BinPath(prefix));
  const bool exists = has_idx || has_bin;
  // Half a dataset (a copy or a download that stopped, one file deleted): said so, not "cannot open".
  if (has_idx != has_bin && (accept_file_names || prefix == arg) && !PathExists(PublishJournalPath(prefix)))
    return absl::NotFoundError(fmt::format(
        "{}: {} is there but not {}: a dataset is the pair of files (one copied or deleted without the other?)", arg,
        has_bin ? BinPath(prefix) : IdxPath(prefix), has_bin ? IdxPath(prefix) : BinPath(prefix)));
  if (exists && (accept_file_names || prefix == arg)) return prefix;
  if (exists)
    return absl::NotFoundError(fmt::format(
        "{}: no dataset here: a dataset is named by its prefix, without .bin or .idx: did you mean {}?", arg, prefix));
  // The directory the datasets are in (--data-path preprocessed/): the prefixes to give instead.
  if (const std::vector<std::string> held = IsDirectory(arg) ? DatasetsIn(arg) : std::vector<std::string>{};
      !held.empty()) {
    std::string list;
    for (size_t i = 0; i < held.size() && i < 4; ++i) list += (i ? ", " : "") + held[i];
    return absl::NotFoundError(fmt::format(
        "{}: no dataset here: a directory; a dataset is named by its prefix (PREFIX.bin and PREFIX.idx): it holds "
        "{}{} ({} dataset(s)): give their prefixes",
        arg, list, held.size() > 4 ? ", ..." : "", held.size()));
  }
  std::vector<std::string> near;
  if (PathExists(IdxPath(prefix + "_text_document"))) {
    near.push_back(prefix + "_text_document");
  } else if (auto found = ExpandGlobs({prefix + "*_document.idx"}); found.ok()) {
    for (const auto& f : *found) near.push_back(f.substr(0, f.size() - 4));
  }
  if (near.empty() && arg.find_first_of(" \t") != std::string::npos)
    return absl::NotFoundError(fmt::format(
        "{:?}: no dataset here; it holds spaces: weights and prefixes are separate arguments, as Megatron takes them "
        "(--data-path 0.3 A 0.7 B, unquoted, or \"$DATA_PATH\" without quotes)",
        arg));
  if (near.empty()) {
    // A training checkpoint given where a dataset belongs (ptk-inspect ckpt, --data-path ckpt).
    auto ends_with = [&](std::string_view e) {
      return arg.size() >= e.size() && arg.rfind(e) == arg.size() - e.size();
    };
    const bool checkpoint_dir = IsDirectory(arg) && (PathExists(JoinPath(arg, "latest_checkpointed_iteration.txt")) ||
                                                     PathExists(JoinPath(arg, "mp_rank_00")));
    if (checkpoint_dir || ends_with("model_optim_rng.ptk") || ends_with("model_optim_rng.pt"))
      return absl::NotFoundError(fmt::format(
          "{}: no dataset here: it is a training checkpoint (a --save directory or its file), not a dataset (a "
          "PREFIX.bin and PREFIX.idx pair); ptk-convert reads checkpoints",
          arg));
    // A number where a prefix belongs: a weight without its dataset made the list odd, so every word
    // was read as a prefix (as Megatron reads an odd list).
    char* end = nullptr;
    errno = 0;
    if (!arg.empty() && (std::strtod(arg.c_str(), &end), end == arg.c_str() + arg.size()))
      return absl::NotFoundError(fmt::format(
          "{}: no dataset here: a number where a dataset prefix belongs: in a data path list of an odd number of "
          "words (a weight without its dataset?) every word is read as a prefix, as Megatron reads it",
          arg));
    return NoDatasetAt(arg, prefix);
  }
  std::string list;
  for (size_t i = 0; i < near.size() && i < 4; ++i) list += (i ? ", " : "") + near[i];
  return absl::NotFoundError(fmt::format(
      "{}: no dataset here; ptk-tokenize and Megatron name their outputs PREFIX_{{key}}_document: did you mean {}{}?",
      arg, list, near.size() > 4 ? ", ..." : ""));
}

absl::StatusOr<std::unique_ptr<IndexedDataset>> IndexedDataset::Open(const std::string& prefix, bool multimodal) {
  // Nothing of the dataset here: say which name was meant, when one near it holds a dataset.
  // Half of one: which file is missing.
  if (!(PathExists(IdxPath(prefix)) && PathExists(BinPath(prefix))) && !PathExists(PublishJournalPath(prefix)))
    PTK_RETURN_IF_ERROR(ResolveDatasetPrefix(prefix, /*accept_file_names=*/false).status());
  if (PathExists(PublishJournalPath(prefix))) {
    absl::Status st = CompletePendingPublish(PublishJournalPath(prefix));
    if (!st.ok())
      return absl::DataLossError(fmt::format(
          "{}: a writer was interrupted while publishing the .bin/.idx pair and it could not be completed ({}); rerun "
          "the tool that writes it",
          prefix, StatusMessage(st)));
  }
  std::unique_ptr<IndexedDataset> ds(new IndexedDataset());
  ds->prefix_ = prefix;
  ds->multimodal_ = multimodal;
  PTK_ASSIGN_OR_RETURN(ds->idx_, MappedFile::Open(IdxPath(prefix)));
  // Training reads samples at random: no readahead around each one.
  PTK_ASSIGN_OR_RETURN(ds->bin_, MappedFile::Open(BinPath(prefix), MappedFile::Advice::kRandom));
  PTK_RETURN_IF_ERROR(ds->Validate());
  return ds;
}

absl::Status IndexedDataset::ValidateHeader() {
  const std::string idx_path = IdxPath(prefix_);
  const uint8_t* p = idx_->data();
  const uint64_t size = idx_->size();
  auto loss = [&](const std::string& what) { return absl::DataLossError(fmt::format("{}: {}", idx_path, what)); };
  if (size < kIndexHeaderSize)
    return loss(fmt::format("file is {} bytes, shorter than the {}-byte header (truncated?)", size, kIndexHeaderSize));
  if (std::memcmp(p, kIndexMagic, sizeof(kIndexMagic)) != 0)
    return loss("bad magic: not a Megatron MMIDIDX index (expected \"MMIDIDX\\0\\0\" at offset 0)");
  uint64_t version;
  std::memcpy(&version, p + 9, 8);
  if (version != 1) return loss(fmt::format("unsupported version {} at offset 9 (only version 1 exists)", version));
  auto dt = DTypeFromCode(p[17]);
  if (!dt) return loss(fmt::format("unknown dtype code {} at offset 17 (valid codes are 1..8)", p[17]));
  dtype_ = *dt;
  uint64_t s, d;
  std::memcpy(&s, p + 18, 8);
  std::memcpy(&d, p + 26, 8);
  // Sizes in 128 bits so absurd counts cannot overflow.
  const unsigned __int128 want = static_cast<unsigned __int128>(kIndexHeaderSize) +
                                 static_cast<unsigned __int128>(s) * 12 + static_cast<unsigned __int128>(d) * 8 +
                                 (multimodal_ ? s : 0);
  // Bytes after the arrays are ignored, as Megatron's _IndexReader reads only the counts' arrays.
  if (want > size) {
    std::string hint = (multimodal_ && s > 0 && want - s == size)
                           ? " (no modes array: not a multimodal index; open it without --multimodal)"
                           : " (truncated or corrupt)";
    return loss(
        fmt::format("file is {} bytes but sequence_count={} and document_count={} need {} (34 + 12*S + 8*D{}){}", size,
                    s, d, static_cast<uint64_t>(want), multimodal_ ? " + modes" : "", hint));
  }
  idx_trailing_bytes_ = size - static_cast<uint64_t>(want);
  if (idx_trailing_bytes_ > 0)
    idx_trailing_warning_ =
        fmt::format("{}: {} trailing byte{} at offset {}, after the {}, ignored as Megatron's reader ignores them{}",
                    idx_path, idx_trailing_bytes_, idx_trailing_bytes_ == 1 ? "" : "s", static_cast<uint64_t>(want),
                    multimodal_ ? "sequence modes" : "document index",
                    !multimodal_ && idx_trailing_bytes_ == s
                        ? " (one per sequence: a multimodal index's modes? open it as multimodal)"
                        : "");
  if (d < 1) return loss("document_count is 0 (document_indices must start with 0)");
  num_sequences_ = static_cast<int64_t>(s);
  num_doc_idx_ = static_cast<int64_t>(d);
  lengths_off_ = kIndexHeaderSize;
  pointers_off_ = lengths_off_ + 4 * s;
  doc_idx_off_ = pointers_off_ + 8 * s;
  modes_off_ = doc_idx_off_ + 8 * d;
  return absl::OkStatus();
}

// document_indices: 0, monotone, ends at S.
absl::Status IndexedDataset::CheckDocumentIndices() const {
  auto loss = [&](const std::string& what) {
    return absl::DataLossError(fmt::format("{}: {}", IdxPath(prefix_), what));
  };
  int64_t prev = document_index(0);
  if (prev != 0) return loss(fmt::format("document_indices[0] = {} (must be 0)", prev));
  const uint8_t* dix = idx_->data() + doc_idx_off_;
  for (int64_t j = 1; j < num_doc_idx_; ++j) {
    int64_t v;
    std::memcpy(&v, dix + 8 * j, 8);
    if (v < prev)
      return loss(fmt::format("document_indices[{}] = {} is smaller than document_indices[{}] = {} (must not decrease)",
                              j, v, j - 1, prev));
    if (v > num_sequences_)
      return loss(fmt::format("document_indices[{}] = {} exceeds sequence_count {}", j, v, num_sequences_));
    prev = v;
  }
  if (prev != num_sequences_)
    return loss(fmt::format("last document index is {} but sequence_count is {}", prev, num_sequences_));
  return absl::OkStatus();
}

// Pointers consistent with the lengths, everything inside the .bin. A branch-light pass over the
// (unaligned) arrays first; only when it finds a problem does the second pass name the field.
absl::Status IndexedDataset::CheckSequences(std::thread& documents_thread, const absl::Status& documents) {
  const int64_t isz = static_cast<int64_t>(itemsize());
  const int64_t bin_size = static_cast<int64_t>(bin_->size());
  const uint8_t* lens = idx_->data() + lengths_off_;
  const uint8_t* ptrs = idx_->data() + pointers_off_;
  int64_t expect = 0, tokens = 0, max_len = 0;
  bool bad = false;
  for (int64_t i = 0; i < num_sequences_; ++i) {
    int32_t len;
    int64_t ptr;
    std::memcpy(&len, lens + 4 * i, 4);
    std::memcpy(&ptr, ptrs + 8 * i, 8);
    bad |= (len < 0) | (ptr != expect);
    expect += static_cast<int64_t>(len) * isz;
    tokens += len;
    max_len = std::max<int64_t>(max_len, len);
  }
  max_length_ = max_len;
  num_tokens_ = tokens;
  if (!bad && expect <= bin_size) return absl::OkStatus();
  // A damaged document index is reported first, as a sequential check would.
  if (documents_thread.joinable()) documents_thread.join();
  PTK_RETURN_IF_ERROR(documents);
  const std::string idx_path = IdxPath(prefix_);
  expect = 0;
  for (int64_t i = 0; i < num_sequences_; ++i) {
    int32_t len = sequence_length(i);
    int64_t ptr = sequence_pointer(i);
    if (len < 0) return absl::DataLossError(fmt::format("{}: sequence_lengths[{}] = {} is negative", idx_path, i, len));
    if (ptr != expect)
      return absl::DataLossError(fmt::format("{}: sequence_pointers[{}] = {} but the lengths before it put it at {}",
                                             idx_path, i, ptr, expect));
    expect += static_cast<int64_t>(len) * isz;
    if (expect > bin_size)
      return absl::DataLossError(
          fmt::format("{}: sequence {} (pointer {}, {} tokens of {} bytes) ends at byte {}, past the "
                      "end of the {}-byte file (truncated?)",
                      BinPath(prefix_), i, ptr, len, isz, expect, bin_size));
  }
  return absl::OkStatus();
}

absl::Status IndexedDataset::Validate() {
  PTK_RETURN_IF_ERROR(ValidateHeader());
  // document_indices checked on a second thread for large indices, while this one checks the
  // lengths and pointers.
  absl::Status documents_ok;
  std::thread documents_thread;
  if (num_doc_idx_ >= (1 << 18))
    documents_thread = std::thread([&] { documents_ok = CheckDocumentIndices(); });
  else
    documents_ok = CheckDocumentIndices();
  struct Joiner {
    std::thread& t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{documents_thread};
  PTK_RETURN_IF_ERROR(CheckSequences(documents_thread, documents_ok));
  if (documents_thread.joinable()) documents_thread.join();
  PTK_RETURN_IF_ERROR(documents_ok);
  if (const uint64_t extra = bin_trailing_bytes(); extra > 0)
    bin_trailing_warning_ = fmt::format(
        "{}: {} trailing byte{} at offset {}, after the {} tokens {} describes, ignored as Megatron's reader ignores "
        "them (if that .idx is another dataset's, its documents are not these)",
        BinPath(prefix_), extra, extra == 1 ? "" : "s", bin_->size() - extra, num_tokens_, IdxPath(prefix_));
  return absl::OkStatus();
}

TokenSpan IndexedDataset::sequence(int64_t i) const {
  return TokenSpan{bin_->data() + sequence_pointer(i), sequence_length(i), dtype_};
}

absl::StatusOr<TokenSpan> IndexedDataset::Get(int64_t i, int64_t offset, int64_t length) const {
  if (i < 0 || i >= num_sequences_)
    return absl::OutOfRangeError(fmt::format("{}: sequence {} out of range [0, {})", prefix_, i, num_sequences_));
  const int64_t len = sequence_length(i);
  if (length < 0) length = len - offset;
  if (offset < 0 || length < 0 || offset + length > len)
    return absl::OutOfRangeError(
        fmt::format("{}: tokens [{}, {}) outside sequence {} of length {}", prefix_, offset, offset + length, i, len));
  return TokenSpan{bin_->data() + sequence_pointer(i) + offset * static_cast<int64_t>(itemsize()), length, dtype_};
}

int64_t IndexedDataset::document_length(int64_t d) const {
  int64_t a = document_index(d), b = document_index(d + 1);
  if (a == b) return 0;
  return (sequence_pointer(b - 1) - sequence_pointer(a)) / static_cast<int64_t>(itemsize()) + sequence_length(b - 1);
}

TokenSpan IndexedDataset::document(int64_t d) const {
  int64_t a = document_index(d);
  int64_t n = document_length(d);
  const uint8_t* base = bin_->data();
  return TokenSpan{n > 0 ? base + sequence_pointer(a) : base, n, dtype_};
}

}  // namespace ptk
