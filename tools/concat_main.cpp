// ptk-concat: many jsonl files -> N balanced chunks (72 by default), deterministic and resumable.
//   ptk-concat --input DIR --output-dir OUT               plan and build every chunk
//   ptk-concat plan --input DIR --output-dir OUT          write OUT/concat-plan.json only
//   ptk-concat run --plan OUT/concat-plan.json [--chunk-index I]   build one chunk (array task)
#include <fmt/core.h>

#include "common/cli.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/slurm_env.h"
#include "common/status.h"
#include "dataprep/concat/concat.h"
#include "dataprep/input/byte_source.h"

namespace {

struct RunArgs {
  std::string plan_path;
  std::optional<int64_t> chunk_index, shard_index, num_shards;
  int jobs = 4;
  bool quiet = false, no_fsync = false;
  std::chrono::milliseconds lock_wait{0};  // --lock-wait
};

// `positional`: the positional arguments' name. It differs between the app and its subcommands:
// CLI11 2.4 (Ubuntu 24.04) refuses a subcommand option --input while the parent has a positional
// named "input".
void AddPlanOptions(CLI::App* app, ptk::ConcatPlanRequest* r, bool required, const std::string& positional) {
  auto* in = app->add_option("--input," + positional, r->inputs,
                             "jsonl files, globs or directories (directories: every " +
                                 ptk::DescribeSuffixes(ptk::JsonInputSuffixes()) + " below)");
  auto* out = app->add_option("--output-dir", r->output_dir, "Where the chunks are written");
  if (required) {
    in->required();
    out->required();
  }
  auto* c = app->add_option("--chunks", r->plan.chunks, "Number of chunks, balanced by bytes")
                ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  app->add_option("--files-per-chunk", r->plan.files_per_chunk,
                  "Consecutive groups of this many files instead (NeMo's concat.sh: 800 with --order bytes)")
      ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt))
      ->excludes(c);
  app->add_option("--order", r->order,
                  "Input order: natural (shard2 before shard10) or bytes (C locale, as LC_ALL=C ls)")
      ->check(CLI::IsMember({"natural", "bytes"}));
  app->add_option(
      "--name-pattern", r->plan.name_pattern,
      "Chunk file names, a {}-pattern of the 0-based index (default train_{:02d}.jsonl; NeMo: train_chunk_{}.jsonl)");
}

absl::Status Run(const ptk::ConcatPlan& plan, const RunArgs& a) {
  // A chunk the plan does not have is the flag's error (exit 2), said once: it was exit 1 with the error, a
  // "0 chunks built ... 1 failed" summary and "1 of 1 chunks failed".
  if (a.chunk_index && static_cast<uint64_t>(*a.chunk_index) >= plan.chunks.size())
    return ptk::UsageError(
        fmt::format("--chunk-index {}: the plan {} has {} chunk(s){} (ptk-concat list --plan {} names them)",
                    *a.chunk_index, a.plan_path, plan.chunks.size(),
                    plan.chunks.empty() ? "" : fmt::format(", 0 to {}", plan.chunks.size() - 1), a.plan_path));
  ptk::ConcatRunOptions o;
  o.chunk_index = a.chunk_index;
  if (!a.chunk_index) {
    PTK_ASSIGN_OR_RETURN(o.shard, ptk::ResolveShard(a.shard_index, a.num_shards));
  }
  o.jobs = a.jobs;
  o.durable = !a.no_fsync;
  o.progress = !a.quiet;
  o.lock_wait = a.lock_wait;
  PTK_ASSIGN_OR_RETURN(ptk::ConcatSummary s, ptk::RunConcat(plan, o));
  ptk::log::Info(
      "{} chunks built, {} already complete, {} failed; {:.1f} MB written to {}{}", s.built, s.skipped, s.failed,
      s.bytes / 1e6, plan.Resolve(plan.output_dir),
      s.newlines_added ? fmt::format("; {} inputs lacked a final newline (one was added)", s.newlines_added) : "");
  if (s.failed) {
    const std::string msg = fmt::format("{} of {} chunks failed", s.failed, s.built + s.skipped + s.failed);
    for (const auto& [chunk, why] : s.errors)  // a full disk is exit 3 in every tool
      if (absl::IsResourceExhausted(why))
        return absl::ResourceExhaustedError(msg + "; " + std::string(ptk::StatusMessage(why)));
    return absl::InternalError(msg);
  }
  return absl::OkStatus();
}

absl::StatusOr<ptk::ConcatPlan> PlanAndWrite(ptk::ConcatPlanRequest r, const std::string& plan_path) {
  // Empty, it wrote concat-plan.json into the current directory, then failed ("list : No such file").
  if (r.output_dir.empty()) return ptk::UsageError("--output-dir is empty: give a directory (. for this one)");
  std::string path = plan_path.empty() ? ptk::JoinPath(r.output_dir, "concat-plan.json") : plan_path;
  r.plan_path = path;
  PTK_ASSIGN_OR_RETURN(auto plan, ptk::PlanConcat(r));
  PTK_RETURN_IF_ERROR(ptk::CheckPlanPath(
      plan, path, plan_path.empty() ? "the plan " + path + " (--plan's default)" : "--plan " + path));
  PTK_RETURN_IF_ERROR(ptk::MakeDirs(ptk::Dirname(path)));
  PTK_RETURN_IF_ERROR(ptk::MakeDirs(r.output_dir));
  PTK_RETURN_IF_ERROR(ptk::WriteConcatPlan(plan, path));
  PTK_ASSIGN_OR_RETURN(auto removed, ptk::RemoveChunksNotInPlan(plan, r.lock_wait));
  if (!removed.empty())
    ptk::log::Info("removed {} chunks of an earlier plan that this plan does not have: {}{}", removed.size(),
                   removed.front(), removed.size() > 1 ? fmt::format(" ... {}", removed.back()) : "");
  size_t files = 0;
  for (const auto& c : plan.chunks) files += c.inputs.size();
  // --chunks 72 over 24 files makes 24 chunks (a chunk holds one non-empty file at least): array tasks past the
  // last chunk build nothing, and `run --chunk-index 30` is refused ("the plan ... has 24 chunk(s)"), so the
  // plan line says so.
  const bool fewer = r.plan.files_per_chunk == 0 && plan.chunks.size() < static_cast<size_t>(r.plan.chunks);
  ptk::log::Info(
      "plan: {} files -> {} chunks in {}{}; written to {}", files, plan.chunks.size(), plan.output_dir,
      fewer ? fmt::format(" (not --chunks {}: a chunk holds one non-empty file at least)", r.plan.chunks) : "", path);
  return plan;
}

// --plan names the file `ptk-concat plan` wrote; its output directory is a likely slip, and a missing one
// most often `run` before `plan`: the hint says what writes it.
absl::Status CheckPlan(const std::string& path) {
  const std::string in_dir = ptk::JoinPath(path, "concat-plan.json");
  std::string hint;
  if (ptk::IsDirectory(path) && ptk::PathExists(in_dir))
    hint = "did you mean --plan " + in_dir + "?";
  else if (!ptk::PathExists(path))
    hint = ptk::Basename(path) == "concat-plan.json"
               ? "write it first: ptk-concat plan --input DIR --output-dir " + ptk::Dirname(path)
               : "write it first: ptk-concat plan --input DIR --output-dir DIR --plan " + path;
  return ptk::cli::CheckInputFile("--plan", path, hint);
}

// `ptk-concat list`: the plan's chunk files (and --with's items), or this array task's share of them.
struct ListArgs {
  std::string plan;
  std::vector<std::string> with;
  bool this_task = false;
  std::optional<int64_t> shard_index, num_shards;
};

CLI::App* AddListCommand(CLI::App* app, ListArgs* a) {
  auto* cmd = app->add_subcommand(
      "list", "Print the plan's chunk files, one per line, in order: what later stages read (never a glob)");
  cmd->add_option("--plan", a->plan, "Plan file written by `ptk-concat plan`")->required();
  ptk::cli::Repeatable(
      cmd->add_option("--with", a->with, "Items listed after the chunks (e.g. the validation folder); repeatable"));
  cmd->add_flag("--this-task", a->this_task,
                "Only this array task's share of the items (item k when k % count == index): the task from "
                "--shard-index/--num-shards, SLURM_ARRAY_TASK_ID/COUNT or JOB_COMPLETION_INDEX/JOB_COMPLETIONS, "
                "as `run` takes it");
  cmd->add_option("--shard-index", a->shard_index, "With --this-task: this task's shard")
      ->check(ptk::cli::IntIn(0, ptk::cli::kMaxInt));
  cmd->add_option("--num-shards", a->num_shards, "With --this-task: number of shards")
      ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  return cmd;
}

absl::Status List(const ListArgs& a) {
  PTK_RETURN_IF_ERROR(CheckPlan(a.plan));
  PTK_ASSIGN_OR_RETURN(auto plan, ptk::ReadConcatPlan(a.plan));
  PTK_ASSIGN_OR_RETURN(const std::vector<std::string> items, ptk::ConcatListItems(plan, a.with));
  if ((a.shard_index || a.num_shards) && !a.this_task)
    return ptk::UsageError("--shard-index/--num-shards select a task's share: give --this-task too");
  ptk::ShardSpec shard;  // everything
  if (a.this_task) {
    PTK_ASSIGN_OR_RETURN(shard, ptk::ResolveShard(a.shard_index, a.num_shards));
    int64_t mine = 0;
    for (size_t k = 0; k < items.size(); ++k) mine += ptk::InShard(static_cast<int64_t>(k), shard) ? 1 : 0;
    ptk::log::Info("task {} of {} (from {}): {} of {} items", shard.index, shard.count, shard.source, mine,
                   items.size());
  }
  for (size_t k = 0; k < items.size(); ++k)
    if (ptk::InShard(static_cast<int64_t>(k), shard)) std::printf("%s\n", items[k].c_str());
  return absl::OkStatus();
}

// The tool's own flags are the one-process form's: before a subcommand they were ignored
// (`ptk-concat --no-fsync run --plan P` fsynced, `--jobs 8 run` built one chunk at a time). The message
// for the first one given before `sub`, or "" when none was.
std::string ToolFlagBefore(const CLI::App& app, const CLI::App& sub, bool sub_is_plan) {
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->count() == 0 || opt == app.get_help_ptr() || opt == app.get_version_ptr()) continue;
    const std::string name = opt->get_name(false, true);
    bool sub_has = false;
    for (const CLI::Option* o : sub.get_options()) sub_has |= o->get_name(false, true) == name;
    if (sub_has)
      return fmt::format("{} before `{}` is the one-process form's flag, which `{}` ignores: give it after `{}`", name,
                         sub.get_name(), sub.get_name(), sub.get_name());
    return fmt::format("{} does not go with `{}`{}", name, sub.get_name(), sub_is_plan ? "" : " (it reads the plan)");
  }
  return "";
}

// Said as soon as the subcommand's name is read, before its own required flags are checked: `ptk-concat
// --output-dir x plan --input in` said "--output-dir is required".
void RefuseToolFlagsBefore(CLI::App* app, std::initializer_list<CLI::App*> subs, const CLI::App* plan_cmd) {
  for (CLI::App* sub : subs)
    sub->preparse_callback([app, sub, plan_cmd](size_t) {
      if (std::string before = ToolFlagBefore(*app, *sub, sub == plan_cmd); !before.empty())
        throw CLI::ValidationError(before);
    });
}

// A misspelt subcommand (`ptk-concat pln --input in ...`) was read as an input file: "pln: no such file".
absl::Status SubcommandMisspelt(const std::vector<std::string>& inputs) {
  if (inputs.empty() || ptk::PathExists(inputs.front()) || inputs.front().find_first_of("*?[") != std::string::npos)
    return absl::OkStatus();
  // The nearest within two edits (`pun` is `run`, not `plan`, the first within two).
  const std::string sub = ptk::cli::NearestName(inputs.front(), {"plan", "run", "list"}, 2);
  if (sub.empty() || inputs.front().size() > 6) return absl::OkStatus();
  return ptk::UsageError(
      fmt::format("{}: no such file or subcommand; did you mean the subcommand `{}`?", inputs.front(), sub));
}

}  // namespace

int main(int argc, char** argv) {
  auto app = ptk::cli::MakeApp("ptk-concat",
                               "Concatenate many jsonl files into N chunks (default 72), balanced by bytes, in a "
                               "deterministic order. A file without a final newline never merges two records.");
  ptk::ConcatPlanRequest top;
  RunArgs top_run;
  AddPlanOptions(app.get(), &top, false, "inputs");
  app->add_option("--plan", top_run.plan_path, "Plan file (default: OUTPUT_DIR/concat-plan.json)");
  app->add_option("--jobs", top_run.jobs, "Chunks built at once")->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  app->add_flag("--quiet", top_run.quiet, "No progress output");
  const char* kNoFsync =
      "Do not fsync the chunks: faster where the disk is slow, but a chunk may be lost (never "
      "half-written) if the node crashes soon after; what cat gives";
  app->add_flag("--no-fsync", top_run.no_fsync, kNoFsync);
  ptk::cli::AddLockWait(*app, &top.lock_wait);

  ptk::ConcatPlanRequest plan_req;
  std::string plan_path;
  auto* plan_cmd = app->add_subcommand("plan", "Write the plan (which inputs form which chunk) and stop");
  AddPlanOptions(plan_cmd, &plan_req, true, "input");
  plan_cmd->add_option("--plan", plan_path, "Plan file to write (default: OUTPUT_DIR/concat-plan.json)");
  ptk::cli::AddLockWait(*plan_cmd, &plan_req.lock_wait);

  RunArgs run_args;
  auto* run_cmd =
      app->add_subcommand("run",
                          "Build chunks of an existing plan: one (--chunk-index), this array task's "
                          "share (--shard-index/--num-shards, SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX), or all");
  run_cmd->add_option("--plan", run_args.plan_path, "Plan file written by `ptk-concat plan`")->required();
  auto* ci = run_cmd->add_option("--chunk-index", run_args.chunk_index, "Build only this chunk (0-based)")
                 ->check(ptk::cli::IntIn(0, ptk::cli::kMaxInt));
  run_cmd
      ->add_option("--shard-index", run_args.shard_index,
                   "This task's shard of the chunks (default: from SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX)")
      ->check(ptk::cli::IntIn(0, ptk::cli::kMaxInt))
      ->excludes(ci);
  run_cmd
      ->add_option("--num-shards", run_args.num_shards,
                   "Number of shards (default: SLURM_ARRAY_TASK_COUNT or JOB_COMPLETIONS)")
      ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt))
      ->excludes(ci);
  run_cmd->add_option("--jobs", run_args.jobs, "Chunks built at once")->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  run_cmd->add_flag("--quiet", run_args.quiet, "No progress output");
  run_cmd->add_flag("--no-fsync", run_args.no_fsync, kNoFsync);
  ptk::cli::AddLockWait(*run_cmd, &run_args.lock_wait);
  ListArgs list_args;
  auto* list_cmd = AddListCommand(app.get(), &list_args);
  app->require_subcommand(0, 1);
  RefuseToolFlagsBefore(app.get(), {plan_cmd, run_cmd, list_cmd}, plan_cmd);
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;
  ptk::cli::RemoveTemporariesOnSignals();  // a partial output is worth nothing after an interrupt

  return ptk::cli::RunMain([&]() -> absl::Status {
    for (CLI::App* sub : {plan_cmd, run_cmd, list_cmd})
      if (sub->parsed())
        if (std::string before = ToolFlagBefore(*app, *sub, sub == plan_cmd); !before.empty())
          return ptk::UsageError(before);
    if (plan_cmd->parsed()) return PlanAndWrite(plan_req, plan_path).status();
    if (list_cmd->parsed()) return List(list_args);
    if (run_cmd->parsed()) {
      PTK_RETURN_IF_ERROR(CheckPlan(run_args.plan_path));
      PTK_ASSIGN_OR_RETURN(auto plan, ptk::ReadConcatPlan(run_args.plan_path));
      return Run(plan, run_args);
    }
    PTK_RETURN_IF_ERROR(SubcommandMisspelt(top.inputs));
    if (top.inputs.empty() || top.output_dir.empty())
      return ptk::UsageError("give --input and --output-dir (or use the plan / run subcommands)");
    PTK_ASSIGN_OR_RETURN(auto plan, PlanAndWrite(top, top_run.plan_path));
    top_run.lock_wait = top.lock_wait;  // the one --lock-wait for both steps
    return Run(plan, top_run);
  });
}
