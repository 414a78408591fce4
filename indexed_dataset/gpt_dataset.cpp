// Megatron-LM's GPTDataset / BlendedDataset indices, samples and index cache.
#include "indexed_dataset/gpt_dataset.h"

#include <atomic>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <regex>
#include <set>
#include <thread>

#include <fmt/core.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/logging.h"
#include "common/status.h"
#include "indexed_dataset/numpy_random.h"

namespace ptk {

const char* SplitName(Split s) {
  switch (s) {
    case Split::kTrain: return "train";
    case Split::kValid: return "valid";
    case Split::kTest: return "test";
  }
  return "?";
}

// ---------------------------------------------------------------- split

absl::StatusOr<std::array<double, 3>> ParseAndNormalizeSplit(const std::string& split) {
  static const std::regex re("[.0-9]+");
  std::vector<double> v;
  for (auto it = std::sregex_iterator(split.begin(), split.end(), re); it != std::sregex_iterator(); ++it) {
    // Each match whole, as Python's float() reads it: "98.2.0" (dots for commas) is no number,
    // where std::stod would read 98.2 and train on everything.
    const std::string part = it->str();
    size_t used = 0;
    double x = 0;
    try {
      x = std::stod(part, &used);
    } catch (...) {
    }
    if (used != part.size())
      return UsageError(
          fmt::format("--split {:?}: {:?} is not a number; give the train, valid and test proportions, "
                      "such as 969,30,1",
                      split, part));
    // The regex takes no sign: Megatron would read -1 as 1. A minus sign before a number (not a
    // dash between two numbers, 98-2-0) is a negative proportion.
    const size_t at = static_cast<size_t>(it->position());
    if (at > 0 && split[at - 1] == '-' &&
        (at == 1 || !(std::isdigit(static_cast<unsigned char>(split[at - 2])) || split[at - 2] == '.')))
      return UsageError(fmt::format("--split {:?}: -{} is negative; the proportions are numbers >= 0", split, part));
    v.push_back(x);
  }
  if (v.empty())
    return UsageError(fmt::format(
        "--split {:?} holds no number: give the train, valid and test proportions, such as 969,30,1", split));
  if (v.size() > 3) return UsageError(fmt::format("--split {:?} has more than three parts", split));
  while (v.size() < 3) v.push_back(0.0);
  double sum = py::NumpySum(v.data(), v.size());
  if (!(sum > 0)) return UsageError(fmt::format("--split {:?} sums to zero", split));
  auto n = py::NumpyNormalize(v);
  return std::array<double, 3>{n[0], n[1], n[2]};
}

SplitMatrix MakeSplitMatrix(const std::array<double, 3>& v) {
  // expansion = [0, 0 + v0, (0 + v0) + v1, ...] in Python float arithmetic
  double e[4];
  e[0] = 0;
  for (int i = 0; i < 3; ++i) e[i + 1] = e[i] + v[i];
  SplitMatrix m;
  for (int i = 0; i < 3; ++i) {
    if (std::min(e[i + 1], e[i + 1]) <= std::max(e[i], e[i]))
      m.bookends[i] = std::nullopt;
    else
      m.bookends[i] = std::make_pair(e[i], e[i + 1]);
  }
  return m;
}

py::Json SplitMatrix::ToJson() const {
  py::Json::Array a;
  for (int i = 0; i < 3; ++i) {
    if (!bookends[i]) {
      a.push_back(py::Json());
      continue;
    }
    // The first lower bound is Python's int 0 from the expansion's seed.
    py::Json lo = i == 0 ? py::Json(int64_t{0}) : py::Json(bookends[i]->first);
    a.push_back(py::Json(py::Json::Array{lo, py::Json(bookends[i]->second)}));
  }
  return py::Json(a);
}

py::Json Gpt2TokenizerIdentifiers(const std::string& vocab_file, const std::string& merge_file) {
  return py::Json(py::Json::Object{
      {"class", "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText"},
      {"tokenizer_path", "GPT2BPETokenizer"},
      {"additional_special_tokens", "[]"},
      {"vocab_file", vocab_file},
      {"merges_file", merge_file},
      {"use_fast", "True"},
      {"trust_remote_code", "False"},
      {"include_special_tokens", "True"},
  });
}

// ---------------------------------------------------------------- samples

absl::Status TopLevelDataset::Get(int64_t idx, GPTSample* s) const {
  const int64_t seq = config_.sequence_length;
  const int64_t add = config_.add_extra_token_to_sequence ? 1 : 0;
  std::vector<int64_t> text(static_cast<size_t>(seq + add));
  PTK_RETURN_IF_ERROR(Text(idx, text.data(), &s->dataset_id));
  if (add) {
    s->tokens.assign(text.begin(), text.end() - 1);
    s->labels.assign(text.begin() + 1, text.end());
  } else {
    s->tokens = text;
    s->labels.assign(text.begin() + 1, text.end());
    s->labels.push_back(config_.pad);
  }
  const size_t n = s->tokens.size();
  s->loss_mask.assign(n, 1.0f);
  s->position_ids.resize(n);
  for (size_t i = 0; i < n; ++i) s->position_ids[i] = static_cast<int64_t>(i);
  if (config_.eod_mask_loss)
    for (size_t i = 0; i < n; ++i)
      if (s->tokens[i] == config_.eod) s->loss_mask[i] = 0.0f;
  if (config_.reset_position_ids) {
    int64_t prev = 0;
    for (size_t i = 0; i < n; ++i) {
      if (s->tokens[i] != config_.eod) continue;
      for (size_t k = i + 1; k < n; ++k) s->position_ids[k] -= static_cast<int64_t>(i) + 1 - prev;
      prev = static_cast<int64_t>(i) + 1;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (s->labels[i] == config_.pad) s->loss_mask[i] = 0.0f;
    if (s->tokens[i] == config_.pad) s->tokens[i] = 0;
    if (s->labels[i] == config_.pad) s->labels[i] = 0;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- GPTDataset

absl::StatusOr<std::shared_ptr<GPTDataset>> GPTDataset::Build(std::shared_ptr<IndexedDataset> dataset,
                                                              const std::string& dataset_path, int64_t beg, int64_t end,
                                                              std::optional<int64_t> num_samples, Split split,
                                                              const GPTDatasetConfig& config) {
  if (config.sequence_length < 2) return UsageError("--seq-length must be at least 2");
  auto ds = std::shared_ptr<GPTDataset>(new GPTDataset());
  ds->dataset_ = std::move(dataset);
  ds->beg_ = beg;
  ds->end_ = end;
  ds->split_ = split;
  ds->config_ = config;
  const char* cls = config.fim ? "GPTFIMDataset" : "GPTDataset";
  if (config.fim) ds->fim_.reset(new FimState{{}, FimTransform(*config.fim, config.random_seed)});
  py::Json::Object id = {
      {"class", cls},
      {"dataset_path", dataset_path},
      {"num_samples", num_samples ? py::Json(*num_samples) : py::Json()},
      {"index_split", SplitName(split)},
      {"random_seed", py::Json(static_cast<int64_t>(config.random_seed))},
      {"sequence_length", py::Json(config.sequence_length)},
      {"split", config.split ? py::Json(*config.split) : py::Json()},
      {"split_matrix", config.split_matrix ? config.split_matrix->ToJson() : py::Json()},
      {"tokenizer", config.tokenizer},
  };
  ds->identifiers_ = py::Json(id);
  ds->description_ = ds->identifiers_.Dumps(4);
  ds->hash_ = Md5Hex(ds->description_);
  const std::string dir =
      config.path_to_cache ? *config.path_to_cache : JoinPath(JoinPath(dataset_path, "cache"), "GPTDataset_indices");
  ds->cache_prefix_ = JoinPath(dir, fmt::format("{}-{}-{}-", ds->hash_, cls, SplitName(split)));
  if (ds->TryLoadCache(num_samples)) {
    ds->from_cache_ = true;
    return ds;
  }
  bool save = config.write_cache;
  if (save) {
    absl::Status st = MakeDirs(dir);
    if (!st.ok()) {
      PTK_RETURN_IF_ERROR(IndexCacheNotSaved("GPTDataset", dir, config, st));
      save = false;
    }
  }
  PTK_RETURN_IF_ERROR(ds->BuildIndices(num_samples, save));
  return ds;
}

void WarnIndexCacheNotSaved(const char* what, const std::string& dir, const GPTDatasetConfig& config,
                            const absl::Status& why) {
  static std::mutex mu;
  static std::set<std::string> warned;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!warned.insert(dir).second) return;
  }
  log::Warning(
      "{} {}: cannot save the {} index cache there ({}); the run is unaffected (its indices are built in memory, "
      "the same), but every run will build them again: give --data-cache-path a directory this process can write",
      config.path_to_cache ? "--data-cache-path" : "the data's cache directory", dir, what, StatusMessage(why));
}

absl::Status IndexCacheNotSaved(const char* what, const std::string& dir, const GPTDatasetConfig& config,
                                const absl::Status& why) {
  if (config.cache_write_required)
    return Annotate(why, fmt::format("{}: cannot save the {} index cache there", dir, what));
  WarnIndexCacheNotSaved(what, dir, config, why);
  return absl::OkStatus();
}

namespace {

// The cached arrays against the split [beg, end) of `data` as it is now, entry by entry: every
// document index entry one of the split's documents, every sample row at an offset inside its
// document and spanning `seq` tokens from the row before it (fewer only up to the last token), every
// shuffle entry a row. A cache whose counts happen to match data that changed (documents that grew or
// shrank) fails here rather than mid-run, at a sample too long or, padded, silently too short.
// O(documents + samples) when `whole`; else (data no newer than the cache) the first documents and
// a few rows only, and the shuffle entries. "" when all agree, else the first disagreement.
std::string CachedIndicesDisagree(const IndexedDataset& data, int64_t beg, int64_t end, int64_t seq, int64_t add,
                                  const IndexArray& d, const IndexArray& s, const IndexArray& h, bool whole) {
  const int64_t nd = d.size(), ns = s.shape()[0] - 1;
  for (int64_t k = 0; k < (whole ? nd : std::min<int64_t>(nd, 16)); ++k)
    if (d.at(k) < beg || d.at(k) >= end)
      return fmt::format("document_index[{}] = {} is not a document of this split [{}, {})", k, d.at(k), beg, end);
  auto length = [&](int64_t at) { return static_cast<int64_t>(data.sequence_length(d.at(at))); };
  const int64_t last_offset = nd > 0 ? length(nd - 1) - add : 0;
  const std::set<int64_t> spot = {0, std::min<int64_t>(1, ns), ns / 2, ns};
  for (int64_t r = 0; r <= ns; r = whole ? r + 1 : (r < ns ? *spot.upper_bound(r) : ns + 1)) {
    const int64_t at = s.at(2 * r), offset = s.at(2 * r + 1);
    if (nd == 0 && at == 0 && offset == 0) continue;
    if (at < 0 || at >= nd) return fmt::format("sample_index row {} points outside document_index", r);
    if (offset < -1 || offset > length(at))
      return fmt::format("sample_index row {} points at offset {} of sequence {}, which holds {} tokens", r, offset,
                         d.at(at), length(at));
    if (r == 0) continue;
    const int64_t at0 = s.at(2 * r - 2), offset0 = s.at(2 * r - 1);
    if (at < at0) return fmt::format("sample_index row {} goes back to an earlier document", r);
    int64_t tokens = offset - offset0;
    for (int64_t i = at0; i < at; ++i) tokens += length(i);
    if (tokens > seq || (tokens < seq && !(at == nd - 1 && offset == last_offset)))
      return fmt::format("sample {} spans {} tokens of the documents as they are now, not the sequence length {}",
                         r - 1, tokens, seq);
  }
  for (int64_t i = 0; i < h.size(); ++i)
    if (h.at(i) < 0 || h.at(i) >= ns) return fmt::format("shuffle_index[{}] = {} is not a sample", i, h.at(i));
  return "";
}

// Whether PREFIX.idx or PREFIX.bin was modified at or after `file` (whose absence counts as older).
bool DataNewerThan(const std::string& prefix, const std::string& file) {
  std::error_code ec;
  const auto cache = std::filesystem::last_write_time(file, ec);
  if (ec) return true;
  for (const char* ext : {".idx", ".bin"}) {
    const auto t = std::filesystem::last_write_time(prefix + ext, ec);
    if (ec || t >= cache) return true;
  }
  return false;
}

}  // namespace

// A cache is used when all four files are there, the description is ours, the arrays have the
// shapes and types Megatron writes and the lengths this split of the dataset as it is now gives them;
// anything else is rebuilt (with a warning when files exist). The description names the dataset by its
// path only (Megatron's), so a dataset rewritten at that path (tokenized again, merged into) finds the
// indices of its former contents: their lengths, or rows that no longer span a sample of its documents, tell.
bool GPTDataset::TryLoadCache(std::optional<int64_t> num_samples) {
  const std::string desc = cache_prefix_ + "description.txt";
  const bool any = PathExists(desc) || PathExists(cache_prefix_ + "document_index.npy") ||
                   PathExists(cache_prefix_ + "sample_index.npy") || PathExists(cache_prefix_ + "shuffle_index.npy");
  if (!any) return false;
  auto fail = [&](const std::string& why) {
    log::Warning("ignoring the index cache {}*: {}; rebuilding it", cache_prefix_, why);
    return false;
  };
  auto text = ReadFileToString(desc);
  if (!text.ok()) return fail("no description.txt");
  if (*text != description_) return fail("description.txt differs");
  auto d = IndexArray::Load(cache_prefix_ + "document_index.npy");
  auto s = IndexArray::Load(cache_prefix_ + "sample_index.npy");
  auto h = IndexArray::Load(cache_prefix_ + "shuffle_index.npy");
  if (!d.ok()) return fail(std::string(StatusMessage(d.status())));
  if (!s.ok()) return fail(std::string(StatusMessage(s.status())));
  if (!h.ok()) return fail(std::string(StatusMessage(h.status())));
  if (d->type() != NpyType::kInt32 || d->shape().size() != 1) return fail("document_index is not 1-D int32");
  if (s->shape().size() != 2 || s->shape()[1] != 2 || s->shape()[0] < 1 ||
      (s->type() != NpyType::kInt32 && s->type() != NpyType::kInt64))
    return fail("sample_index is not an [N, 2] int32/int64 array");
  if (h->shape().size() != 1 || h->shape()[0] != s->shape()[0] - 1 ||
      (h->type() != NpyType::kUInt32 && h->type() != NpyType::kInt64))
    return fail("shuffle_index does not match sample_index");
  // No plan (an empty split asked for samples): the build reports why.
  auto want = ExpectedIndexShapes(num_samples);
  if (!want.ok()) return false;
  const int64_t nd = d->size(), ns = s->shape()[0] - 1;
  if (nd != want->documents || ns != want->samples)
    return fail(fmt::format(
        "it holds {} documents and {} samples, where sequences [{}, {}) of {} as they are now give {} and {}: it was "
        "built from another dataset at this path (tokenized again, or merged into?)",
        nd, ns, beg_, end_, dataset_->prefix(), want->documents, want->samples));
  // Every row is checked when the data is newer than the cache (rewritten at this path since: as many
  // documents and tokens are not the same documents); else spot checks. The whole check costs about a
  // cache build (seconds at 10 B tokens), at every start. One sequential scan of arrays mapped for the
  // run's random reads: read ahead during it (a page fault at a time on a network file system).
  const bool whole = DataNewerThan(dataset_->prefix(), desc);
  for (const IndexArray* a : {&*d, &*s, &*h}) a->Advise(MappedFile::Advice::kSequential);
  const std::string disagree = CachedIndicesDisagree(*dataset_, beg_, end_, config_.sequence_length,
                                                     config_.add_extra_token_to_sequence ? 1 : 0, *d, *s, *h, whole);
  for (const IndexArray* a : {&*d, &*s, &*h}) a->Advise(MappedFile::Advice::kRandom);
  if (!disagree.empty())
    return fail(
        fmt::format("{}: it was built from another dataset at this path (tokenized again, or merged into?)", disagree));
  document_index_ = std::move(*d);
  sample_index_ = std::move(*s);
  shuffle_index_ = std::move(*h);
  num_epochs_ = want->epochs;
  return true;
}

absl::Status GPTDataset::Text(int64_t idx, int64_t* out, int64_t* dataset_id) const {
  if (idx < 0 || idx >= size())
    return absl::OutOfRangeError(fmt::format("sample {} out of range [0, {})", idx, size()));
  if (dataset_id) *dataset_id = 0;
  const int64_t add = config_.add_extra_token_to_sequence ? 1 : 0;
  const int64_t want = config_.sequence_length + add;
  const int64_t j = shuffle_index_.at(idx);
  const int64_t d0 = sample_index_.at(2 * j), o0 = sample_index_.at(2 * j + 1);
  const int64_t d1 = sample_index_.at(2 * j + 2), o1 = sample_index_.at(2 * j + 3);
  int64_t n = 0;
  auto append = [&](int64_t seq_id, int64_t offset, int64_t length) -> absl::Status {
    PTK_ASSIGN_OR_RETURN(TokenSpan span, dataset_->Get(seq_id, offset, length));
    if (n + span.size > want) return absl::DataLossError(fmt::format("sample {} is longer than {} tokens", idx, want));
    if (span.dtype == DType::kUInt16) {
      const uint16_t* p = span.As<uint16_t>().data();
      for (int64_t i = 0; i < span.size; ++i) out[n + i] = p[i];
    } else {
      for (int64_t i = 0; i < span.size; ++i) out[n + i] = span[i];
    }
    n += span.size;
    return absl::OkStatus();
  };
  if (d0 == d1) {
    PTK_RETURN_IF_ERROR(append(document_index_.at(d0), o0, o1 - o0 + add));
  } else {
    for (int64_t i = d0; i <= d1; ++i) {
      const int64_t seq_id = document_index_.at(i);
      const int64_t offset = i > d0 ? 0 : o0;
      const int64_t length = i < d1 ? -1 : o1 + add;
      PTK_RETURN_IF_ERROR(append(seq_id, offset, length));
    }
  }
  if (fim_) {  // Megatron's GPTFIMDataset rewrites the parts it read (no padding), its length kept
    std::vector<int64_t> sample(out, out + n);
    {
      std::lock_guard<std::mutex> lock(fim_->mu);
      PTK_RETURN_IF_ERROR(fim_->transform.Apply(&sample));
    }
    std::copy(sample.begin(), sample.end(), out);
  }
  for (; n < want; ++n) out[n] = config_.pad;
  return absl::OkStatus();
}

}  // namespace ptk
