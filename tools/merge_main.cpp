// ptk-merge: merge Megatron indexed datasets (like tools/merge_datasets.py).
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/status.h"
#include "indexed_dataset/indexed_dataset.h"
#include "indexed_dataset/merge.h"

int main(int argc, char** argv) {
  auto app =
      ptk::cli::MakeApp("ptk-merge",
                        "Merge several Megatron .bin/.idx datasets into one. With --input DIR every prefix in DIR "
                        "is merged in sorted order (as Megatron's tools/merge_datasets.py); with --inputs the "
                        "given order is kept.");
  std::string input_dir, output_prefix;
  std::vector<std::string> inputs;
  bool multimodal = false, force = false, quiet = false;
  auto* in_opt =
      app->add_option("--input", input_dir, "Directory holding the PREFIX.bin/.idx pairs to merge (sorted order)");
  app->add_option("--inputs", inputs, "Prefixes to merge, in this order")->excludes(in_opt);
  app->add_option("--output-prefix", output_prefix, "Output path without .bin/.idx")->required();
  app->add_flag("--multimodal", multimodal, "The datasets carry a per-sequence modes array");
  app->add_flag("--quiet", quiet, "No progress output");
  std::chrono::milliseconds lock_wait{0};
  ptk::cli::AddLockWait(*app, &lock_wait);
  app->add_flag("--force", force,
                "Merge again even when the output's .ptk-done sidecar records these inputs (same files, sizes and "
                "times) and settings");
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;
  ptk::cli::RemoveTemporariesOnSignals();  // a partial output is worth nothing after an interrupt

  return ptk::cli::RunMain([&]() -> absl::Status {
    if (input_dir.empty() && inputs.empty()) return ptk::UsageError("give --input DIR or --inputs PREFIX...");
    PTK_RETURN_IF_ERROR(ptk::cli::CheckOutputPrefix("--output-prefix", output_prefix, ".bin"));
    if (!input_dir.empty()) {
      if (!ptk::IsDirectory(input_dir))
        return absl::NotFoundError(fmt::format(
            "--input {}: {}", input_dir,
            ptk::PathExists(input_dir) ? "is not a directory (--inputs takes prefixes)" : "no such directory"));
      PTK_ASSIGN_OR_RETURN(inputs, ptk::FindPrefixesInDir(input_dir, output_prefix));
    } else {
      // PREFIX, PREFIX.bin or PREFIX.idx; a prefix without its _text_document gets the hint.
      for (std::string& in : inputs) {
        PTK_ASSIGN_OR_RETURN(in, ptk::ResolveDatasetPrefix(in));
      }
    }
    // One dataset twice (however spelled, or a link to it in --input DIR) would be merged twice:
    // its documents duplicated.
    std::map<std::pair<uint64_t, uint64_t>, std::string> seen;
    for (const std::string& in : inputs) {
      auto id = ptk::IdentifyFile(ptk::IdxPath(in));
      if (!id.ok()) continue;  // the merge names it
      auto [it, fresh] = seen.emplace(std::make_pair(id->dev, id->ino), in);
      if (!fresh) {
        const std::string why =
            fmt::format("{} and {} are the same dataset ({}): merging it twice would duplicate its documents{}",
                        it->second, in, ptk::IdxPath(in), input_dir.empty() ? "; give it once" : "");
        return input_dir.empty() ? ptk::UsageError(why) : absl::FailedPreconditionError(why);
      }
    }
    if (absl::Status held = ptk::CheckNoInputHoldsAnother(inputs); !held.ok())
      return input_dir.empty() ? ptk::UsageError(std::string(held.message())) : held;
    // --inputs naming the output itself (however spelled) is a usage error, as a repeated input is (the
    // merge said "error: output prefix X is also an input", exit 1). --input DIR never takes the output.
    for (const std::string& in : inputs)
      for (std::string (*file)(const std::string&) : {&ptk::IdxPath, &ptk::BinPath}) {
        auto a = ptk::IdentifyFile((*file)(in)), b = ptk::IdentifyFile((*file)(output_prefix));
        if (input_dir.empty() && a.ok() && b.ok() && a->dev == b->dev && a->ino == b->ino)
          return ptk::UsageError(fmt::format(
              "--output-prefix {} is --inputs {} (the same dataset, {}): the merge would write over its own input; "
              "give the output a prefix of its own",
              output_prefix, in, (*file)(in)));
      }
    // A missing output directory is created (as ptk-tokenize's), once the inputs are known.
    PTK_RETURN_IF_ERROR(ptk::cli::CreateOutputDirectory("--output-prefix", output_prefix));
    PTK_ASSIGN_OR_RETURN(const std::string source, ptk::MergeSource(inputs, multimodal));
    int64_t documents = 0, tokens = 0;
    if (!force && ptk::DatasetMadeFrom(output_prefix, source, &documents, &tokens)) {
      ptk::log::Info(
          "{}: up to date, not rewritten: its .ptk-done sidecar records these {} inputs and settings "
          "(--force merges again)",
          output_prefix, inputs.size());
      ptk::log::Info("done: nothing to do ({} documents, {} tokens already written)", documents, tokens);
      return absl::OkStatus();
    }
    PTK_ASSIGN_OR_RETURN(auto st, ptk::MergeDatasets(inputs, output_prefix, multimodal, source, !quiet, lock_wait));
    for (const std::string& w : st.warnings) ptk::log::Warning("{}", w);
    ptk::log::Info("merged {} datasets into {}: {} documents, {} sequences, {} tokens", inputs.size(), output_prefix,
                   st.documents, st.sequences, st.tokens);
    return absl::OkStatus();
  });
}
