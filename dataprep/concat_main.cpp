// ptk-concat: many jsonl files -> N balanced chunks (72 by default), deterministic and resumable.
//   ptk-concat --input DIR --output-dir OUT               plan and build every chunk
//   ptk-concat plan --input DIR --output-dir OUT          write OUT/concat-plan.json only
//   ptk-concat run --plan OUT/concat-plan.json [--chunk-index I]   build one chunk (array task)
#include <atomic>
#include <mutex>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/progress.h"
#include "common/slurm_env.h"
#include "common/status.h"
#include "dataprep/concat.h"
#include "dataprep/input_list.h"

namespace {

struct PlanArgs {
  std::vector<std::string> inputs;
  std::string output_dir, order = "natural", name_pattern, plan_path;
  int64_t chunks = 72, files_per_chunk = 0;
};
struct RunArgs {
  std::string plan_path;
  std::optional<int64_t> chunk_index, shard_index, num_shards;
  int jobs = 4;
  bool quiet = false, no_fsync = false;
};

void AddPlanOptions(CLI::App* app, PlanArgs* a, bool required) {
  auto* in = app->add_option("--input,input", a->inputs,
                             "jsonl files, globs or directories (directories: every .jsonl/.jsonl.zst/.jsonl.xz below)");
  auto* out = app->add_option("--output-dir", a->output_dir, "Where the chunks are written");
  if (required) {
    in->required();
    out->required();
  }
  auto* c = app->add_option("--chunks", a->chunks, "Number of chunks, balanced by bytes")->check(CLI::PositiveNumber);
  app->add_option("--files-per-chunk", a->files_per_chunk,
                  "Consecutive groups of this many files instead (NeMo's concat.sh: 800 with --order bytes)")
      ->check(CLI::PositiveNumber)
      ->excludes(c);
  app->add_option("--order", a->order, "Input order: natural (shard2 before shard10) or bytes (C locale, as LC_ALL=C ls)")
      ->check(CLI::IsMember({"natural", "bytes"}));
  app->add_option("--name-pattern", a->name_pattern,
                  "Chunk file names, a {}-pattern of the 0-based index (default train_{:02d}.jsonl; NeMo: train_chunk_{}.jsonl)");
}

absl::StatusOr<ptk::ConcatPlan> BuildPlan(const PlanArgs& a) {
  PTK_ASSIGN_OR_RETURN(auto files, ptk::CollectInputs(a.inputs, {".jsonl", ".jsonl.zst", ".jsonl.xz", ".json"},
                                                      a.order == "bytes" ? ptk::PathOrder::kBytes : ptk::PathOrder::kNatural));
  std::vector<ptk::ConcatInput> inputs;
  for (const auto& f : files) {
    if (ptk::Dirname(f) == a.output_dir || f.rfind(a.output_dir + "/", 0) == 0) continue;  // never our own chunks
    PTK_ASSIGN_OR_RETURN(uint64_t size, ptk::FileSize(f));
    inputs.push_back({f, size});
  }
  ptk::ConcatPlanOptions po;
  po.chunks = a.chunks;
  po.files_per_chunk = a.files_per_chunk;
  po.name_pattern = a.name_pattern;
  auto plan = ptk::MakeConcatPlan(inputs, a.output_dir, po);
  if (!plan.ok() && plan.status().code() == absl::StatusCode::kInvalidArgument)
    return ptk::cli::UsageError(std::string(ptk::StatusMessage(plan.status())));
  return plan;
}

std::string DefaultPlanPath(const std::string& output_dir) { return ptk::JoinPath(output_dir, "concat-plan.json"); }

absl::Status RunPlan(const ptk::ConcatPlan& plan, const RunArgs& r) {
  std::vector<size_t> todo;
  if (r.chunk_index) {
    todo.push_back(static_cast<size_t>(*r.chunk_index));
  } else {
    PTK_ASSIGN_OR_RETURN(ptk::ShardSpec shard, ptk::ResolveShard(r.shard_index, r.num_shards));
    for (size_t k = 0; k < plan.chunks.size(); ++k)
      if (ptk::InShard(static_cast<int64_t>(k), shard)) todo.push_back(k);
  }
  uint64_t total = 0;
  for (size_t k : todo)
    if (k < plan.chunks.size()) total += plan.chunks[k].bytes;
  ptk::ProgressReporter progress({.label = "concat", .item_unit = "chunks", .items_total = todo.size(), .bytes_total = total,
                                  .enabled = !r.quiet});
  std::mutex mu;
  std::vector<absl::Status> errors(todo.size());
  int64_t built = 0, skipped = 0, newlines = 0;
  uint64_t bytes = 0;
  ptk::ParallelForEach(todo.size(), r.jobs, [&](size_t i) {
    auto res = ptk::BuildConcatChunk(plan, todo[i], !r.no_fsync);
    std::lock_guard<std::mutex> lock(mu);
    if (!res.ok()) {
      errors[i] = res.status();
      ptk::log::Error("chunk {}: {}", todo[i], ptk::StatusMessage(res.status()));
    } else {
      (res->skipped ? skipped : built) += 1;
      newlines += res->newlines_added;
      if (!res->skipped) bytes += res->bytes;
    }
    if (todo[i] < plan.chunks.size()) progress.AddBytes(plan.chunks[todo[i]].bytes);
    progress.AddItems(1);
  });
  progress.Finish();
  int failed = 0;
  for (const auto& e : errors) failed += !e.ok();
  ptk::log::Info("{} chunks built, {} already complete, {} failed; {:.1f} MB written to {}{}", built, skipped, failed,
                 bytes / 1e6, plan.output_dir,
                 newlines ? fmt::format("; {} inputs lacked a final newline (one was added)", newlines) : "");
  if (failed) return absl::InternalError(fmt::format("{} of {} chunks failed", failed, todo.size()));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  auto app = ptk::cli::MakeApp("ptk-concat",
                               "Concatenate many jsonl files into N chunks (default 72), balanced by bytes, in a "
                               "deterministic order. A file without a final newline never merges two records.");
  PlanArgs top;
  RunArgs top_run;
  AddPlanOptions(app.get(), &top, false);
  app->add_option("--plan", top_run.plan_path, "Plan file (default: OUTPUT_DIR/concat-plan.json)");
  app->add_option("--jobs", top_run.jobs, "Chunks built at once")->check(CLI::PositiveNumber);
  app->add_flag("--quiet", top_run.quiet, "No progress output");
  const char* kNoFsync = "Do not fsync the chunks: faster where the disk is slow, but a chunk may be lost (never "
                         "half-written) if the node crashes soon after; what cat gives";
  app->add_flag("--no-fsync", top_run.no_fsync, kNoFsync);

  PlanArgs plan_args;
  auto* plan_cmd = app->add_subcommand("plan", "Write the plan (which inputs form which chunk) and stop");
  AddPlanOptions(plan_cmd, &plan_args, true);
  plan_cmd->add_option("--plan", plan_args.plan_path, "Plan file to write (default: OUTPUT_DIR/concat-plan.json)");

  RunArgs run_args;
  auto* run_cmd = app->add_subcommand("run", "Build chunks of an existing plan: one (--chunk-index), this array task's "
                                             "share (--shard-index/--num-shards or SLURM_ARRAY_TASK_ID), or all");
  run_cmd->add_option("--plan", run_args.plan_path, "Plan file written by `ptk-concat plan`")->required();
  auto* ci = run_cmd->add_option("--chunk-index", run_args.chunk_index, "Build only this chunk (0-based)");
  run_cmd->add_option("--shard-index", run_args.shard_index, "This task's shard of the chunks")->excludes(ci);
  run_cmd->add_option("--num-shards", run_args.num_shards, "Number of shards")->excludes(ci);
  run_cmd->add_option("--jobs", run_args.jobs, "Chunks built at once")->check(CLI::PositiveNumber);
  run_cmd->add_flag("--quiet", run_args.quiet, "No progress output");
  run_cmd->add_flag("--no-fsync", run_args.no_fsync, kNoFsync);
  app->require_subcommand(0, 1);
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;

  return ptk::cli::RunMain([&]() -> absl::Status {
    if (plan_cmd->parsed()) {
      PTK_ASSIGN_OR_RETURN(auto plan, BuildPlan(plan_args));
      std::string path = plan_args.plan_path.empty() ? DefaultPlanPath(plan_args.output_dir) : plan_args.plan_path;
      PTK_RETURN_IF_ERROR(ptk::MakeDirs(ptk::Dirname(path)));
      PTK_RETURN_IF_ERROR(ptk::WriteConcatPlan(plan, path));
      size_t files = 0;
      for (const auto& c : plan.chunks) files += c.inputs.size();
      ptk::log::Info("plan: {} files -> {} chunks in {}; written to {}", files, plan.chunks.size(), plan.output_dir, path);
      return absl::OkStatus();
    }
    if (run_cmd->parsed()) {
      PTK_ASSIGN_OR_RETURN(auto plan, ptk::ReadConcatPlan(run_args.plan_path));
      return RunPlan(plan, run_args);
    }
    if (top.inputs.empty() || top.output_dir.empty())
      return ptk::cli::UsageError("give --input and --output-dir (or use the plan / run subcommands)");
    PTK_ASSIGN_OR_RETURN(auto plan, BuildPlan(top));
    PTK_RETURN_IF_ERROR(ptk::MakeDirs(top.output_dir));
    std::string path = top_run.plan_path.empty() ? DefaultPlanPath(top.output_dir) : top_run.plan_path;
    PTK_RETURN_IF_ERROR(ptk::WriteConcatPlan(plan, path));
    return RunPlan(plan, top_run);
  });
}
