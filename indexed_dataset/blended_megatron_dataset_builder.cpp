// BlendedMegatronDatasetBuilder: Megatron's data arguments -> one top-level dataset per split.
#include "indexed_dataset/blended_megatron_dataset_builder.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <map>
#include <string_view>

#include <fmt/core.h>

#include "absl/strings/ascii.h"
#include "common/status.h"

namespace ptk {
namespace {

// A data path weight: the whole string a decimal number (leading white space and a sign allowed,
// inf and nan too, as strtod reads them), or nullopt; a value out of double's range is no weight.
std::optional<double> ParseWeight(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  if (s.size() > 1 && s.front() == '+' && s[1] != '-' && s[1] != '+') s.remove_prefix(1);  // from_chars takes no '+'
  double x = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return x;
}

}  // namespace

absl::Status ParseBlend(const std::vector<std::string>& list, std::vector<std::string>* prefixes,
                        std::optional<std::vector<double>>* weights) {
  prefixes->clear();
  weights->reset();
  if (list.empty()) return absl::OkStatus();
  auto strip = [](const std::string& s) { return std::string(absl::StripAsciiWhitespace(s)); };  // str.strip()
  if (list.size() % 2 == 0) {
    std::vector<double> w;
    bool all_numbers = true;
    for (size_t i = 0; i < list.size(); i += 2) {
      if (std::optional<double> x = ParseWeight(list[i])) {
        w.push_back(*x);
      } else {
        all_numbers = false;
      }
    }
    if (all_numbers) {
      double sum = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        if (!std::isfinite(w[k]) || w[k] < 0)
          return UsageError(fmt::format("data path weight {:?} (of {}) must be a finite number >= 0", list[2 * k],
                                        strip(list[2 * k + 1])));
        sum += w[k];
      }
      if (!(sum > 0)) return UsageError("every data path weight is 0: give at least one dataset a weight > 0");
      // Megatron's BlendedDataset asserts every weight > 0 (it was refused later here, exit 1, naming
      // no dataset).
      for (size_t k = 0; k < w.size(); ++k)
        if (w[k] == 0)
          return UsageError(
              fmt::format("data path weight {:?} (of {}) is 0: a blended dataset takes weights > 0; "
                          "leave the dataset out instead",
                          list[2 * k], strip(list[2 * k + 1])));
      for (size_t i = 1; i < list.size(); i += 2) prefixes->push_back(strip(list[i]));
      *weights = w;
      return absl::OkStatus();
    }
    if (!w.empty())
      return absl::InvalidArgumentError("data paths mix weights and prefixes: give a weight for every prefix or none");
  }
  for (const auto& p : list) prefixes->push_back(strip(p));
  return absl::OkStatus();
}

namespace {

// ceil(ceil(size * w) * (1 + surplus)) in Python float arithmetic.
int64_t BufferSize(int64_t size, double w, double surplus) {
  double target = std::ceil(static_cast<double>(size) * w);
  return static_cast<int64_t>(std::ceil(target * (1.0 + surplus)));
}
int64_t TargetSize(int64_t size, double w) { return static_cast<int64_t>(std::ceil(static_cast<double>(size) * w)); }

class Builder {
 public:
  Builder(const GPTDatasetConfig& c, std::vector<std::string>* warnings) : config_(c), warnings_(warnings) {}

  absl::StatusOr<std::shared_ptr<IndexedDataset>> Open(const std::string& prefix) {
    auto it = open_.find(prefix);
    if (it != open_.end()) return it->second;
    PTK_ASSIGN_OR_RETURN(auto ds, IndexedDataset::Open(prefix));
    // Open() checks that every sequence lies inside the .bin; bytes beyond what the index describes
    // are read past, as Megatron reads them, with a warning (another dataset's .idx beside the .bin
    // would show there).
    if (warnings_)
      for (std::string w : {ds->IdxTrailingBytesWarning(), ds->BinTrailingBytesWarning()})
        if (!w.empty()) warnings_->push_back(std::move(w));
    std::shared_ptr<IndexedDataset> sp(std::move(ds));
    open_[prefix] = sp;
    return sp;
  }

  // _build_megatron_dataset_splits: one GPTDataset per split whose bookend is not None.
  absl::StatusOr<std::array<std::shared_ptr<GPTDataset>, 3>> Splits(
      const std::string& prefix, const SplitMatrix& split, const std::array<std::optional<int64_t>, 3>& sizes) {
    PTK_ASSIGN_OR_RETURN(auto low, Open(prefix));
    const double n = static_cast<double>(low->num_sequences());
    std::array<std::shared_ptr<GPTDataset>, 3> out;
    for (int i = 0; i < 3; ++i) {
      if (!split.bookends[i]) continue;
      const int64_t beg = py::RoundHalfEven(split.bookends[i]->first * n);
      const int64_t end = py::RoundHalfEven(split.bookends[i]->second * n);
      PTK_ASSIGN_OR_RETURN(out[i], GPTDataset::Build(low, prefix, beg, end, sizes[i], static_cast<Split>(i), config_));
    }
    return out;
  }

 private:
  GPTDatasetConfig config_;
  std::vector<std::string>* warnings_;
  std::map<std::string, std::shared_ptr<IndexedDataset>> open_;
};

}  // namespace

namespace {
// An unweighted blend: each dataset weighted by its length (Megatron's exhaustive blend), the
// requested size capped at the total.
absl::StatusOr<std::shared_ptr<BlendedDataset>> BlendByLengths(const std::vector<std::shared_ptr<GPTDataset>>& parts,
                                                               std::optional<int64_t> requested, Split split,
                                                               const GPTDatasetConfig& config) {
  std::vector<double> lens;
  int64_t total = 0;
  for (const auto& p : parts) {
    lens.push_back(static_cast<double>(p->size()));
    total += p->size();
  }
  std::optional<int64_t> size;
  if (requested) size = std::min(*requested, total);
  return BlendedDataset::Build(parts, lens, true, size, split, config);
}

absl::StatusOr<std::array<std::shared_ptr<TopLevelDataset>, 3>> BuildPerSplit(
    const DataArgs& args, GPTDatasetConfig config, std::vector<std::string>* warnings,
    std::vector<std::shared_ptr<TopLevelDataset>>* validation_sets);

absl::StatusOr<std::array<std::shared_ptr<TopLevelDataset>, 3>> BuildSplitDatasets(
    const DataArgs& args, GPTDatasetConfig config, std::vector<std::string>* warnings,
    std::vector<std::shared_ptr<TopLevelDataset>>* validation_sets) {
  std::array<std::shared_ptr<TopLevelDataset>, 3> result;
  const bool per_split = !args.per_split_data_path[0].empty() || !args.per_split_data_path[1].empty() ||
                         !args.per_split_data_path[2].empty();
  if (per_split && !args.data_path.empty())
    return UsageError("--data-path and --train/valid/test-data-path are incompatible");
  if (!per_split && args.data_path.empty())
    return absl::InvalidArgumentError("no data: give --data-path or --train-data-path");

  if (!per_split) {
    PTK_ASSIGN_OR_RETURN(auto vec, ParseAndNormalizeSplit(args.split));
    config.split = args.split;
    config.split_matrix = MakeSplitMatrix(vec);
    Builder b(config, warnings);
    std::vector<std::string> prefixes;
    std::optional<std::vector<double>> weights;
    PTK_RETURN_IF_ERROR(ParseBlend(args.data_path, &prefixes, &weights));
    const SplitMatrix& split = *config.split_matrix;
    if (prefixes.size() == 1 && !weights) {
      PTK_ASSIGN_OR_RETURN(auto ds, b.Splits(prefixes[0], split, args.sizes));
      for (int i = 0; i < 3; ++i) result[i] = ds[i];
      return result;
    }
    if (weights) *weights = py::NumpyNormalize(*weights);
    std::vector<std::array<std::shared_ptr<GPTDataset>, 3>> mids;
    for (size_t k = 0; k < prefixes.size(); ++k) {
      std::array<std::optional<int64_t>, 3> buffer;
      for (int i = 0; i < 3; ++i)
        if (weights && args.sizes[i])
          buffer[i] = BufferSize(*args.sizes[i], (*weights)[k], config.mid_level_dataset_surplus);
      if (weights)
        for (int i = 0; i < 3; ++i)
          if (!args.sizes[i] && split.bookends[i])
            return absl::InvalidArgumentError("weighted blends need a sample count for every split");
      PTK_ASSIGN_OR_RETURN(auto ds, b.Splits(prefixes[k], split, buffer));
      mids.push_back(ds);
    }
    for (int i = 0; i < 3; ++i) {
      if (!split.bookends[i]) continue;
      std::vector<std::shared_ptr<GPTDataset>> parts;
      for (auto& m : mids) parts.push_back(m[i]);
      if (weights) {
        int64_t size = 0;
        for (size_t k = 0; k < prefixes.size(); ++k) size += TargetSize(*args.sizes[i], (*weights)[k]);
        PTK_ASSIGN_OR_RETURN(result[i],
                             BlendedDataset::Build(parts, *weights, false, size, static_cast<Split>(i), config));
      } else {
        PTK_ASSIGN_OR_RETURN(result[i], BlendByLengths(parts, args.sizes[i], static_cast<Split>(i), config));
      }
    }
    return result;
  }

  return BuildPerSplit(args, std::move(config), warnings, validation_sets);
}

// Per-split blends: each split is built from its own list with split (0, 1).
absl::StatusOr<std::array<std::shared_ptr<TopLevelDataset>, 3>> BuildPerSplit(
    const DataArgs& args, GPTDatasetConfig config, std::vector<std::string>* warnings,
    std::vector<std::shared_ptr<TopLevelDataset>>* validation_sets) {
  std::array<std::shared_ptr<TopLevelDataset>, 3> result;
  config.split = std::nullopt;
  config.split_matrix = std::nullopt;
  Builder b(config, warnings);
  for (int i = 0; i < 3; ++i) {
    if (args.per_split_data_path[i].empty()) continue;
    std::vector<std::string> prefixes;
    std::optional<std::vector<double>> weights;
    PTK_RETURN_IF_ERROR(ParseBlend(args.per_split_data_path[i], &prefixes, &weights));
    SplitMatrix spoof;
    spoof.bookends[i] = std::make_pair(0.0, 1.0);
    std::array<std::optional<int64_t>, 3> sizes_spoof{int64_t{0}, int64_t{0}, int64_t{0}};
    sizes_spoof[i] = args.sizes[i];
    if (weights) *weights = py::NumpyNormalize(*weights);
    if (prefixes.size() == 1) {
      PTK_ASSIGN_OR_RETURN(auto ds, b.Splits(prefixes[0], spoof, sizes_spoof));
      result[i] = ds[i];
      continue;
    }
    if (args.multiple_validation_sets && i == 1) {  // each prefix alone, as a single prefix is built
      for (const std::string& prefix : prefixes) {
        PTK_ASSIGN_OR_RETURN(auto ds, b.Splits(prefix, spoof, sizes_spoof));
        validation_sets->push_back(ds[i]);
      }
      continue;
    }
    std::vector<std::shared_ptr<GPTDataset>> parts;
    for (size_t k = 0; k < prefixes.size(); ++k) {
      std::array<std::optional<int64_t>, 3> buffer;
      if (weights && sizes_spoof[i])
        buffer[i] = BufferSize(*sizes_spoof[i], (*weights)[k], config.mid_level_dataset_surplus);
      PTK_ASSIGN_OR_RETURN(auto ds, b.Splits(prefixes[k], spoof, buffer));
      parts.push_back(ds[i]);
    }
    if (weights && args.sizes[i]) {
      int64_t size = 0;
      for (size_t k = 0; k < prefixes.size(); ++k) size += TargetSize(*args.sizes[i], (*weights)[k]);
      PTK_ASSIGN_OR_RETURN(result[i],
                           BlendedDataset::Build(parts, *weights, false, size, static_cast<Split>(i), config));
    } else if (!weights) {
      PTK_ASSIGN_OR_RETURN(result[i], BlendByLengths(parts, args.sizes[i], static_cast<Split>(i), config));
    } else {
      return absl::InvalidArgumentError("weighted per-split blends need a sample count");
    }
  }
  return result;
}

}  // namespace

absl::StatusOr<std::array<std::shared_ptr<TopLevelDataset>, 3>> BuildGPTDatasets(
    const DataArgs& args, GPTDatasetConfig config, std::vector<std::string>* warnings,
    std::vector<std::shared_ptr<TopLevelDataset>>* validation_sets) {
  std::vector<std::shared_ptr<TopLevelDataset>> sets;
  PTK_ASSIGN_OR_RETURN(auto result, BuildSplitDatasets(args, std::move(config), warnings, &sets));
  if (sets.empty() && result[1]) sets.push_back(result[1]);
  if (!sets.empty()) result[1] = sets[0];
  if (validation_sets) *validation_sets = std::move(sets);
  return result;
}

namespace {
bool PerSplit(const DataArgs& args) {
  return !args.per_split_data_path[0].empty() || !args.per_split_data_path[1].empty() ||
         !args.per_split_data_path[2].empty();
}
}  // namespace

absl::Status CheckDataPaths(const DataArgs& args) {
  const std::vector<std::string>* lists[] = {&args.data_path, &args.per_split_data_path[0],
                                             &args.per_split_data_path[1], &args.per_split_data_path[2]};
  const char* flags[] = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"};
  for (int i = 0; i < 4; ++i) {
    std::vector<std::string> prefixes;
    std::optional<std::vector<double>> weights;
    PTK_RETURN_IF_ERROR(ParseBlend(*lists[i], &prefixes, &weights));
    for (const std::string& prefix : prefixes) {
      if (prefix.empty())
        return UsageError(fmt::format("{}: an empty dataset prefix (an unset shell variable?)", flags[i]));
      PTK_RETURN_IF_ERROR(ResolveDatasetPrefix(prefix, /*accept_file_names=*/false).status());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> NoValidationSplit(const DataArgs& args) {
  if (PerSplit(args)) return args.per_split_data_path[1].empty() ? "no --valid-data-path" : "";
  PTK_ASSIGN_OR_RETURN(const auto split, ParseAndNormalizeSplit(args.split));
  if (MakeSplitMatrix(split).bookends[1]) return std::string();
  if (!(split[1] > 0)) return fmt::format("--split {} gives it no part", args.split);
  // A part of its own that the bookends' double sums lose: 999999999999999999999,1,1 normalizes to
  // [1.0, 1e-21, 1e-21], and 1.0 + 1e-21 is 1.0.
  return fmt::format(
      "--split {} gives it {} of the data, too small beside the other parts for a double's sums: its range in the "
      "split matrix, [{}, {}), is empty (Megatron's too)",
      args.split, py::FloatRepr(split[1]), py::FloatRepr(split[0]), py::FloatRepr(split[0] + split[1]));
}

}  // namespace ptk
