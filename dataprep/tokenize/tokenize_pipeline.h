// ptk-tokenize's engine: jsonl (plain, .zst, .xz, stdin) -> GPT-2 ids -> Megatron .bin/.idx,
// byte-identical to Megatron's tools/preprocess_data.py with the same flags.
//
// oneTBB pipeline over batches of whole lines: serial in-order read -> parallel parse (simdjson)
// and encode -> serial in-order write. Output bytes do not depend on the number of workers.
// Memory is bounded: at most workers + 2 batches are in flight, each holding its lines (about
// --batch-bytes, or one longer line) and their ids.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {

struct TokenizeOptions {
  std::vector<std::string> inputs;  // files ("-" = stdin), already expanded and ordered
  std::string output_prefix;        // outputs: {prefix}_{key}_document.{bin,idx}
  std::vector<std::string> json_keys = {"text"};
  bool append_eod = false;
  int workers = 1;
  int partitions = 1;
  bool keep_sequential_samples = false;
  int64_t log_interval = 1000;
  bool strict = false;             // first bad record or replaced character is an error
  bool endoftext_as_text = false;  // legacy: literal <|endoftext|> encoded as ordinary text
  // Input bytes a batch (a worker's unit of work); 0: chosen from the inputs' size, 256 KiB to 1 MiB,
  // about 8 batches a worker, so that on small inputs the workers finish together.
  size_t batch_bytes = 0;
  int max_warnings = 10;  // bad records shown; all are counted
  // The run fails (nothing published) when more than this fraction of the non-blank records
  // cannot be read, and whenever an input yields no document at all.
  double max_bad_fraction = 0.01;
  // Seconds between resume points (PREFIX.ptk-resume): a killed run's rerun continues from the
  // last one. 0: none. Not with round-robin --partitions or stdin.
  double resume_interval_s = 60;
  bool progress = true;
  bool megatron_log = true;  // "Processed N documents (X docs/s, Y MB/s)." lines
  // Every output's PREFIX.ptk-done sidecar records the inputs (names, sizes, mtimes) and the
  // settings it was made from: a rerun whose would be the same leaves the outputs as they are
  // (TokenizeStats::up_to_date). force: tokenize and publish again all the same.
  bool force = false;
  // How long to keep trying for an output another run is writing (--lock-wait; OutputLock::Acquire).
  std::chrono::milliseconds lock_wait{0};
};

struct TokenizeStats {
  int64_t documents = 0;        // written (per key)
  int64_t empty_documents = 0;  // documents with no tokens (kept, as Megatron does)
  int64_t tokens = 0;           // over all keys
  uint64_t bytes = 0;           // decoded input bytes
  uint64_t chars = 0;           // code points of the JSON lines incl. newline (Megatron's MB/s unit)
  int64_t lines = 0;
  int64_t skipped = 0;
  int64_t skipped_by_kind[6] = {0, 0, 0, 0, 0, 0};  // indexed by RecordStatus
  int64_t invalid_utf8 = 0;
  int64_t lone_surrogates = 0;
  double seconds = 0;
  // Bytes written for resume points (--resume-interval) by this run: each point writes the index
  // entries added since the last and a record of fixed size (for a given number of inputs).
  uint64_t resume_bytes_written = 0;
  int64_t resume_points = 0;
  std::vector<std::string> outputs;  // prefixes written (or found up to date)
  // Every output's sidecar records these inputs and settings: nothing was read or written
  // (documents and tokens are the outputs').
  bool up_to_date = false;
};

std::string OutputPrefixFor(const std::string& output_prefix, const std::string& key);

absl::StatusOr<TokenizeStats> RunTokenize(const TokenizeOptions& options, const Gpt2Tokenizer& tokenizer);

}  // namespace ptk
