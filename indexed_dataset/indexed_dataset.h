// Megatron-LM's indexed dataset (MMIDIDX v1): PREFIX.bin holds raw token ids, PREFIX.idx the
// sequence lengths, byte pointers and document boundaries. Byte-identical to
// megatron/core/datasets/indexed_dataset.py (IndexedDatasetBuilder / IndexedDataset).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/mmap_file.h"
#include "common/output_lock.h"
#include "indexed_dataset/dtype.h"

namespace ptk {

inline constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr size_t kIndexHeaderSize = 34;  // magic 9 + version 8 + dtype 1 + counts 16

inline std::string BinPath(const std::string& prefix) { return prefix + ".bin"; }
inline std::string IdxPath(const std::string& prefix) { return prefix + ".idx"; }

// What a user gave for a dataset -> its PREFIX, when PREFIX.idx or PREFIX.bin exists (with
// `accept_file_names`, PREFIX.bin and PREFIX.idx stand for PREFIX, as ptk-inspect takes them).
// Otherwise NotFound naming what was looked for and, when a near name holds a dataset, suggesting
// it: the prefix without .bin/.idx, PREFIX_text_document or another PREFIX*_document (ptk-tokenize
// and Megatron name their outputs PREFIX_{key}_document). IndexedDataset::Open answers a missing
// dataset with the same message, so every --data-path and --inputs gets the suggestion.
absl::StatusOr<std::string> ResolveDatasetPrefix(const std::string& arg, bool accept_file_names = true);

// A run of tokens inside the mapped .bin (zero-copy).
struct TokenSpan {
  const uint8_t* data = nullptr;
  int64_t size = 0;
  DType dtype = DType::kUInt16;

  int64_t operator[](int64_t i) const { return LoadToken(data, i, dtype); }
  template <typename T>
  std::span<const T> As() const {
    return std::span<const T>(reinterpret_cast<const T*>(data), static_cast<size_t>(size));
  }
  std::vector<int64_t> ToVector() const {
    std::vector<int64_t> v(static_cast<size_t>(size));
    for (int64_t i = 0; i < size; ++i) v[i] = (*this)[i];
    return v;
  }
};

inline std::string DoneSidecarPath(const std::string& prefix) { return prefix + ".ptk-done"; }
inline std::string PublishJournalPath(const std::string& prefix) { return prefix + ".ptk-publish"; }

// PREFIX was made from `source` and is whole: its PREFIX.ptk-done sidecar records `source`
// (IndexedDatasetBuilder::SetSource), the .bin and .idx are regular files of the sizes it records,
// and no publish is pending. Sets *documents and *tokens from the sidecar. An empty source never
// matches. What lets a rerun of a stage that wrote PREFIX skip it.
bool DatasetMadeFrom(const std::string& prefix, std::string_view source, int64_t* documents, int64_t* tokens);

// The "source" PREFIX.ptk-done records, or nullopt when there is no sidecar (or none readable).
std::optional<std::string> RecordedSource(const std::string& prefix);

// Removes PREFIX.bin, PREFIX.idx and PREFIX.ptk-done (those that exist); the .idx goes first.
absl::Status RemoveIndexedDataset(const std::string& prefix);

// Writer. Holds PREFIX's OutputLock from Create until it is destroyed (a second writer of the same
// prefix fails at once naming this one). Tokens go to a temporary of this writer's own as they
// arrive; Finalize() writes the index and the sidecar PREFIX.ptk-done (sizes, XXH3-128 of both
// files, counts), then publishes the three together through a journal (PublishTogether): after a
// kill or a full disk at any point, PREFIX holds the old pair or the new pair, never one of each,
// and a left-over journal is completed by the next writer or IndexedDataset::Open.
// What a resumable writer records to continue after a kill: its durable temporary .bin and the
// index so far.
struct BuilderCheckpoint {
  std::string bin_tmp;  // path of the temporary .bin
  uint64_t bin_bytes = 0;
  int64_t tokens = 0;
  std::vector<int32_t> lengths;
  std::vector<int64_t> doc_idx;
};

class IndexedDatasetBuilder {
 public:
  // `lock_wait`: how long to keep trying for PREFIX's lock while another run holds it (OutputLock::Acquire).
  static absl::StatusOr<std::unique_ptr<IndexedDatasetBuilder>> Create(
      const std::string& prefix, DType dtype, bool multimodal = false,
      std::chrono::milliseconds lock_wait = std::chrono::milliseconds(0));

  // Continues a builder that a killed process checkpointed (single-modal only). Takes the lock and
  // cleans up like Create, keeping the checkpoint's temporary.
  static absl::StatusOr<std::unique_ptr<IndexedDatasetBuilder>> Resume(
      const std::string& prefix, DType dtype, const BuilderCheckpoint& checkpoint,
      std::chrono::milliseconds lock_wait = std::chrono::milliseconds(0));
  // Makes everything added so far durable (flush + fsync of the temporary .bin) and returns what
  // Resume needs to continue from exactly here. With `lengths_from` / `doc_idx_from`, the
  // checkpoint's lengths and doc_idx hold only the entries from those indices on: what a caller
  // that kept the earlier ones (ptk-tokenize's resume log) adds, without copying the whole index.
  absl::StatusOr<BuilderCheckpoint> Checkpoint(size_t lengths_from = 0, size_t doc_idx_from = 0);

  // One sequence; does not close the document (Megatron's add_item).
  absl::Status AddItem(std::span<const int32_t> tokens, int8_t mode = 0);
  // Closes the current document (Megatron's end_document).
  void EndDocument();
  // Sequences of `lengths` taken in order from `tokens`, then EndDocument (Megatron's add_document).
  // An empty document (no tokens, no lengths) is recorded as a zero-sequence document.
  absl::Status AddDocument(std::span<const int32_t> tokens, std::span<const int32_t> lengths,
                           std::span<const int8_t> modes = {});
  // Appends every sequence and document of another dataset (Megatron's add_index), the bytes its
  // index describes and no more; its trailing-bytes warnings, if any, go to warnings() for the caller
  // to print (a .bin's trailing bytes are left out: Megatron's add_index copies them, which moves
  // every later input's tokens off the pointers its index gets).
  absl::Status AddIndex(const std::string& other_prefix);
  const std::vector<std::string>& warnings() const { return warnings_; }
  // What the writer made the dataset from (its inputs and settings, e.g. a fingerprint), recorded as
  // "source" in the PREFIX.ptk-done sidecar: a rerun that would make the same dataset can see so.
  void SetSource(std::string source) { source_ = std::move(source); }
  // Writes PREFIX.idx and makes both files visible.
  absl::Status Finalize();
  // Drops everything written (temporary files removed). Also done by the destructor if not finalized.
  void Abort();

  DType dtype() const { return dtype_; }
  int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(doc_idx_.size()) - 1; }
  int64_t num_tokens() const { return tokens_; }
  const std::string& prefix() const { return prefix_; }

 private:
  IndexedDatasetBuilder(std::string prefix, DType dtype, bool multimodal, std::unique_ptr<OutputLock> lock,
                        std::unique_ptr<AtomicFileWriter> bin);
  absl::Status WriteTokens(std::span<const int32_t> tokens);

  std::string prefix_;
  DType dtype_;
  bool multimodal_;
  std::unique_ptr<OutputLock> lock_;
  std::unique_ptr<AtomicFileWriter> bin_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_idx_{0};
  std::vector<int8_t> modes_;
  std::vector<uint8_t> scratch_;
  int64_t tokens_ = 0;
  std::string source_;
  std::vector<std::string> warnings_;
  bool finalized_ = false;
  // The .bin's XXH3 as its bytes are written, for the sidecar: no re-read at Finalize. Null once
  // bytes arrive some other way (a resumed temporary's kept part, AddIndex's file copies); then
  // Finalize hashes the file.
  std::unique_ptr<Xxh3> bin_hash_;
};

// Reader: both files memory-mapped; O(1) zero-copy access to sequences and documents. Open()
// validates everything Megatron's reader checks and what it does not (sizes, pointers consistent
// with lengths and with the .bin size, document indices monotone and bounded) and answers damage
// with kDataLoss naming the file and the field. Bytes after the .idx's arrays, or after the .bin's
// last sequence, are ignored, as Megatron's reader ignores them (it reads each array by its count,
// each sequence at its pointer); IdxTrailingBytesWarning and BinTrailingBytesWarning say so for a
// caller to print.
class IndexedDataset {
 public:
  static absl::StatusOr<std::unique_ptr<IndexedDataset>> Open(const std::string& prefix, bool multimodal = false);

  const std::string& prefix() const { return prefix_; }
  DType dtype() const { return dtype_; }
  size_t itemsize() const { return DTypeSize(dtype_); }
  int64_t num_sequences() const { return num_sequences_; }
  // Number of documents (= len(document_indices) - 1).
  int64_t num_documents() const { return num_doc_idx_ - 1; }
  int64_t num_tokens() const { return num_tokens_; }
  bool multimodal() const { return multimodal_; }
  uint64_t bin_size() const { return bin_->size(); }
  uint64_t idx_size() const { return idx_->size(); }
  // The .idx's bytes after its arrays (the document index, or the modes of a multimodal index).
  uint64_t idx_trailing_bytes() const { return idx_trailing_bytes_; }
  // "" without such bytes; else one line naming the .idx, the offset they start at and their count.
  const std::string& IdxTrailingBytesWarning() const { return idx_trailing_warning_; }
  // The .bin's bytes after the last sequence the index describes: ignored, as Megatron's reader
  // ignores them (it reads each sequence at its pointer); a .bin too short for them is refused.
  uint64_t bin_trailing_bytes() const { return bin_->size() - static_cast<uint64_t>(num_tokens_) * itemsize(); }
  // "" without such bytes; else one line naming the .bin, the offset they start at, their count and the .idx.
  const std::string& BinTrailingBytesWarning() const { return bin_trailing_warning_; }

  int32_t sequence_length(int64_t i) const { return Load<int32_t>(lengths_off_ + 4 * i); }
  int64_t sequence_pointer(int64_t i) const { return Load<int64_t>(pointers_off_ + 8 * i); }
  // Raw document_indices[j], j in [0, num_documents()].
  int64_t document_index(int64_t j) const { return Load<int64_t>(doc_idx_off_ + 8 * j); }
  int8_t sequence_mode(int64_t i) const { return static_cast<int8_t>(idx_->data()[modes_off_ + i]); }
  // The raw (unaligned, little-endian int32) sequence_lengths array, and its maximum.
  const uint8_t* lengths_data() const { return idx_->data() + lengths_off_; }
  int64_t max_sequence_length() const { return max_length_; }

  TokenSpan sequence(int64_t i) const;
  // Tokens [offset, offset+length) of sequence i (Megatron's get()); length -1 = to the end.
  absl::StatusOr<TokenSpan> Get(int64_t i, int64_t offset = 0, int64_t length = -1) const;
  // All tokens of document d (its sequences are contiguous in .bin).
  TokenSpan document(int64_t d) const;
  int64_t document_length(int64_t d) const;  // tokens
  int64_t document_num_sequences(int64_t d) const { return document_index(d + 1) - document_index(d); }

  // Stricter than Open(), which has checked the rest: the .bin has no trailing bytes. The tools read such
  // bytes past (BinTrailingBytesWarning); the tests check with it that what a writer made has none.
  absl::Status Verify() const;
  // When PREFIX.ptk-done exists (ptk wrote the pair): checks both files' sizes and XXH3-128
  // against it (kDataLoss naming the file). Returns false when there is no sidecar to check.
  absl::StatusOr<bool> VerifyChecksums() const;

 private:
  IndexedDataset() = default;
  template <typename T>
  T Load(size_t off) const {
    T v;
    std::memcpy(&v, idx_->data() + off, sizeof(T));
    return v;
  }
  absl::Status Validate();
  // Validate's parts: the header and the arrays' offsets; document_indices; the lengths and
  // pointers against each other and the .bin (the first problem named, after a damaged
  // document index's, which `documents` gives when it finished).
  absl::Status ValidateHeader();
  absl::Status CheckDocumentIndices() const;
  absl::Status CheckSequences(std::thread& documents_thread, const absl::Status& documents);

  std::string prefix_;
  std::unique_ptr<MappedFile> idx_, bin_;
  DType dtype_ = DType::kUInt16;
  bool multimodal_ = false;
  int64_t num_sequences_ = 0, num_doc_idx_ = 0, num_tokens_ = 0, max_length_ = 0;
  uint64_t idx_trailing_bytes_ = 0;
  std::string idx_trailing_warning_, bin_trailing_warning_;
  size_t lengths_off_ = 0, pointers_off_ = 0, doc_idx_off_ = 0, modes_off_ = 0;
};

}  // namespace ptk
