// ptk-tokenize's three pipeline stages (internal to ptk::dataprep; see tokenize_pipeline.h):
//   LineReader   (serial, in order)  input files -> batches of whole lines   tokenize_reader.cpp
//   BatchEncoder (parallel)          JSON parse + GPT-2 ids per batch         tokenize_encode.cpp
//   DocumentSink (serial, in order)  ids -> .bin/.idx builders, counters,     tokenize_sink.cpp
//                                    resume points, the final checks
// RunTokenize (tokenize_pipeline.cpp) wires them into a oneTBB pipeline.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <simdjson.h>

#include "absl/status/statusor.h"

#include "common/progress.h"
#include "common/zero_pages.h"
#include "dataprep/input/byte_source.h"
#include "dataprep/tokenize/json_record.h"
#include "dataprep/tokenize/tokenize_pipeline.h"
#include "indexed_dataset/indexed_dataset.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace ptk::tokenize_detail {

inline constexpr size_t kPadding = simdjson::SIMDJSON_PADDING;

// Ids of one batch and key, written in place by the encoder: grows without zero-filling (fresh
// zero pages, huge where available) and keeps its memory when the batch is reused, so a run
// touches the same pages batch after batch.
class IdBuffer {
 public:
  size_t size() const { return size_; }
  const int32_t* data() const { return mem_.as<int32_t>(); }
  int32_t& back() { return mem_.as<int32_t>()[size_ - 1]; }
  void clear() { size_ = 0; }
  // Room for n more ids after the current ones; returns where they go (Commit says how many went).
  int32_t* Reserve(size_t n) {
    if (mem_.bytes() / sizeof(int32_t) - size_ < n) {
      ZeroPages bigger(std::max(size_ + n, mem_.bytes() / sizeof(int32_t) * 2) * sizeof(int32_t));
      if (size_ > 0) std::memcpy(bigger.as<int32_t>(), mem_.as<int32_t>(), size_ * sizeof(int32_t));
      mem_ = std::move(bigger);
    }
    return mem_.as<int32_t>() + size_;
  }
  void Commit(const int32_t* end) { size_ = static_cast<size_t>(end - mem_.as<int32_t>()); }
  void push_back(int32_t v) {
    *Reserve(1) = v;
    ++size_;
  }

 private:
  ZeroPages mem_;
  size_t size_ = 0;
};

// A batch of whole lines from one input file, and what the workers made of them. Batches are
// recycled (BatchPool): every field is set again for each use, buffers keep their memory.
struct Batch {
  std::unique_ptr<char[]> data;  // lines, followed by kPadding readable bytes
  size_t data_cap = 0;           // bytes of data before the padding
  size_t size = 0;
  struct Line {
    size_t off, len;
  };
  std::vector<Line> lines;
  int file = 0;
  int64_t first_line_no = 1;      // 1-based line number of lines[0] in its file
  int64_t first_global_line = 0;  // 0-based index over all inputs (partition assignment)
  uint64_t file_offset = 0;       // decoded byte offset of lines[0]'s batch start in its file
  bool last_of_file = false;      // the file ends with this batch
  uint64_t raw_bytes = 0;         // input bytes consumed for this batch (progress)

  // Results, per key: ids and sequence lengths of all documents, and per line the number of
  // sequences; status per line.
  std::vector<IdBuffer> tokens;
  std::vector<std::vector<int32_t>> seq_lens, doc_nseq;
  std::vector<RecordStatus> status;
  std::vector<std::string> messages;  // for bad lines (index parallel to `status`, empty for ok)
  uint64_t chars = 0;
  int64_t invalid_utf8 = 0, lone_surrogates = 0;
  std::vector<uint8_t> replaced;  // per line: some character was replaced by U+FFFD
};

// Batches that went through the pipeline, for the reader to fill again: their line buffers and id
// buffers are reused instead of allocated (and faulted in) anew for every batch. The reader takes,
// the sink gives back; both may run at once.
class BatchPool {
 public:
  // Batches whose line buffer grew past keep_bytes (a line longer than a batch: a 100 MB document)
  // are freed rather than kept, so that memory returns to its bound after such a line.
  explicit BatchPool(size_t keep_bytes) : keep_bytes_(keep_bytes) {}
  std::unique_ptr<Batch> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return std::make_unique<Batch>();
    std::unique_ptr<Batch> b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void Give(std::unique_ptr<Batch> b) {
    if (b->data_cap > keep_bytes_) return;
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(b));
  }

 private:
  const size_t keep_bytes_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Batch>> free_;
};

// Where reading starts (or resumes): a file, a decoded byte offset at a line start, the line
// numbers there.
struct ReadPoint {
  int64_t file = 0;
  uint64_t offset = 0;
  int64_t line_no = 1, global_line = 0;
};
// Reads the inputs in order as batches of whole lines (about batch_bytes each, or one longer
// line), split as Python's universal newlines do, a UTF-8 BOM dropped; starts at `start`.
class LineReader {
 public:
  LineReader(const std::vector<std::string>& files, size_t batch_bytes, const ReadPoint& start, bool announce,
             BatchPool& pool)
      : files_(files),
        batch_bytes_(batch_bytes),
        file_(static_cast<int>(start.file)),
        global_line_(start.global_line),
        start_(start),
        announce_(announce),
        pool_(pool) {}

  // Next batch, nullptr at the end of all input.
  absl::StatusOr<std::unique_ptr<Batch>> Next();
  // Batches shrink as the input runs out: about a `share` of what is left (estimated from the
  // inputs' total size, `total_raw` bytes as stored), never below kMinTailBatch, so that the workers
  // finish together instead of one encoding the last big batch while the others wait.
  static constexpr size_t kMinTailBatch = 64 << 10;
  void ShrinkTowardsTheEnd(uint64_t total_raw, double share) {
    total_raw_ = total_raw;
    tail_share_ = share;
  }

 private:
  size_t BatchTarget() const;
  // Next's parts: the next file opened (at the resume point when it is the one resumed in); the
  // carried bytes and then the file's into b until `target` and a line's end (or the file's end,
  // *eof); the bytes up to the last line end are b's, the rest carried. Returns b's size.
  absl::Status OpenNextFile();
  absl::StatusOr<size_t> FillBatch(Batch* b, size_t target, bool* eof);
  const std::vector<std::string>& files_;
  size_t batch_bytes_;
  uint64_t total_raw_ = 0;
  double tail_share_ = 0;
  uint64_t raw_done_ = 0, decoded_done_ = 0;  // over all files, in handed-out batches
  int file_ = 0;
  std::unique_ptr<ByteSource> src_;
  std::string carry_;
  int64_t line_no_ = 1, global_line_ = 0;
  bool at_file_start_ = true;
  uint64_t last_raw_ = 0;
  uint64_t consumed_ = 0;  // decoded bytes of the current file handed out in batches
  ReadPoint start_;
  bool announce_ = true;
  BatchPool& pool_;
};

// One worker's parser and encoder (a worker encodes one batch at a time).
class BatchEncoder {
 public:
  BatchEncoder(const Gpt2Tokenizer& tok, const TokenizeOptions& opt);
  // Parses every line of b and fills its results (ids, sequence lengths, statuses).
  void Encode(Batch& b);

 private:
  const TokenizeOptions& opt_;
  JsonRecordParser parser_;
  Gpt2Encoder encoder_;
  int32_t eod_;
};

// What the sink saw of one input: enough to fail a run that read nothing, and to say why.
struct FileTally {
  int64_t documents = 0, bad = 0;  // bad: records that could not be read (blank lines aside)
  int64_t blank = 0;               // blank lines (whitespace only)
  std::string first_line;          // the first non-blank line's beginning
  std::string first_bad;           // "file:line: message" of the first bad record
  std::string keys_seen;           // the keys of the first record that lacked a --json-keys key
};

// The last stage: each batch's documents into the builders in input order, the counters, the
// bad-record reports and, every --resume-interval, a resume point; at the end the checks that the
// inputs were read and the outputs published. The resume record is removed with the sink (only a
// killed run leaves one); unfinished builders remove their temporaries.
// What a run's outputs are made from, in four named parts: "ptk-tokenize v4 inputs:H settings:H
// vocab:H merges:H", H an XXH3-128: the inputs (names, sizes, mtimes), the keys and the settings
// that change the bytes (EOD, <|endoftext|> handling, the partition order; not --strict), and the
// content of the vocab and merges files. "" when an input is stdin: a rerun cannot be compared with it.
std::string OutputSource(const TokenizeOptions& opt, const Gpt2Tokenizer& tok);

// What every output's sidecar records as its source ("source" in PREFIX.ptk-done): OutputSource
// and " bad:B/N clean:C", B of the N non-blank records that could not be read, C 1 when no line
// was skipped (blank ones included) and no character replaced ("" for a source "").
// --max-bad-fraction and --strict do not change the bytes: a rerun checks B/N against its own
// --max-bad-fraction, and under --strict that the output is clean (a --strict run over the same
// inputs would have written it).
std::string SourceWithOutcome(const std::string& source, int64_t bad, int64_t records, bool clean);

// Why PREFIX, which is not up to date with `source`, is made again, as one line naming PREFIX and
// what changed (the vocabulary's content, the merges', the inputs, the settings; more bad records
// than `max_bad_fraction` allows), or "" when there is nothing to redo (no output yet, or a killed
// run's resume record, which Open reports on).
std::string RerunReason(const std::string& prefix, const std::string& source, const TokenizeOptions& opt);

// PREFIX was made from `source` with no more bad records than opt.max_bad_fraction allows (and,
// under opt.strict, clean), and is whole (DatasetMadeFrom), and no resume is pending. Sets
// *documents and *tokens.
bool OutputUpToDate(const std::string& prefix, const std::string& source, const TokenizeOptions& opt,
                    int64_t* documents, int64_t* tokens);

// A killed run's resume record PREFIX.ptk-resume and its index log PREFIX.ptk-resume-index (either
// alone too) removed, with a line saying so; the caller holds PREFIX's output lock, and the record
// is not its own run's: left by a run whose first --json-keys key was another, redone by a run that
// keeps none (--resume-interval 0, round-robin --partitions, standard input), or a log left by a run
// killed after its outputs were complete, between the record's removal and the log's. Left there,
// a record kept the output from ever being up to date (every rerun tokenized again, saying nothing);
// a log was litter no rerun removed.
void RemoveStaleResumeRecord(const std::string& final_prefix);

// A resume point: where reading goes on, the counters, each key's builder checkpoint.
struct ResumeState {
  std::string fingerprint;
  ReadPoint next;
  TokenizeStats stats;
  std::vector<std::pair<int64_t, int64_t>> tallies;  // documents, bad records per input
  // Per key. Read: each builder's whole index. Write: the index entries since the last point only
  // (IndexedDatasetBuilder::Checkpoint from ResumeJournal::Logged).
  std::vector<BuilderCheckpoint> builders;
  uint64_t log_bytes = 0;  // Read: the index log's length at this point
};

// PREFIX.ptk-resume, rewritten atomically at every resume point (where reading goes on, the
// counters, each builder's fsynced temporary .bin and how many index entries it has), and the
// index log PREFIX.ptk-resume-index beside it, to which each point appends (fsynced before the
// record names it) only the index entries added since the last: a point writes what is new, not
// the whole index again. A killed run's rerun with the same inputs and settings continues from
// the last point; the output is the same bytes as an uninterrupted run's.
class ResumeJournal {
 public:
  explicit ResumeJournal(std::string record);
  ~ResumeJournal();
  ResumeJournal(const ResumeJournal&) = delete;
  ResumeJournal& operator=(const ResumeJournal&) = delete;
  const std::string& path() const { return record_; }
  // A killed run's last point, each builder's index whole (checked: DataLoss naming the file).
  absl::StatusOr<ResumeState> Read() const;
  // Once the outputs are this run's: the log continued from `resumed` (cut to its recorded length:
  // what a killed run appended after its last record goes), or started empty.
  absl::Status Start(const ResumeState* resumed);
  // Index entries of key k already in the log (lengths, doc_idx): where the next point's start.
  std::pair<size_t, size_t> Logged(size_t k) const {
    return k < logged_.size() ? logged_[k] : std::pair<size_t, size_t>{};
  }
  // One point (`r.builders` holding the entries from Logged on): appended, fsynced, then the record
  // replaced. Returns the bytes written.
  absl::StatusOr<uint64_t> Write(const ResumeState& r);
  // The record, then the log.
  void Remove();

 private:
  const std::string record_, log_;
  int fd_ = -1;
  uint64_t log_bytes_ = 0;
  std::vector<std::pair<size_t, size_t>> logged_;
};

class DocumentSink {
 public:
  DocumentSink(const TokenizeOptions& opt, const Gpt2Tokenizer& tok, ProgressReporter& progress);
  ~DocumentSink();
  DocumentSink(const DocumentSink&) = delete;
  DocumentSink& operator=(const DocumentSink&) = delete;

  // Takes the outputs: a killed run's, when its resume record matches these inputs and settings,
  // else new ones. Returns where reading starts.
  absl::StatusOr<ReadPoint> Open();
  // One batch, in input order. An error (a bad record with --strict, a write failure) ends the run.
  absl::Status Consume(const Batch& b);
  // After the last batch: fails a run whose inputs gave no document (or too many bad records),
  // else finalizes the outputs (merging round-robin partitions).
  absl::StatusOr<TokenizeStats> Finish();

 private:
  // Where key's documents are written in input order: the output itself, or with round-robin
  // partitions a temporary dataset that Finish writes out in partition order.
  std::string StagingPrefix(size_t key) const;
  absl::Status ReportBad(const Batch& b, size_t i);
  absl::Status AddDocument(const Batch& b, size_t i, std::vector<size_t>& offsets);
  absl::Status WriteResumePoint(const Batch& b);

  const TokenizeOptions& opt_;
  const Gpt2Tokenizer& tok_;
  ProgressReporter& progress_;
  const size_t nkeys_;
  const int nparts_;  // round-robin partitions (1 when contiguous)
  const bool resumable_;
  ResumeJournal journal_;       // PREFIX.ptk-resume and its index log
  bool journal_owned_ = false;  // the outputs are ours: the record is removed with the sink
  std::string fingerprint_;
  const std::string source_;  // OutputSource, recorded in the outputs' sidecars
  std::vector<std::vector<std::unique_ptr<IndexedDatasetBuilder>>> builders_;  // [0][key]
  std::vector<int64_t> doc_lines_;  // with round-robin partitions: each document's global line
  TokenizeStats stats_;
  std::vector<FileTally> tallies_;
  int warnings_ = 0;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_resume_point_ = start_;
};

}  // namespace ptk::tokenize_detail
