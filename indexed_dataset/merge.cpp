// Merging indexed datasets.
#include "indexed_dataset/merge.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include <fmt/core.h>

#include "absl/strings/str_split.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/human_format.h"
#include "common/logging.h"
#include "common/progress.h"
#include "common/status.h"
#include "indexed_dataset/indexed_dataset.h"

namespace ptk {

namespace {

// Where a merge's recorded source lists its inputs (after the hash, one absolute prefix a line).
constexpr std::string_view kInputsTag = "\ninputs:\n";
// After the inputs, what they hold (a merge's inputs, and what those held, to any depth): a later
// merge sees the overlap even when a merge between them was deleted since.
constexpr std::string_view kHeldTag = "\nheld:\n";

// What a merge ptk wrote records in its sidecar: its inputs and what they held (absolute prefixes);
// nothing for any other dataset (or a merge that did not list them).
struct MergeRecord {
  std::vector<std::string> inputs, held;
};
MergeRecord RecordedMerge(const std::string& prefix) {
  MergeRecord out;
  const std::optional<std::string> source = RecordedSource(prefix);
  const size_t at = source && source->rfind("ptk-merge ", 0) == 0 ? source->find(kInputsTag) : std::string::npos;
  if (at == std::string::npos) return out;
  const std::string rest = source->substr(at + kInputsTag.size());
  const size_t held_at = rest.find(kHeldTag);
  for (const absl::string_view name : absl::StrSplit(rest.substr(0, held_at), '\n'))
    if (!name.empty()) out.inputs.emplace_back(name);
  if (held_at != std::string::npos)
    for (const absl::string_view name : absl::StrSplit(rest.substr(held_at + kHeldTag.size()), '\n'))
      if (!name.empty()) out.held.emplace_back(name);
  return out;
}

bool SameFile(const std::string& a, const std::string& b) {
  auto x = IdentifyFile(a), y = IdentifyFile(b);
  return x.ok() && y.ok() && x->dev == y->dev && x->ino == y->ino;
}

// The output's pair found in the input directory is left out only when a merge wrote it (its sidecar
// records a ptk-merge source): a dataset ptk-tokenize or Megatron wrote there is one of the inputs, and
// merging the others into its name would replace it.
absl::Status CheckOwnPairIsAMerge(const std::string& dir, const std::string& own, const std::string& output_prefix) {
  const std::string in_dir = JoinPath(dir, own);
  if (!PathExists(BinPath(in_dir)) && !PathExists(IdxPath(in_dir))) return absl::OkStatus();
  const std::optional<std::string> source = RecordedSource(in_dir);
  if (source && (source->empty() || source->rfind("ptk-merge", 0) == 0)) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format(
      "output prefix {} is a dataset of the input directory {} that no merge wrote ({}): merging the others into "
      "it would replace one of the inputs; name an output outside {} or a new one",
      output_prefix, dir,
      source ? fmt::format("its {} records {}", Basename(DoneSidecarPath(in_dir)), source->substr(0, source->find(' ')))
             : fmt::format("no {} beside it", Basename(DoneSidecarPath(in_dir))),
      dir));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> FindPrefixesInDir(const std::string& dir, const std::string& output_prefix) {
  // The output's name when it lies in `dir` (compared by the directory's identity, not its spelling).
  const std::string own =
      !output_prefix.empty() && SameFile(dir, Dirname(output_prefix)) ? Basename(output_prefix) : std::string();
  DIR* d = ::opendir(dir.c_str());
  if (!d) return ErrnoToStatus(errno, fmt::format("cannot list {}", dir));
  std::set<std::string> bins, idxs;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    std::string full = JoinPath(dir, name);
    if (IsDirectory(full)) continue;
    if (!own.empty() && (name == own + ".bin" || name == own + ".idx")) continue;
    auto ends = [&](std::string_view suf) {
      return name.size() > suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
    };
    if (ends(".bin"))
      bins.insert(name.substr(0, name.size() - 4));
    else if (ends(".idx"))
      idxs.insert(name.substr(0, name.size() - 4));
  }
  ::closedir(d);
  if (!own.empty()) PTK_RETURN_IF_ERROR(CheckOwnPairIsAMerge(dir, own, output_prefix));
  std::vector<std::string> out;
  for (const auto& b : bins) {
    if (!idxs.count(b))
      return absl::NotFoundError(fmt::format("{}: .idx file not provided for {}", dir, JoinPath(dir, b)));
    out.push_back(JoinPath(dir, b));
  }
  for (const auto& i : idxs)
    if (!bins.count(i))
      return absl::NotFoundError(fmt::format("{}: .bin file not provided for {}", dir, JoinPath(dir, i)));
  std::sort(out.begin(), out.end());
  if (out.empty()) return absl::NotFoundError(fmt::format("{}: no .bin/.idx pairs to merge", dir));
  return out;
}

absl::StatusOr<std::string> MergeSource(const std::vector<std::string>& inputs, bool multimodal) {
  std::string s = fmt::format("ptk-merge output v2\nmultimodal {}\n", multimodal);
  std::string names;  // listed after the hash, so that a later merge can tell what this one holds
  for (const auto& in : inputs) {
    std::error_code name_ec;
    const std::filesystem::path name = std::filesystem::absolute(in, name_ec);
    names += (names.empty() ? "" : "\n") + (name_ec ? in : name.lexically_normal().string());
    for (const std::string& f : {BinPath(in), IdxPath(in)}) {
      struct stat st {};
      if (::stat(f.c_str(), &st) != 0) return ErrnoToStatus(errno, fmt::format("cannot read {}", f));
      // By its absolute, normal name: parts/a, ./parts/a and /data/parts/a (or a rerun from another
      // directory) are one input, not a change that merges again.
      std::error_code ec;
      const std::filesystem::path abs = std::filesystem::absolute(f, ec);
      s += fmt::format("{}\t{}\t{}.{}\n", ec ? f : abs.lexically_normal().string(), st.st_size, st.st_mtim.tv_sec,
                       st.st_mtim.tv_nsec);
    }
    // An input ptk wrote: its sidecar (the content checksums of its .bin and .idx, what it was made
    // from) too, so that an input made again is seen even where its size and time stayed.
    auto side = ReadFileToString(DoneSidecarPath(in));
    s += side.ok() ? "sidecar " + Xxh3Hex(*side) + "\n" : "no sidecar\n";
  }
  // What the inputs hold, as their sidecars record it (fingerprinted above with the sidecars).
  std::set<std::string> held;
  for (const auto& in : inputs) {
    MergeRecord r = RecordedMerge(in);
    held.insert(r.inputs.begin(), r.inputs.end());
    held.insert(r.held.begin(), r.held.end());
  }
  std::string held_names;
  for (const std::string& h : held) held_names += (held_names.empty() ? "" : "\n") + h;
  return "ptk-merge " + Xxh3Hex(s) + std::string(kInputsTag) + names +
         (held_names.empty() ? "" : std::string(kHeldTag) + held_names);
}

namespace {

using FileKey = std::pair<uint64_t, uint64_t>;  // (dev, ino) of a dataset's .idx

// The identity of `prefix`'s .idx; none where it cannot be read (a dataset deleted since).
std::optional<FileKey> IdxKey(const std::string& prefix) {
  auto id = IdentifyFile(IdxPath(prefix));
  if (!id.ok()) return std::nullopt;
  return FileKey{id->dev, id->ino};
}

// A dataset a merge holds: its .idx's identity, its name, and the merge that listed it.
struct HeldDataset {
  FileKey key;
  std::string name;
  std::string via;
};

// Every dataset that `prefix`, a merge, holds, at any depth (a merge of a merge of a merge), each once,
// in the order the merges recorded them (not by identity: which dataset an error names must not depend
// on the inodes the filesystem gave): its inputs, followed, and what it recorded they held (which a
// merge deleted since can no longer say).
void CollectHeld(const std::string& prefix, std::set<FileKey>* seen, std::vector<HeldDataset>* held) {
  const MergeRecord record = RecordedMerge(prefix);
  for (const std::string& in : record.inputs) {
    const std::optional<FileKey> key = IdxKey(in);
    if (!key || !seen->insert(*key).second) continue;
    held->push_back({*key, in, prefix});
    CollectHeld(in, seen, held);  // each dataset followed once: a cycle of sidecars ends
  }
  for (const std::string& in : record.held)
    if (const std::optional<FileKey> key = IdxKey(in); key && seen->insert(*key).second)
      held->push_back({*key, in, prefix});
}

}  // namespace

absl::Status CheckNoInputHoldsAnother(const std::vector<std::string>& inputs) {
  std::map<FileKey, std::string> by_id;
  for (const auto& in : inputs)
    if (const std::optional<FileKey> key = IdxKey(in)) by_id.emplace(*key, in);
  // Which input holds each dataset (itself, or inside it): one held by two inputs would go in twice.
  std::map<FileKey, std::string> holder = by_id;
  for (const auto& in : inputs) {
    std::set<FileKey> seen;
    std::vector<HeldDataset> held;
    CollectHeld(in, &seen, &held);
    for (const HeldDataset& named : held) {
      auto [it, fresh] = holder.emplace(named.key, in);
      if (fresh || it->second == in) continue;
      const std::string via = named.via == in ? "" : fmt::format(" (through {})", named.via);
      if (by_id.count(named.key))
        return absl::FailedPreconditionError(
            fmt::format("{} is a merge of {}{}, which is also an input: merging both would put its documents in "
                        "twice; give one of them",
                        in, it->second, via));
      return absl::FailedPreconditionError(
          fmt::format("{} and {} both hold {}{}: merging both would put its documents in twice; give one of them",
                      it->second, in, named.name, via));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<MergeStats> MergeDatasets(const std::vector<std::string>& inputs, const std::string& output_prefix,
                                         bool multimodal, const std::string& source, bool progress,
                                         std::chrono::milliseconds lock_wait) {
  if (inputs.empty()) return absl::InvalidArgumentError("nothing to merge");
  for (const auto& in : inputs)
    if (in == output_prefix || SameFile(BinPath(in), BinPath(output_prefix)) ||
        SameFile(IdxPath(in), IdxPath(output_prefix)))
      return absl::InvalidArgumentError(
          in == output_prefix
              ? fmt::format("output prefix {} is also an input", output_prefix)
              : fmt::format("output prefix {} is also an input: the same files as {}", output_prefix, in));
  PTK_ASSIGN_OR_RETURN(auto first, IndexedDataset::Open(inputs[0], multimodal));
  PTK_ASSIGN_OR_RETURN(auto builder,
                       IndexedDatasetBuilder::Create(output_prefix, first->dtype(), multimodal, lock_wait));
  first.reset();
  builder->SetSource(source);
  // A merge of a pipeline's chunks copies hundreds of GB: it says how far it is (it was silent until done).
  uint64_t bin_total = 0;
  for (const auto& in : inputs)
    if (auto size = FileSize(BinPath(in)); size.ok()) bin_total += *size;
  ProgressReporter reporter({.label = "merge",
                             .item_unit = "datasets",
                             .items_total = inputs.size(),
                             .bytes_total = bin_total,
                             .enabled = progress});
  for (const auto& in : inputs) {
    const uint64_t before = builder->num_tokens();
    PTK_RETURN_IF_ERROR(builder->AddIndex(in));
    reporter.AddItems(1);
    reporter.AddBytes((builder->num_tokens() - before) * DTypeSize(builder->dtype()));
    reporter.Refresh();  // on a terminal the line says each dataset as it is done, not at the next redraw
  }
  reporter.Finish();
  MergeStats st{builder->num_documents(), builder->num_sequences(), builder->num_tokens(), builder->warnings()};
  if (progress && reporter.bytes() >= (uint64_t{1} << 30))  // a pass that takes a while (a line at every size is noise)
    log::Info("merge: {} datasets copied ({}) in {}; checksumming and syncing the output ...", inputs.size(),
              HumanBytes(reporter.bytes()), HumanDuration(reporter.ElapsedSeconds()));
  PTK_RETURN_IF_ERROR(builder->Finalize());
  return st;
}

}  // namespace ptk
