// ptk-concat plan's inputs: what other plans left below the input directories is not data to take
// again (their plan files; their chunks, when made from inputs this plan takes too).
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "dataprep/concat/concat.h"

namespace ptk {
namespace {

using FileId = std::pair<uint64_t, uint64_t>;  // device, inode

std::optional<FileId> IdOf(const std::string& path) {
  auto id = IdentifyFile(path);
  if (!id.ok()) return std::nullopt;
  return FileId{id->dev, id->ino};
}

}  // namespace

void LeaveOutOtherPlans(std::vector<std::string>* files, std::vector<LeftOutFile>* left_out) {
  std::map<FileId, size_t> by_id;
  std::vector<size_t> plans;
  for (size_t i = 0; i < files->size(); ++i) {
    if (auto id = IdOf((*files)[i])) by_id.emplace(*id, i);
    if (StartsLikeAConcatPlan((*files)[i])) plans.push_back(i);
  }
  std::map<size_t, std::string> drop;  // index in *files -> why
  for (size_t p : plans) {
    auto plan = ReadConcatPlan((*files)[p]);
    if (!plan.ok()) continue;  // a .json of records that merely starts so
    drop[p] = "a ptk-concat plan, not data";
    // Its chunks repeat the records of its inputs: left out when this plan takes one of those too.
    std::optional<std::string> shared;
    for (const ConcatChunk& c : plan->chunks)
      for (const ConcatInput& in : c.inputs)
        if (auto id = IdOf(plan->Resolve(in.path)); !shared && id && by_id.count(*id)) shared = (*files)[by_id[*id]];
    if (!shared) continue;  // a plan over its chunks (fewer, larger ones) takes them
    const std::vector<std::string> chunks = PlanChunkPaths(*plan);
    for (size_t k = 0; k < chunks.size(); ++k)
      if (auto id = IdOf(chunks[k]); id && by_id.count(*id))
        drop[by_id[*id]] = fmt::format(
            "chunk {} of the ptk-concat plan {}, made from inputs this plan takes too ({}, ...): its records would be "
            "concatenated twice",
            k, (*files)[p], *shared);
  }
  if (drop.empty()) return;
  std::vector<std::string> kept;
  for (size_t i = 0; i < files->size(); ++i) {
    if (auto it = drop.find(i); it != drop.end())
      left_out->push_back({(*files)[i], it->second});
    else
      kept.push_back(std::move((*files)[i]));
  }
  *files = std::move(kept);
}

}  // namespace ptk
