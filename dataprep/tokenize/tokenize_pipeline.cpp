// ptk-tokenize's engine: the three stages of tokenize_stages.h in a oneTBB pipeline.
#include "dataprep/tokenize/tokenize_pipeline.h"

#include <sys/stat.h>
#include <tbb/enumerable_thread_specific.h>
#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/happens_before.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/progress.h"
#include "common/status.h"
#include "dataprep/tokenize/tokenize_stages.h"

namespace ptk {

std::string OutputPrefixFor(const std::string& output_prefix, const std::string& key) {
  return fmt::format("{}_{}_document", output_prefix, key);
}

namespace tokenize_detail {
namespace {

absl::Status CheckTokenizeOptions(const TokenizeOptions& opt) {
  if (opt.inputs.empty()) return absl::InvalidArgumentError("no input files");
  if (opt.json_keys.empty()) return absl::InvalidArgumentError("no JSON keys: json_keys names no key to tokenize");
  // One dataset per key: a key named twice would be two writers of one PREFIX_KEY_document.
  // A key names its dataset (PREFIX_KEY_document): one with a '/' would put it in another directory.
  for (const std::string& key : opt.json_keys)
    if (key.empty() || key.find('/') != std::string::npos)
      return UsageError(fmt::format("--json-keys {:?}: {}; each key names its dataset {}", key,
                                    key.empty() ? "an empty key" : "a key with a '/'",
                                    OutputPrefixFor(opt.output_prefix, key)));
  for (size_t i = 0; i < opt.json_keys.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (opt.json_keys[i] == opt.json_keys[j])
        return UsageError(fmt::format("--json-keys names {:?} twice; each key is one dataset ({}), give it once",
                                      opt.json_keys[i], OutputPrefixFor(opt.output_prefix, opt.json_keys[i])));
  if (opt.partitions < 1)
    return absl::InvalidArgumentError(
        fmt::format("partitions {}: the round-robin partition count must be at least 1", opt.partitions));
  // An input that is one of the outputs, however named (a glob over the output's directory, a file
  // named like PREFIX_text_document.bin): it would be read while its replacement is written, then lost.
  for (const std::string& in : opt.inputs) {
    if (in == "-") continue;
    auto id = IdentifyFile(in);
    if (!id.ok()) continue;  // the reader names it
    for (const std::string& key : opt.json_keys)
      for (const char* ext : {".bin", ".idx", ".ptk-done"}) {
        const std::string out = OutputPrefixFor(opt.output_prefix, key) + ext;
        auto o = IdentifyFile(out);
        if (o.ok() && o->dev == id->dev && o->ino == id->ino)
          return absl::InvalidArgumentError(fmt::format(
              "input {} is the output {} of this run: it would be replaced; leave it out of the inputs or give "
              "another output prefix",
              in, out));
      }
  }
  return absl::OkStatus();
}

// The outputs of this run already there (a .bin, .idx or .ptk-done sidecar of any key): what --force
// writes again. A first run has none.
std::vector<std::string> OutputsThere(const TokenizeOptions& opt) {
  std::vector<std::string> there;
  for (const std::string& key : opt.json_keys) {
    const std::string prefix = OutputPrefixFor(opt.output_prefix, key);
    for (const char* ext : {".bin", ".idx", ".ptk-done"})
      if (PathExists(prefix + ext)) {
        there.push_back(prefix);
        break;
      }
  }
  return there;
}

// A rerun with the inputs and settings every output's sidecar records: the outputs' stats, as
// nothing is to be done; nullopt when one of them is to be written again.
std::optional<TokenizeStats> UpToDateOutputs(const TokenizeOptions& opt, const Gpt2Tokenizer& tok) {
  const std::string source = OutputSource(opt, tok);
  TokenizeStats done;
  done.up_to_date = !source.empty();
  for (size_t k = 0; k < opt.json_keys.size() && done.up_to_date; ++k) {
    const std::string prefix = OutputPrefixFor(opt.output_prefix, opt.json_keys[k]);
    int64_t documents = 0, tokens = 0;
    done.up_to_date = OutputUpToDate(prefix, source, opt, &documents, &tokens);
    done.documents = documents;
    done.tokens += tokens;
    done.outputs.push_back(prefix);
    if (!done.up_to_date)  // one line saying why, for the first output that is not
      if (const std::string why = RerunReason(prefix, source, opt); !why.empty()) log::Info("{}", why);
  }
  if (!done.up_to_date) return std::nullopt;
  // A writer killed after the outputs were complete (a second run that took the lock just before
  // its kill) leaves its lock file; nobody holds it, so taking and dropping the lock removes it.
  // One a live writer holds stays (Acquire fails at once, and that is fine here). A writer killed
  // between its resume record's removal and its index log's leaves the log alone (an output with
  // its record is not up to date): removed under the lock.
  for (const std::string& prefix : done.outputs) {
    struct stat st;
    const bool log_left = PathExists(prefix + ".ptk-resume-index");
    if (!log_left && ::stat((prefix + OutputLock::kSuffix).c_str(), &st) != 0) continue;
    auto lock = OutputLock::Acquire(prefix, opt.lock_wait);
    if (lock.ok() && log_left) RemoveStaleResumeRecord(prefix);
  }
  return done;
}

// The inputs' total size in bytes (0 for standard input), for the progress line and the batch size.
uint64_t InputBytes(const std::vector<std::string>& inputs) {
  uint64_t total_raw = 0;
  for (const auto& f : inputs) {
    struct stat st;
    if (f != "-" && ::stat(f.c_str(), &st) == 0) total_raw += static_cast<uint64_t>(st.st_size);
  }
  return total_raw;
}

size_t BatchBytesFor(const TokenizeOptions& opt, uint64_t total_raw, int workers) {
  size_t batch_bytes = opt.batch_bytes;
  if (batch_bytes == 0) {  // from the inputs' size; 1 MiB when it is unknown (standard input)
    const uint64_t per = total_raw == 0 ? (1 << 20) : total_raw / (8 * static_cast<uint64_t>(workers));
    batch_bytes = static_cast<size_t>(std::clamp<uint64_t>(per, 256 << 10, 1 << 20));
  }
  return batch_bytes;
}

// The errors of the pipeline's two serial stages.
struct PipelineErrors {
  absl::Status read, sink;
};

// The three stages in a oneTBB pipeline: the reader's batches encoded in parallel, consumed in order.
PipelineErrors RunStages(const TokenizeOptions& opt, const Gpt2Tokenizer& tok, int workers, LineReader& reader,
                         DocumentSink& sink, BatchPool& pool, ProgressReporter& progress) {
  // The caller's --workers, in an arena of this call's own. oneTBB caps every arena at the CPUs it sees
  // (the affinity mask), silently past a "TBB Warning" line: a --workers above them (kept, warned as
  // oversubscribing) ran on those CPUs' threads only. Then, and only for this run, its limit is raised.
  std::optional<tbb::global_control> above_cpus;
  if (workers > tbb::info::default_concurrency())
    above_cpus.emplace(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(workers));
  tbb::task_arena arena(workers);
  tbb::enumerable_thread_specific<std::unique_ptr<BatchEncoder>> encoders;
  // One status per serial stage: oneTBB may run the reader and the sink at the same time.
  absl::Status read_error, sink_error;
  std::atomic<bool> stop{false};

  arena.execute([&] {
    tbb::parallel_pipeline(
        static_cast<size_t>(workers + 2),
        tbb::make_filter<void, Batch*>(tbb::filter_mode::serial_in_order, [&](tbb::flow_control& fc) -> Batch* {
          // oneTBB orders the calls of a serial stage and hands batches on; TSan cannot see how.
          PTK_HAPPENS_AFTER(&reader);
          struct Mark {
            const LineReader* r;
            ~Mark() { PTK_HAPPENS_BEFORE(r); }
          } mark{&reader};
          if (stop) {
            fc.stop();
            return nullptr;
          }
          auto next = reader.Next();
          if (!next.ok()) {
            read_error = next.status();
            stop = true;
            fc.stop();
            return nullptr;
          }
          if (!*next) {
            fc.stop();
            return nullptr;
          }
          progress.AddBytes((*next)->raw_bytes);
          PTK_HAPPENS_BEFORE(next->get());
          return next->release();
        }) & tbb::make_filter<Batch*, Batch*>(tbb::filter_mode::parallel, [&](Batch* b) -> Batch* {
          PTK_HAPPENS_AFTER(b);
          if (!stop) {
            auto& e = encoders.local();
            if (!e) e = std::make_unique<BatchEncoder>(tok, opt);
            e->Encode(*b);
            PTK_HAPPENS_BEFORE(e.get());
          }
          PTK_HAPPENS_BEFORE(b);
          return b;
        }) & tbb::make_filter<Batch*, void>(tbb::filter_mode::serial_in_order, [&](Batch* raw) {
          PTK_HAPPENS_AFTER(raw);
          PTK_HAPPENS_AFTER(&sink);
          struct Mark {
            const DocumentSink* s;
            ~Mark() { PTK_HAPPENS_BEFORE(s); }
          } mark{&sink};
          std::unique_ptr<Batch> b(raw);
          if (stop) return;
          sink_error = sink.Consume(*b);
          if (!sink_error.ok()) stop = true;
          pool.Give(std::move(b));
        }));
  });
  PTK_HAPPENS_AFTER(&reader);
  PTK_HAPPENS_AFTER(&sink);
  for (auto& e : encoders) PTK_HAPPENS_AFTER(e.get());
  return {read_error, sink_error};
}

}  // namespace
}  // namespace tokenize_detail

absl::StatusOr<TokenizeStats> RunTokenize(const TokenizeOptions& opt, const Gpt2Tokenizer& tok) {
  using namespace tokenize_detail;
  PTK_RETURN_IF_ERROR(CheckTokenizeOptions(opt));
  if (!opt.force) {
    if (std::optional<TokenizeStats> done = UpToDateOutputs(opt, tok)) return *done;
  } else if (const std::vector<std::string> there = OutputsThere(opt); !there.empty()) {
    std::string names;  // said only where there is something to redo: a first run with --force has nothing
    for (const std::string& p : there) names += (names.empty() ? "" : ", ") + p;
    log::Info("--force: tokenizing again ({}), whatever the outputs' .ptk-done sidecars record", names);
  }
  const auto t_start = std::chrono::steady_clock::now();
  const int workers = std::max(1, opt.workers);
  const uint64_t total_raw = InputBytes(opt.inputs);
  ProgressReporter progress(
      {.label = "tokenize", .item_unit = "docs", .bytes_total = total_raw, .enabled = opt.progress});
  // Builders are destroyed unfinalized on error: their temporaries are removed.
  DocumentSink sink(opt, tok, progress);
  PTK_ASSIGN_OR_RETURN(const ReadPoint start, sink.Open());
  const size_t batch_bytes = BatchBytesFor(opt, total_raw, workers);
  // Declared before the reader: batches go back to it until the pipeline ends. A batch's buffer is
  // about twice batch_bytes at most unless a longer line made it grow.
  BatchPool pool(4 * batch_bytes + (256 << 10));
  LineReader reader(opt.inputs, batch_bytes, start, opt.megatron_log, pool);
  // With several workers, batches shrink towards the end of the input (a quarter of what is left
  // with two workers): the last big batch no longer keeps one worker busy while the others wait.
  if (opt.batch_bytes == 0 && workers > 1) reader.ShrinkTowardsTheEnd(total_raw, 1.0 / (2 * workers));

  if (opt.megatron_log) log::Out(fmt::format("Processing data with {} workers.", workers));  // --quiet is quiet
  const PipelineErrors errors = RunStages(opt, tok, workers, reader, sink, pool, progress);
  progress.Finish();
  if (!errors.sink.ok()) return errors.sink;  // about earlier lines than a later read error
  if (!errors.read.ok()) return errors.read;
  PTK_ASSIGN_OR_RETURN(TokenizeStats stats, sink.Finish());
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return stats;
}

}  // namespace ptk
