// Megatron MMIDIDX v1 writer: IndexedDatasetBuilder (the .bin written as it goes, the .idx and the sidecar at
// Finalize, published together), and the sidecar's record of what a dataset was made from.
#include "indexed_dataset/indexed_dataset.h"

#include <simdjson.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/json_writer.h"
#include "common/status.h"

namespace ptk {
namespace {

template <typename T>
void AppendLE(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

template <typename Dst>
void ConvertTokens(std::span<const int32_t> in, uint8_t* out) {
  for (size_t i = 0; i < in.size(); ++i) {
    Dst v = static_cast<Dst>(in[i]);  // numpy's astype: integer wrap-around
    std::memcpy(out + i * sizeof(Dst), &v, sizeof(Dst));
  }
}

}  // namespace

namespace {
// Takes PREFIX's lock, finishes a publish a killed writer left half-done (it was complete), then
// removes what killed writers left behind (but `keep`): nobody else can be writing PREFIX now.
absl::StatusOr<std::unique_ptr<OutputLock>> TakePrefix(const std::string& prefix, const std::string& keep,
                                                       std::chrono::milliseconds wait) {
  PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(prefix, wait));
  PTK_RETURN_IF_ERROR(CompletePendingPublish(PublishJournalPath(prefix)));
  for (const auto& f : {BinPath(prefix), IdxPath(prefix), DoneSidecarPath(prefix), PublishJournalPath(prefix)})
    RemoveStaleTemporaries(f, keep);
  return lock;
}
}  // namespace

absl::Status RemoveIndexedDataset(const std::string& prefix) {
  PTK_RETURN_IF_ERROR(RemoveFileIfExists(IdxPath(prefix)));
  PTK_RETURN_IF_ERROR(RemoveFileIfExists(BinPath(prefix)));
  return RemoveFileIfExists(DoneSidecarPath(prefix));
}

bool DatasetMadeFrom(const std::string& prefix, std::string_view source, int64_t* documents, int64_t* tokens) {
  if (source.empty() || PathExists(PublishJournalPath(prefix))) return false;
  auto side = ReadFileToString(DoneSidecarPath(prefix));
  if (!side.ok()) return false;
  simdjson::dom::parser parser;
  simdjson::dom::element e;
  std::string_view recorded;
  uint64_t bin_size = 0, idx_size = 0;
  if (parser.parse(*side).get(e) || e["source"].get(recorded) || recorded != source || e["bin_size"].get(bin_size) ||
      e["idx_size"].get(idx_size) || e["documents"].get(*documents) || e["tokens"].get(*tokens))
    return false;
  struct stat bin {
  }, idx{};
  return ::stat(BinPath(prefix).c_str(), &bin) == 0 && S_ISREG(bin.st_mode) &&
         static_cast<uint64_t>(bin.st_size) == bin_size && ::stat(IdxPath(prefix).c_str(), &idx) == 0 &&
         S_ISREG(idx.st_mode) && static_cast<uint64_t>(idx.st_size) == idx_size;
}

std::optional<std::string> RecordedSource(const std::string& prefix) {
  auto side = ReadFileToString(DoneSidecarPath(prefix));
  if (!side.ok()) return std::nullopt;
  simdjson::dom::parser parser;
  simdjson::dom::element e;
  std::string_view recorded;
  if (parser.parse(*side).get(e) || e["source"].get(recorded)) return std::string();
  return std::string(recorded);
}

IndexedDatasetBuilder::IndexedDatasetBuilder(std::string prefix, DType dtype, bool multimodal,
                                             std::unique_ptr<OutputLock> lock, std::unique_ptr<AtomicFileWriter> bin)
    : prefix_(std::move(prefix)), dtype_(dtype), multimodal_(multimodal), lock_(std::move(lock)), bin_(std::move(bin)) {
  if (bin_->bytes_written() == 0) bin_hash_ = std::make_unique<Xxh3>();
}

absl::StatusOr<std::unique_ptr<IndexedDatasetBuilder>> IndexedDatasetBuilder::Create(
    const std::string& prefix, DType dtype, bool multimodal, std::chrono::milliseconds lock_wait) {
  PTK_ASSIGN_OR_RETURN(auto lock, TakePrefix(prefix, "", lock_wait));
  PTK_ASSIGN_OR_RETURN(auto bin, AtomicFileWriter::Create(BinPath(prefix)));
  return std::unique_ptr<IndexedDatasetBuilder>(
      new IndexedDatasetBuilder(prefix, dtype, multimodal, std::move(lock), std::move(bin)));
}

absl::StatusOr<std::unique_ptr<IndexedDatasetBuilder>> IndexedDatasetBuilder::Resume(
    const std::string& prefix, DType dtype, const BuilderCheckpoint& cp, std::chrono::milliseconds lock_wait) {
  if (cp.doc_idx.empty() || cp.doc_idx.front() != 0 || cp.doc_idx.back() > static_cast<int64_t>(cp.lengths.size()) ||
      cp.bin_bytes != static_cast<uint64_t>(cp.tokens) * DTypeSize(dtype) || Dirname(cp.bin_tmp) != Dirname(prefix))
    return absl::DataLossError(fmt::format("{}: the resume record is inconsistent", prefix));
  PTK_ASSIGN_OR_RETURN(auto lock, TakePrefix(prefix, cp.bin_tmp, lock_wait));
  PTK_ASSIGN_OR_RETURN(auto bin, AtomicFileWriter::Reopen(BinPath(prefix), cp.bin_tmp, cp.bin_bytes));
  std::unique_ptr<IndexedDatasetBuilder> b(
      new IndexedDatasetBuilder(prefix, dtype, /*multimodal=*/false, std::move(lock), std::move(bin)));
  b->lengths_ = cp.lengths;
  b->doc_idx_ = cp.doc_idx;
  b->tokens_ = cp.tokens;
  return b;
}

absl::StatusOr<BuilderCheckpoint> IndexedDatasetBuilder::Checkpoint(size_t lengths_from, size_t doc_idx_from) {
  if (finalized_) return absl::FailedPreconditionError("builder already finalized");
  if (lengths_from > lengths_.size() || doc_idx_from > doc_idx_.size())
    return absl::InvalidArgumentError(fmt::format("{}: a checkpoint from entries {} and {} of {} and {}", prefix_,
                                                  lengths_from, doc_idx_from, lengths_.size(), doc_idx_.size()));
  PTK_RETURN_IF_ERROR(bin_->Flush());
  PTK_RETURN_IF_ERROR(FsyncFile(bin_->fd(), bin_->tmp_path()));
  BuilderCheckpoint cp;
  cp.bin_tmp = bin_->tmp_path();
  cp.bin_bytes = bin_->bytes_written();
  cp.tokens = tokens_;
  cp.lengths.assign(lengths_.begin() + static_cast<std::ptrdiff_t>(lengths_from), lengths_.end());
  cp.doc_idx.assign(doc_idx_.begin() + static_cast<std::ptrdiff_t>(doc_idx_from), doc_idx_.end());
  return cp;
}

absl::Status IndexedDatasetBuilder::WriteTokens(std::span<const int32_t> tokens) {
  if (tokens.empty()) return absl::OkStatus();
  const size_t isz = DTypeSize(dtype_);
  if (dtype_ == DType::kInt32) {
    if (bin_hash_) bin_hash_->Update(tokens.data(), tokens.size() * 4);
    return bin_->Write(tokens.data(), tokens.size() * 4);
  }
  scratch_.resize(tokens.size() * isz);
  switch (dtype_) {
    case DType::kUInt16: ConvertTokens<uint16_t>(tokens, scratch_.data()); break;
    case DType::kUInt8: ConvertTokens<uint8_t>(tokens, scratch_.data()); break;
    case DType::kInt8: ConvertTokens<int8_t>(tokens, scratch_.data()); break;
    case DType::kInt16: ConvertTokens<int16_t>(tokens, scratch_.data()); break;
    case DType::kInt64: ConvertTokens<int64_t>(tokens, scratch_.data()); break;
    case DType::kFloat32: ConvertTokens<float>(tokens, scratch_.data()); break;
    case DType::kFloat64: ConvertTokens<double>(tokens, scratch_.data()); break;
    case DType::kInt32: break;
  }
  if (bin_hash_) bin_hash_->Update(scratch_.data(), scratch_.size());
  return bin_->Write(scratch_.data(), scratch_.size());
}

absl::Status IndexedDatasetBuilder::AddItem(std::span<const int32_t> tokens, int8_t mode) {
  if (finalized_) return absl::FailedPreconditionError("builder already finalized");
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    return absl::InvalidArgumentError(
        fmt::format("{}: a sequence of {} tokens exceeds the int32 length field", prefix_, tokens.size()));
  PTK_RETURN_IF_ERROR(WriteTokens(tokens));
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  if (multimodal_) modes_.push_back(mode);
  tokens_ += static_cast<int64_t>(tokens.size());
  return absl::OkStatus();
}

void IndexedDatasetBuilder::EndDocument() { doc_idx_.push_back(static_cast<int64_t>(lengths_.size())); }

absl::Status IndexedDatasetBuilder::AddDocument(std::span<const int32_t> tokens, std::span<const int32_t> lengths,
                                                std::span<const int8_t> modes) {
  if (finalized_) return absl::FailedPreconditionError("builder already finalized");
  int64_t sum = 0;
  for (int32_t l : lengths) {
    if (l < 0) return absl::InvalidArgumentError("negative sequence length");
    sum += l;
  }
  if (sum != static_cast<int64_t>(tokens.size()))
    return absl::InvalidArgumentError(
        fmt::format("add_document: lengths sum to {} but {} tokens were given", sum, tokens.size()));
  if (!modes.empty() && modes.size() != lengths.size())
    return absl::InvalidArgumentError("add_document: modes and lengths differ in size");
  PTK_RETURN_IF_ERROR(WriteTokens(tokens));
  lengths_.insert(lengths_.end(), lengths.begin(), lengths.end());
  if (multimodal_) {
    if (modes.empty())
      modes_.insert(modes_.end(), lengths.size(), 0);
    else
      modes_.insert(modes_.end(), modes.begin(), modes.end());
  }
  tokens_ += sum;
  EndDocument();
  return absl::OkStatus();
}

absl::Status IndexedDatasetBuilder::AddIndex(const std::string& other_prefix) {
  if (finalized_) return absl::FailedPreconditionError("builder already finalized");
  PTK_ASSIGN_OR_RETURN(auto other, IndexedDataset::Open(other_prefix, multimodal_));
  if (other->dtype() != dtype_)
    return absl::InvalidArgumentError(fmt::format("{}: dtype {} differs from the output's {}", IdxPath(other_prefix),
                                                  DTypeName(other->dtype()), DTypeName(dtype_)));
  if (std::string w = other->IdxTrailingBytesWarning(); !w.empty()) warnings_.push_back(std::move(w));
  if (std::string w = other->BinTrailingBytesWarning(); !w.empty()) warnings_.push_back(w + "; left out of the merge");
  const int64_t offset = static_cast<int64_t>(lengths_.size());
  const int64_t s = other->num_sequences();
  lengths_.reserve(lengths_.size() + s);
  for (int64_t i = 0; i < s; ++i) lengths_.push_back(other->sequence_length(i));
  if (multimodal_)
    for (int64_t i = 0; i < s; ++i) modes_.push_back(other->sequence_mode(i));
  for (int64_t j = 1; j <= other->num_documents(); ++j) doc_idx_.push_back(offset + other->document_index(j));
  const uint64_t nbytes = static_cast<uint64_t>(other->num_tokens()) * DTypeSize(dtype_);
  tokens_ += other->num_tokens();
  bin_hash_.reset();  // hashed from the file at Finalize
  return bin_->AppendFileRange(BinPath(other_prefix), 0, nbytes);
}

absl::Status IndexedDatasetBuilder::Finalize() {
  if (finalized_) return absl::FailedPreconditionError("builder already finalized");
  const uint64_t s = lengths_.size(), d = doc_idx_.size();
  std::string idx;
  idx.reserve(kIndexHeaderSize + 12 * s + 8 * d + (multimodal_ ? s : 0));
  idx.append(kIndexMagic, sizeof(kIndexMagic));
  AppendLE<uint64_t>(idx, 1);
  AppendLE<uint8_t>(idx, static_cast<uint8_t>(dtype_));
  AppendLE<uint64_t>(idx, s);
  AppendLE<uint64_t>(idx, d);
  idx.append(reinterpret_cast<const char*>(lengths_.data()), 4 * s);
  const int64_t isz = static_cast<int64_t>(DTypeSize(dtype_));
  int64_t ptr = 0;
  for (uint64_t i = 0; i < s; ++i) {
    AppendLE<int64_t>(idx, ptr);
    ptr += static_cast<int64_t>(lengths_[i]) * isz;
  }
  idx.append(reinterpret_cast<const char*>(doc_idx_.data()), 8 * d);
  if (multimodal_) idx.append(reinterpret_cast<const char*>(modes_.data()), modes_.size());

  PTK_ASSIGN_OR_RETURN(auto idx_writer, AtomicFileWriter::Create(IdxPath(prefix_)));
  PTK_RETURN_IF_ERROR(idx_writer->Write(idx));
  PTK_RETURN_IF_ERROR(idx_writer->Seal());
  PTK_RETURN_IF_ERROR(bin_->Seal());
  std::string bin_sum;
  if (bin_hash_) {
    bin_sum = bin_hash_->HexDigest();
  } else {
    PTK_ASSIGN_OR_RETURN(bin_sum, Xxh3FileHex(bin_->tmp_path()));
  }
  PTK_ASSIGN_OR_RETURN(auto done_writer, AtomicFileWriter::Create(DoneSidecarPath(prefix_)));
  JsonWriter side;
  side.BeginObject()
      .Field("format", "ptk-indexed-dataset-done v1")
      .Field("bin_size", bin_->bytes_written())
      .Field("bin_xxh3_128", bin_sum)
      .Field("idx_size", idx.size())
      .Field("idx_xxh3_128", Xxh3Hex(idx))
      .Field("dtype", DTypeName(dtype_))
      .Field("sequences", s)
      .Field("documents", d - 1)
      .Field("tokens", tokens_);
  if (!source_.empty()) side.Field("source", source_);
  PTK_RETURN_IF_ERROR(done_writer->Write(side.EndObject().str() + "\n"));
  PTK_RETURN_IF_ERROR(done_writer->Seal());
  // Handed over to the journal, whose files they then are (the next writer or reader completes it), in
  // one step for a signal's cleanup (cli::RemoveTemporariesOnSignals removes the temporaries still
  // tracked): released after the journal, one between the two removed files the journal names; released
  // before it, one between the two left them untracked.
  const std::vector<std::pair<std::string, std::string>> files = {{bin_->tmp_path(), BinPath(prefix_)},
                                                                  {idx_writer->tmp_path(), IdxPath(prefix_)},
                                                                  {done_writer->tmp_path(), DoneSidecarPath(prefix_)}};
  absl::Status st =
      PublishWritersTogether(PublishJournalPath(prefix_), {{bin_.get(), BinPath(prefix_)},
                                                           {idx_writer.get(), IdxPath(prefix_)},
                                                           {done_writer.get(), DoneSidecarPath(prefix_)}});
  if (!st.ok() && !PathExists(PublishJournalPath(prefix_)))
    for (const auto& f : files) ::unlink(f.first.c_str());  // no journal: nothing published, they are ours
  PTK_RETURN_IF_ERROR(st);
  finalized_ = true;
  lock_.reset();
  return absl::OkStatus();
}

void IndexedDatasetBuilder::Abort() {
  if (!finalized_ && bin_) bin_->Abort();
  finalized_ = true;
  lock_.reset();
}

}  // namespace ptk
