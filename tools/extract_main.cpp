// ptk-extract: .zst / .xz / .gz -> .jsonl, streaming, per-file parallel, resumable, shardable.
#include <algorithm>
#include <set>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/cpu_budget.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/status.h"
#include "dataprep/extract/extract.h"
#include "dataprep/input/byte_source.h"
#include "dataprep/input/input_list.h"

namespace {

// The files that failed, one error line each, and the run's status.
absl::Status FailedFiles(const ptk::ExtractSummary& s) {
  if (s.failed == 0) return absl::OkStatus();
  for (const auto& f : s.files)
    if (f.state == ptk::ExtractFileResult::State::kFailed) {
      // Most messages name the file first already: not twice.
      const std::string_view m = ptk::StatusMessage(f.error);
      if (m.starts_with(f.input + ":"))
        ptk::log::Error("failed: {}", m);
      else
        ptk::log::Error("failed: {}: {}", f.input, m);
    }
  const std::string msg = fmt::format("{} of {} files failed", s.failed, s.files.size());
  for (const auto& f : s.files)  // a full disk is exit 3 in every tool
    if (f.state == ptk::ExtractFileResult::State::kFailed && absl::IsResourceExhausted(f.error))
      return absl::ResourceExhaustedError(msg + "; " + std::string(ptk::StatusMessage(f.error)));
  return absl::DataLossError(msg);
}

// --verify of the outputs whose input is gone, added to `s` (a line says how many when there are any).
const ptk::ExtractSummary& VerifyGone(const std::vector<std::string>& roots, const ptk::ShardSpec& shard,
                                      ptk::ExtractSummary* s) {
  std::vector<ptk::ExtractFileResult> gone = ptk::VerifyOutputsWithoutInput(roots, shard);
  int64_t damaged = 0;
  for (auto& r : gone) {
    damaged += r.state == ptk::ExtractFileResult::State::kFailed;
    s->files.push_back(std::move(r));
  }
  s->failed += damaged;
  s->skipped += static_cast<int64_t>(gone.size()) - damaged;
  if (!gone.empty())
    ptk::log::Info("--verify: {} outputs whose input is gone checked against their sidecars, {} damaged or missing",
                   gone.size(), damaged);
  return *s;
}

// The input arguments less those a finished --delete-input run took (a file or glob that names nothing
// now, whose outputs' sidecars record it), counted in *gone: its rerun is a no-op, as for a directory.
std::vector<std::string> StillThere(const std::vector<std::string>& inputs, bool delete_input,
                                    const std::string& output_dir, int64_t* gone) {
  std::vector<std::string> there;
  for (const std::string& in : inputs) {
    const bool taken = delete_input && !ptk::PathExists(in) && ptk::ArgumentWasExtracted(in, output_dir);
    *gone += taken;
    if (!taken) there.push_back(in);
  }
  return there;
}

// The shard's line, and a warning for each --drop-set no record read carries: a misspelt name drops
// nothing (a shard may lack a set: a warning, not a failure).
void PrintSummary(const ptk::ExtractOptions& opt, const ptk::ExtractSummary& s) {
  ptk::log::Info(
      "shard {}/{}: {} extracted, {} already complete, {} failed; {:.1f} MB in -> {:.1f} MB out in {:.2f} s{}",
      opt.shard.index, opt.shard.count, s.extracted, s.skipped, s.failed, s.bytes_in / 1e6, s.bytes_out / 1e6,
      s.seconds, s.dropped ? fmt::format(", {} records dropped", s.dropped) : "");
  for (size_t k = 0; k < s.dropped_by_set.size() && s.records > 0; ++k)
    if (s.dropped_by_set[k] == 0)
      ptk::log::Warning(
          "--drop-set {}: no record of this set among the {} records read (meta.redpajama_set_name must equal it "
          "exactly: a misspelt name drops nothing)",
          opt.drop_sets[k], s.records);
}

// No compressed input file found: a rerun of a finished --delete-input job (its inputs gone, `gone` of
// them, and their outputs under `roots` complete: OK, --verify checking them), or NotFound naming the
// `inputs` (`none_left_out`: they held no file at all).
absl::Status NoInputFiles(const std::vector<std::string>& inputs, const std::vector<std::string>& roots,
                          const ptk::ShardSpec& shard, bool delete_input, bool verify, int64_t gone,
                          bool none_left_out) {
  if (delete_input) {
    int64_t done = ptk::CountExtractedOutputs(roots);
    if (done > 0 || gone > 0) {
      ptk::ExtractSummary s;
      if (verify) PTK_RETURN_IF_ERROR(FailedFiles(VerifyGone(roots, shard, &s)));
      ptk::log::Info("nothing to do: no compressed inputs left, {} outputs already extracted (--delete-input){}", done,
                     verify ? fmt::format("; {} verified against their sidecars", s.skipped) : "");
      return absl::OkStatus();
    }
  }
  std::string given;
  for (const std::string& in : inputs) given += (given.empty() ? "" : ", ") + in;
  return absl::NotFoundError(fmt::format("no input files: nothing to extract in {}{}", given,
                                         none_left_out ? " (empty)" : " (every file left out, listed above)"));
}

}  // namespace

int main(int argc, char** argv) {
  auto app = ptk::cli::MakeApp(
      "ptk-extract",
      "Decompress .zst/.xz/.gz files (and pass plain ones through) to .jsonl, streaming and multi-frame aware. Files "
      "are "
      "processed in parallel (--jobs) and split across array tasks (--shard-index/--num-shards, default from "
      "SLURM_ARRAY_TASK_ID/COUNT or a Kubernetes Indexed Job's JOB_COMPLETION_INDEX/JOB_COMPLETIONS). Outputs appear "
      "atomically; a rerun skips outputs already complete.");
  std::vector<std::string> inputs, drop_sets;
  std::string output_dir;
  // Decompression is CPU-bound: 4 files at once, fewer where this process may use fewer CPUs.
  const ptk::CpuBudget cpus = ptk::ThisProcessCpuBudget();
  int jobs = std::min(4, cpus.cpus);
  std::optional<int64_t> shard_index, num_shards;
  bool delete_input = false, verify = false, quiet = false;
  // Not CLI11's required(): its "--input is required" named the form docs/ptk-extract.md does not use.
  app->add_option("--input,input", inputs, "Files, globs or directories (directories: every .zst/.xz/.gz below)");
  app->add_option(
      "--output-dir", output_dir,
      "Where the .jsonl files go, keeping the layout below a directory argument (default: next to each input)");
  CLI::Option* jobs_opt =
      app->add_option("--jobs", jobs,
                      "Files decompressed at once (default: 4, or the CPUs this process may use when fewer: its "
                      "affinity mask capped by its cgroup CPU quota)")
          ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  app->add_option("--shard-index", shard_index,
                  "This task's shard (default: from SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX)")
      ->check(ptk::cli::IntIn(0, ptk::cli::kMaxInt));
  app->add_option("--num-shards", num_shards, "Number of shards (default: SLURM_ARRAY_TASK_COUNT or JOB_COMPLETIONS)")
      ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  app->add_flag("--delete-input", delete_input, "Delete each input after its output is complete");
  ptk::cli::Repeatable(
      app->add_option("--drop-set", drop_sets,
                      "Drop records whose meta.redpajama_set_name is this (repeatable; NeMo drops RedPajamaBook)"));
  app->add_flag("--verify", verify,
                "Re-decode inputs whose outputs look complete and compare byte for byte; outputs whose input is gone "
                "(--delete-input) are checked against the size and checksum their sidecar recorded");
  bool force = false;
  app->add_flag("--force", force,
                "Overwrite existing outputs that ptk-extract did not write (default: refused, as zstd -d refuses)");
  app->add_flag("--quiet", quiet, "No progress output");
  std::chrono::milliseconds lock_wait{0};
  ptk::cli::AddLockWait(*app, &lock_wait);
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;
  ptk::cli::RemoveTemporariesOnSignals();  // a partial output is worth nothing after an interrupt

  return ptk::cli::RunMain([&]() -> absl::Status {
    if (inputs.empty())
      return ptk::UsageError(
          "no input given: name the files, globs or directories to extract (ptk-extract raw --output-dir extracted)");
    ptk::ExtractOptions opt;
    std::vector<ptk::LeftOutFile> left_out;
    int64_t gone = 0;  // input arguments a finished --delete-input run took
    PTK_ASSIGN_OR_RETURN(auto files,
                         ptk::CollectInputFiles(StillThere(inputs, delete_input, output_dir, &gone),
                                                ptk::CompressedSuffixes(), ptk::PathOrder::kNatural, &left_out));
    std::set<std::string> outputs;  // this tool's own outputs beside their inputs are not worth a word
    for (const auto& f : files) {
      opt.inputs.push_back(f.path);
      opt.relative_outputs.push_back(f.rel);
      outputs.insert(ptk::ExtractOutputPath(f.path, f.rel, output_dir));
    }
    std::erase_if(left_out, [&](const ptk::LeftOutFile& l) { return outputs.count(l.path) > 0; });
    ptk::ReportLeftOut(left_out);
    // Where the outputs are, for those whose input is gone (a --delete-input run's): --verify checks them too.
    const std::vector<std::string> roots = output_dir.empty() ? inputs : std::vector<std::string>{output_dir};
    PTK_ASSIGN_OR_RETURN(opt.shard, ptk::ResolveShard(shard_index, num_shards));
    if (opt.inputs.empty()) return NoInputFiles(inputs, roots, opt.shard, delete_input, verify, gone, left_out.empty());
    opt.output_dir = output_dir;
    opt.jobs = jobs;
    if (jobs_opt->count() == 0 && jobs < 4) {
      if (!quiet) ptk::log::Info("--jobs {}: the CPUs this process may use ({})", jobs, cpus.reason);
    } else if (const std::string note = ptk::OversubscriptionNote("--jobs", jobs, cpus); !note.empty()) {
      ptk::log::Warning("{}", note);
    }
    opt.delete_input = delete_input;
    opt.drop_sets = drop_sets;
    opt.verify = verify;
    opt.force = force;
    opt.progress = !quiet;
    opt.lock_wait = lock_wait;
    PTK_ASSIGN_OR_RETURN(ptk::ExtractSummary s, ptk::RunExtract(opt));
    PrintSummary(opt, s);
    if (verify) VerifyGone(roots, opt.shard, &s);
    return FailedFiles(s);
  });
}
