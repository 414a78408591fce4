// Megatron-LM's BlendedDataset: blending indices (weighted or exhaustive), samples, index cache.
#include "indexed_dataset/blended_dataset.h"

#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/logging.h"
#include "common/status.h"

namespace ptk {

namespace {

// helpers.cpp's build_blending_indices: `size` samples, each from the dataset furthest behind its
// (normalized) weight. Adds each dataset's sample count to `counts`.
void BuildBlendingIndices(const std::vector<double>& weights, int64_t size, IndexArray* dataset_index,
                          IndexArray* dataset_sample_index, std::vector<int64_t>& counts) {
  const size_t nd = weights.size();
  *dataset_index = IndexArray::Owned(NpyType::kInt16, {size});
  *dataset_sample_index = IndexArray::Owned(NpyType::kInt64, {size});
  int16_t* di = dataset_index->As<int16_t>();
  int64_t* dsi = dataset_sample_index->As<int64_t>();
  for (int64_t s = 0; s < size; ++s) {
    const double x = std::max(static_cast<double>(s), 1.0);
    size_t best = 0;
    double best_err = weights[0] * x - static_cast<double>(counts[0]);
    for (size_t d = 1; d < nd; ++d) {
      double err = weights[d] * x - static_cast<double>(counts[d]);
      if (err > best_err) {
        best_err = err;
        best = d;
      }
    }
    di[s] = static_cast<int16_t>(best);
    dsi[s] = counts[best]++;
  }
}

// helpers.cpp's build_exhaustive_blending_indices: exactly sizes[d] (the integer weights) samples of
// dataset d.
void BuildExhaustiveBlendingIndices(const std::vector<double>& weights, IndexArray* dataset_index,
                                    IndexArray* dataset_sample_index, std::vector<int64_t>& counts) {
  const size_t nd = weights.size();
  int64_t total = 0;
  std::vector<int64_t> sizes(nd);
  for (size_t d = 0; d < nd; ++d) total += sizes[d] = static_cast<int64_t>(weights[d]);
  std::vector<double> w(nd);
  for (size_t d = 0; d < nd; ++d) w[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
  *dataset_index = IndexArray::Owned(NpyType::kInt16, {total});
  *dataset_sample_index = IndexArray::Owned(NpyType::kInt64, {total});
  int16_t* di = dataset_index->As<int16_t>();
  int64_t* dsi = dataset_sample_index->As<int64_t>();
  std::vector<bool> unspent(nd, true);
  size_t left = nd;
  for (size_t d = 0; d < nd; ++d)
    if (sizes[d] == 0) {
      unspent[d] = false;
      --left;
    }
  int64_t s = 0;
  while (left > 0) {
    const double x = std::max(static_cast<double>(s), 1.0);
    int64_t best = -1;
    double best_err = std::numeric_limits<double>::lowest();
    for (size_t d = 0; d < nd; ++d) {
      if (!unspent[d]) continue;
      double err = w[d] * x - static_cast<double>(counts[d]);
      if (err > best_err) {
        best = static_cast<int64_t>(d);
        best_err = err;
      }
    }
    di[s] = static_cast<int16_t>(best);
    dsi[s] = counts[best]++;
    if (static_cast<double>(sizes[best]) - static_cast<double>(counts[best]) == 0) {
      unspent[best] = false;
      --left;
    }
    ++s;
  }
}

// Why the cached blend does not fit `datasets` ("" when it does): every entry a dataset of the blend
// and a sample of it (a damaged entry would read past the datasets or fail mid-run), `size` of them
// when the blend has one.
std::string BlendCacheDisagrees(const std::vector<std::shared_ptr<GPTDataset>>& datasets, std::optional<int64_t> size,
                                const IndexArray& dataset_index, const IndexArray& dataset_sample_index) {
  if (size && dataset_index.size() != *size)
    return fmt::format("it holds {} samples, the blend {}", dataset_index.size(), *size);
  const int64_t n = static_cast<int64_t>(datasets.size());
  for (int64_t i = 0; i < dataset_index.size(); ++i) {
    const int64_t d = dataset_index.at(i), k = dataset_sample_index.at(i);
    if (d < 0 || d >= n) return fmt::format("dataset_index[{}] = {} is not one of its {} datasets", i, d, n);
    if (k < 0 || k >= datasets[static_cast<size_t>(d)]->size())
      return fmt::format("dataset_sample_index[{}] = {} is not a sample of dataset {} ({} samples)", i, k, d,
                         datasets[static_cast<size_t>(d)]->size());
  }
  return "";
}

// The cached indices under `prefix` when they are there, whole, of this description and fitting
// `datasets`; a warning when some are there but not usable (they are rebuilt).
bool LoadBlendCache(const std::string& prefix, const std::string& description,
                    const std::vector<std::shared_ptr<GPTDataset>>& datasets, std::optional<int64_t> size,
                    IndexArray* dataset_index, IndexArray* dataset_sample_index) {
  if (!PathExists(prefix + "description.txt") && !PathExists(prefix + "dataset_index.npy") &&
      !PathExists(prefix + "dataset_sample_index.npy"))
    return false;
  auto text = ReadFileToString(prefix + "description.txt");
  auto di = IndexArray::Load(prefix + "dataset_index.npy");
  auto dsi = IndexArray::Load(prefix + "dataset_sample_index.npy");
  if (text.ok() && *text == description && di.ok() && dsi.ok() && di->type() == NpyType::kInt16 &&
      dsi->type() == NpyType::kInt64 && di->shape().size() == 1 && dsi->shape() == di->shape()) {
    for (const IndexArray* a : {&*di, &*dsi}) a->Advise(MappedFile::Advice::kSequential);  // one scan (as GPTDataset's)
    const std::string why = BlendCacheDisagrees(datasets, size, *di, *dsi);
    for (const IndexArray* a : {&*di, &*dsi}) a->Advise(MappedFile::Advice::kRandom);
    if (!why.empty()) {
      log::Warning("ignoring the blend index cache {}*: {}; rebuilding it", prefix, why);
      return false;
    }
    *dataset_index = std::move(*di);
    *dataset_sample_index = std::move(*dsi);
    return true;
  }
  log::Warning("ignoring the blend index cache {}*: missing, corrupt or another description; rebuilding it", prefix);
  return false;
}

}  // namespace

absl::StatusOr<std::shared_ptr<BlendedDataset>> BlendedDataset::Build(std::vector<std::shared_ptr<GPTDataset>> datasets,
                                                                      std::vector<double> weights, bool integer_weights,
                                                                      std::optional<int64_t> size, Split split,
                                                                      const GPTDatasetConfig& config) {
  if (datasets.empty() || datasets.size() != weights.size())
    return absl::InvalidArgumentError("a blend needs one weight per dataset");
  if (datasets.size() >= 32767) return absl::InvalidArgumentError("a blend holds at most 32766 datasets");
  for (double w : weights)
    if (!(w > 0)) return absl::InvalidArgumentError("blend weights must be positive");
  auto b = std::shared_ptr<BlendedDataset>(new BlendedDataset());
  b->config_ = config;
  b->datasets_ = datasets;
  if (size) weights = py::NumpyNormalize(weights);
  py::Json::Array ds_ids, w_json;
  for (const auto& d : datasets) ds_ids.push_back(d->unique_identifiers());
  for (double w : weights) {
    if (integer_weights && !size) {
      w_json.emplace_back(static_cast<int64_t>(w));
    } else {
      w_json.emplace_back(w);
    }
  }
  b->identifiers_ = py::Json(py::Json::Object{
      {"class", "BlendedDataset"},
      {"datasets", py::Json(ds_ids)},
      {"split", SplitName(split)},
      {"weights", py::Json(w_json)},
      {"size", size ? py::Json(*size) : py::Json()},
  });
  b->description_ = b->identifiers_.Dumps(4);
  b->hash_ = Md5Hex(b->description_);
  std::string prefix;
  if (config.path_to_cache) {
    prefix = JoinPath(*config.path_to_cache, fmt::format("{}-BlendedDataset-{}-", b->hash_, SplitName(split)));
    if (LoadBlendCache(prefix, b->description_, datasets, size, &b->dataset_index_, &b->dataset_sample_index_)) {
      b->from_cache_ = true;
      return b;
    }
  }
  std::vector<int64_t> counts(datasets.size(), 0);
  if (size)
    BuildBlendingIndices(weights, *size, &b->dataset_index_, &b->dataset_sample_index_, counts);
  else
    BuildExhaustiveBlendingIndices(weights, &b->dataset_index_, &b->dataset_sample_index_, counts);
  for (size_t d = 0; d < datasets.size(); ++d)
    if (counts[d] > datasets[d]->size())
      return absl::FailedPreconditionError(fmt::format(
          "the {} blend asks dataset {} ({}) for {} samples but it has {}; increase --mid-level-dataset-surplus",
          SplitName(split), d, datasets[d]->cache_prefix(), counts[d], datasets[d]->size()));
  if (config.path_to_cache && config.write_cache) {
    absl::Status st = MakeDirs(*config.path_to_cache);
    if (st.ok()) st = WriteFileAtomic(prefix + "description.txt", b->description_, /*durable=*/false);
    if (st.ok()) st = b->dataset_index_.Save(prefix + "dataset_index.npy");
    if (st.ok()) st = b->dataset_sample_index_.Save(prefix + "dataset_sample_index.npy");
    if (!st.ok()) PTK_RETURN_IF_ERROR(IndexCacheNotSaved("BlendedDataset", *config.path_to_cache, config, st));
  }
  return b;
}

absl::Status BlendedDataset::Text(int64_t idx, int64_t* out, int64_t* dataset_id) const {
  if (idx < 0 || idx >= size())
    return absl::OutOfRangeError(fmt::format("sample {} out of range [0, {})", idx, size()));
  const int64_t d = dataset_index_.at(idx);
  if (dataset_id) *dataset_id = d;
  return datasets_[static_cast<size_t>(d)]->Text(dataset_sample_index_.at(idx), out, nullptr);
}

}  // namespace ptk
