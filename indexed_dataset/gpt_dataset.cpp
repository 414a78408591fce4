// Megatron-LM's GPTDataset / BlendedDataset indices, samples and index cache.
#include "indexed_dataset/gpt_dataset.h"

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <regex>
#include <thread>

#include <fmt/core.h>

#include "common/file_util.h"
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
    try {
      v.push_back(std::stod(it->str()));
    } catch (...) {
      return absl::InvalidArgumentError(fmt::format("--split {:?}: {:?} is not a number", split, it->str()));
    }
  }
  if (v.size() > 3) return absl::InvalidArgumentError(fmt::format("--split {:?} has more than three parts", split));
  while (v.size() < 3) v.push_back(0.0);
  double sum = py::NumpySum(v.data(), v.size());
  if (!(sum > 0)) return absl::InvalidArgumentError(fmt::format("--split {:?} sums to zero", split));
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

namespace {

absl::Status SaveDescription(const std::string& path, const std::string& text) {
  return WriteFileAtomic(path, text, /*unique_tmp=*/true, /*durable=*/false);
}

}  // namespace

absl::StatusOr<std::shared_ptr<GPTDataset>> GPTDataset::Build(std::shared_ptr<IndexedDataset> dataset,
                                                              const std::string& dataset_path, int64_t beg, int64_t end,
                                                              std::optional<int64_t> num_samples, Split split,
                                                              const GPTDatasetConfig& config) {
  if (config.sequence_length < 2) return absl::InvalidArgumentError("--seq-length must be at least 2");
  auto ds = std::shared_ptr<GPTDataset>(new GPTDataset());
  ds->dataset_ = std::move(dataset);
  ds->beg_ = beg;
  ds->end_ = end;
  ds->split_ = split;
  ds->config_ = config;
  py::Json::Object id = {
      {"class", "GPTDataset"},
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
  ds->cache_prefix_ = JoinPath(dir, fmt::format("{}-GPTDataset-{}-", ds->hash_, SplitName(split)));
  if (ds->TryLoadCache()) {
    ds->from_cache_ = true;
    return ds;
  }
  bool save = config.write_cache;
  if (save) {
    absl::Status st = MakeDirs(dir);
    if (!st.ok()) {
      log::Warning("cannot save the GPTDataset index cache ({}); continuing without it", StatusMessage(st));
      save = false;
    }
  }
  PTK_RETURN_IF_ERROR(ds->BuildIndices(num_samples, save));
  return ds;
}

// A cache is used when all four files are there, the description is ours and the arrays have the
// shapes and types Megatron writes; anything else is rebuilt (with a warning when files exist).
bool GPTDataset::TryLoadCache() {
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
  // Spot checks of the values: every sample row must point inside the document index.
  const int64_t nd = d->size(), ns = s->shape()[0];
  for (int64_t r : {int64_t{0}, ns / 2, ns - 1})
    if (s->at(2 * r) < 0 || s->at(2 * r) >= std::max<int64_t>(nd, 1))
      return fail("sample_index points outside document_index");
  for (int64_t k = 0; k < std::min<int64_t>(nd, 16); ++k)
    if (d->at(k) < beg_ || d->at(k) >= end_) return fail("document_index holds documents outside this split");
  document_index_ = std::move(*d);
  sample_index_ = std::move(*s);
  shuffle_index_ = std::move(*h);
  return true;
}

absl::Status GPTDataset::BuildIndices(std::optional<int64_t> num_samples, bool save) {
  const int64_t seq = config_.sequence_length;
  const int64_t add = config_.add_extra_token_to_sequence ? 1 : 0;
  const int64_t ndocs = end_ - beg_;
  int64_t tpe = 0;
  for (int64_t i = beg_; i < end_; ++i) tpe += dataset_->sequence_length(i);
  // _get_num_epochs
  int64_t epochs = 1;
  if (num_samples) {
    const int64_t requested = *num_samples * seq + add;
    if (tpe == 0 && requested > tpe)
      return absl::FailedPreconditionError(
          fmt::format("{}: the {} split holds no tokens ({} documents) but {} samples were requested; adjust --split "
                      "or the sample counts",
                      dataset_->prefix(), SplitName(split_), ndocs, *num_samples));
    if (tpe > 0) epochs = std::max<int64_t>(1, (requested + tpe - 1) / tpe);
  }
  bool separate = false;
  int64_t sans = 0;
  if (epochs > 1) {
    sans = ((epochs - 1) * tpe - add) / seq;
    const int64_t from_final = *num_samples - sans;
    const int64_t per_epoch = (tpe - add) / seq;
    if (from_final < 0 || from_final > per_epoch + 1)
      return absl::InternalError(
          fmt::format("inconsistent epoch arithmetic ({} samples from the final epoch)", from_final));
    separate = from_final < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }
  num_epochs_ = epochs;
  if (ndocs * epochs > std::numeric_limits<int32_t>::max() && ndocs > 0)
    return absl::ResourceExhaustedError("document index larger than int32");
  const bool drop_last = split_ != Split::kValid || config_.drop_last_partial_validation_sequence;
  int64_t ns;
  if (drop_last)
    ns = (epochs * tpe - add) / seq;
  else
    ns = static_cast<int64_t>(std::ceil(static_cast<float>(epochs * tpe - add) / static_cast<float>(seq)));
  if (ns < 0) ns = 0;
  const int64_t nd = ndocs * epochs;
  if (ns > 0 && nd == 0) return absl::InternalError("samples without documents");
  const int64_t total = ns;
  const int64_t first = separate ? sans : total;

  // How the work is laid out. The random draws depend only on the generator, never on the arrays,
  // so for large splits a second thread makes them all, in numpy's order (the document shuffle or
  // shuffles, then the shuffle-index shuffle or shuffles), handing the document draws to this
  // thread through a ring; it then shuffles and saves the shuffle index, and, once the document
  // index is final, fills the sample rows of a separate last epoch and saves the document index.
  // This thread applies the document swaps as they arrive, fills the other sample rows and saves
  // the sample index. Same draws, same swaps, same order: arrays identical to numpy's and to
  // helpers.cpp's.
  std::vector<uint64_t> doc_lengths;  // the document shuffles: [0, A) and, when separate, [A, nd)
  if (!separate)
    doc_lengths.push_back(static_cast<uint64_t>(nd));
  else {
    doc_lengths.push_back(static_cast<uint64_t>(ndocs * (epochs - 1)));
    doc_lengths.push_back(static_cast<uint64_t>(ndocs));
  }
  const int64_t region_a = static_cast<int64_t>(doc_lengths[0]);
  size_t doc_draws = 0;
  for (uint64_t m : doc_lengths) doc_draws += m >= 2 ? static_cast<size_t>(m - 1) : 0;

  document_index_ = IndexArray::Owned(NpyType::kInt32, {nd});
  const bool big = total >= static_cast<int64_t>(std::numeric_limits<uint32_t>::max()) - 1;
  shuffle_index_ = IndexArray::Owned(big ? NpyType::kInt64 : NpyType::kUInt32, {total});
  int32_t* doc = document_index_.As<int32_t>();
  const int64_t max_len = dataset_->max_sequence_length();
  const bool wide = std::max(nd, max_len) > std::numeric_limits<int32_t>::max();
  sample_index_ = IndexArray::Owned(wide ? NpyType::kInt64 : NpyType::kInt32, {ns + 1, 2});

  const bool threaded = doc_draws > (1u << 18);
  const bool wide_draws = nd > static_cast<int64_t>(std::numeric_limits<uint32_t>::max());
  // The ring holds all the document draws up to 8 Mi of them (32 MiB), so that the drawing thread
  // is not held back by the swaps and goes on to the shuffle index; pages are touched as written.
  const size_t ring_size = std::min<size_t>(std::bit_ceil(std::max<size_t>(doc_draws, 1)), size_t{1} << 23);
  IndexArray ring = IndexArray::Owned(wide_draws ? NpyType::kInt64 : NpyType::kUInt32,
                                      {threaded ? static_cast<int64_t>(ring_size) : 1});
  DrawRing<uint32_t> draws32;
  DrawRing<int64_t> draws64;
  if (wide_draws)
    draws64.buf = ring.As<int64_t>();
  else
    draws32.buf = ring.As<uint32_t>();
  draws32.capacity = draws64.capacity = ring_size;

  auto shuffle_index = [&](NumpyRandomState& rng) {
    auto shuffle = [&](auto* out) {
      for (int64_t i = 0; i < total; ++i) out[i] = static_cast<std::remove_pointer_t<decltype(out)>>(i);
      rng.Shuffle(out, static_cast<size_t>(first));
      if (first < total) rng.Shuffle(out + first, static_cast<size_t>(total - first));
    };
    if (big)
      shuffle(shuffle_index_.As<int64_t>());
    else
      shuffle(shuffle_index_.As<uint32_t>());
  };
  // Cache writes: each array as soon as it is final; the description only after all three, since
  // Megatron takes the four files' presence as a cache hit.
  absl::Status save_shuffle, save_doc, save_sample;
  std::atomic<bool> doc_done{false};
  auto save_array = [&](const IndexArray& a, const char* name) {
    return save ? a.Save(cache_prefix_ + name) : absl::OkStatus();
  };

  // The split's lengths, copied to an aligned (huge-page) array: gathered from in random order, it
  // misses the TLB far less than the mapped index file.
  IndexArray split_lengths = IndexArray::Owned(NpyType::kInt32, {std::max<int64_t>(ndocs, 1)});
  int32_t* slen = split_lengths.As<int32_t>();
  if (ndocs > 0) std::memcpy(slen, dataset_->lengths_data() + 4 * beg_, static_cast<size_t>(ndocs) * 4);
  const int32_t* lens = slen - beg_;

  // sample_index: the rows helpers.cpp build_sample_idx writes. Sample s >= 1 starts at token
  // s*seq of the documents concatenated in document_index order; its row names the document that
  // holds token q = s*seq + add - 1 (the last token of sample s-1) and the offset of token s*seq in
  // it. Empty documents hold no token and are never named. Rows whose q lies past the last token
  // (a partial last validation sample) get what the walk gives when it runs out: the last
  // document, offset (its length - add). Row 0 is (0, 0).
  // The rows are computed region by region (the range of each document shuffle, whose first and
  // last tokens are known from the token counts), from its end downwards: a document either holds
  // the current top row or not. One no longer than a sample holds at most one row, so that common
  // case is branch-free: the row is written always and kept (the row pointer moves down) only when
  // q falls inside the document; otherwise a later, lower document overwrites it.
  const int64_t total_tokens = epochs * tpe;
  const int64_t inside = std::min<int64_t>(ns, total_tokens - add >= 0 ? (total_tokens - add) / seq : 0);
  auto first_row_from = [&](int64_t token) {  // the first s >= 1 whose q >= token
    const int64_t num = token - add + 1;
    return std::max<int64_t>(1, num <= 0 ? 0 : (num + seq - 1) / seq);
  };
  // Rows [row_min, row] from documents [lo, hi], the last of which ends at token `end`.
  auto fill_rows = [&](auto* out, int64_t lo, int64_t hi, int64_t end, int64_t row_min, int64_t row) {
    using T = std::remove_pointer_t<decltype(out)>;
    constexpr int64_t kAhead = 64;
    int64_t q = row * seq + add - 1;
    for (int64_t k = hi; k >= lo && row >= row_min; --k) {
      if (k - kAhead >= lo) __builtin_prefetch(lens + doc[k - kAhead]);
      const int64_t len = lens[doc[k]], start = end - len;
      if (__builtin_expect(len > seq, 0)) {
        for (; row >= row_min && q >= start; --row, q -= seq) {
          out[2 * row] = static_cast<T>(k);
          out[2 * row + 1] = static_cast<T>(q + 1 - add - start);
        }
      } else {
        const bool emit = q >= start;
        T* dst = out + 2 * row;  // row >= row_min >= 1 here
        dst[0] = static_cast<T>(k);
        dst[1] = static_cast<T>(q + 1 - add - start);
        row -= emit;
        q -= emit ? seq : 0;
      }
      end = start;
    }
  };
  const int64_t end_a = separate ? (epochs - 1) * tpe : total_tokens;
  auto fill_region = [&](int region) {
    auto run = [&](auto* out) {
      if (region == 0)
        fill_rows(out, 0, region_a - 1, end_a, 1, std::min(inside, first_row_from(end_a) - 1));
      else
        fill_rows(out, region_a, nd - 1, total_tokens, first_row_from(end_a), inside);
    };
    if (wide)
      run(sample_index_.As<int64_t>());
    else
      run(sample_index_.As<int32_t>());
  };

  std::atomic<bool> last_epoch_rows_done{false};
  auto producer = [&] {
    NumpyRandomState rng(config_.random_seed);
    if (wide_draws)
      rng.Draw(doc_lengths, &draws64);
    else
      rng.Draw(doc_lengths, &draws32);
    shuffle_index(rng);  // the same generator continues with the shuffle index
    save_shuffle = save_array(shuffle_index_, "shuffle_index.npy");
    doc_done.wait(false, std::memory_order_acquire);
    if (separate) {
      fill_region(1);  // the separate last epoch's sample rows
      last_epoch_rows_done.store(true, std::memory_order_release);
      last_epoch_rows_done.notify_one();
    }
    save_doc = save_array(document_index_, "document_index.npy");
  };
  std::thread worker;
  if (threaded) worker = std::thread(producer);

  for (int64_t e = 0; e < epochs; ++e)
    for (int64_t i = 0; i < ndocs; ++i) doc[e * ndocs + i] = static_cast<int32_t>(beg_ + i);

  if (!threaded) {
    NumpyRandomState rng(config_.random_seed);
    rng.Shuffle(doc, static_cast<size_t>(doc_lengths[0]));
    if (separate) rng.Shuffle(doc + region_a, static_cast<size_t>(doc_lengths[1]));
    shuffle_index(rng);
    save_shuffle = save_array(shuffle_index_, "shuffle_index.npy");
    save_doc = save_array(document_index_, "document_index.npy");
  } else {
    auto apply_doc = [&](auto* ring) {
      ApplyDraws(doc, static_cast<size_t>(doc_lengths[0]), ring, 0);
      if (separate)
        ApplyDraws(doc + region_a, static_cast<size_t>(doc_lengths[1]), ring,
                   static_cast<size_t>(std::max<int64_t>(0, region_a - 1)));
    };
    if (wide_draws)
      apply_doc(&draws64);
    else
      apply_doc(&draws32);
    doc_done.store(true, std::memory_order_release);
    doc_done.notify_one();
  }
  // The two regions' rows are disjoint: with a separate last epoch, the drawing thread fills that
  // region's rows while this one fills the rest.
  fill_region(0);
  if (separate) {
    if (threaded)
      last_epoch_rows_done.wait(false, std::memory_order_acquire);
    else
      fill_region(1);
  }

  auto finish_rows = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    out[0] = 0;
    out[1] = 0;
    if (inside < ns) {
      const T last = static_cast<T>(nd - 1), off = static_cast<T>(lens[doc[nd - 1]] - add);
      for (int64_t s = std::max<int64_t>(inside + 1, 1); s <= ns; ++s) {
        out[2 * s] = last;
        out[2 * s + 1] = off;
      }
    }
  };
  if (wide)
    finish_rows(sample_index_.As<int64_t>());
  else
    finish_rows(sample_index_.As<int32_t>());
  save_sample = save_array(sample_index_, "sample_index.npy");
  if (worker.joinable()) worker.join();
  absl::Status st = save_shuffle;
  if (st.ok()) st = save_doc;
  if (st.ok()) st = save_sample;
  if (st.ok() && save) st = SaveDescription(cache_prefix_ + "description.txt", description_);
  if (!st.ok()) log::Warning("cannot save the GPTDataset index cache ({}); continuing without it", StatusMessage(st));
  return absl::OkStatus();
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
  for (; n < want; ++n) out[n] = config_.pad;
  return absl::OkStatus();
}

// ---------------------------------------------------------------- BlendedDataset

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
  for (double w : weights) w_json.push_back(integer_weights && !size ? py::Json(static_cast<int64_t>(w)) : py::Json(w));
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
    bool any = PathExists(prefix + "description.txt") || PathExists(prefix + "dataset_index.npy") ||
               PathExists(prefix + "dataset_sample_index.npy");
    if (any) {
      auto text = ReadFileToString(prefix + "description.txt");
      auto di = IndexArray::Load(prefix + "dataset_index.npy");
      auto dsi = IndexArray::Load(prefix + "dataset_sample_index.npy");
      if (text.ok() && *text == b->description_ && di.ok() && dsi.ok() && di->type() == NpyType::kInt16 &&
          dsi->type() == NpyType::kInt64 && di->shape().size() == 1 && dsi->shape() == di->shape()) {
        b->dataset_index_ = std::move(*di);
        b->dataset_sample_index_ = std::move(*dsi);
        b->from_cache_ = true;
        return b;
      }
      log::Warning("ignoring the blend index cache {}*: missing, corrupt or another description; rebuilding it",
                   prefix);
    }
  }
  const size_t nd = datasets.size();
  std::vector<int64_t> counts(nd, 0);
  if (size) {
    b->dataset_index_ = IndexArray::Owned(NpyType::kInt16, {*size});
    b->dataset_sample_index_ = IndexArray::Owned(NpyType::kInt64, {*size});
    int16_t* di = b->dataset_index_.As<int16_t>();
    int64_t* dsi = b->dataset_sample_index_.As<int64_t>();
    for (int64_t s = 0; s < *size; ++s) {
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
  } else {
    // build_exhaustive_blending_indices: exactly sizes[d] samples of dataset d.
    int64_t total = 0;
    std::vector<int64_t> sizes(nd);
    for (size_t d = 0; d < nd; ++d) total += sizes[d] = static_cast<int64_t>(weights[d]);
    std::vector<double> w(nd);
    for (size_t d = 0; d < nd; ++d) w[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
    b->dataset_index_ = IndexArray::Owned(NpyType::kInt16, {total});
    b->dataset_sample_index_ = IndexArray::Owned(NpyType::kInt64, {total});
    int16_t* di = b->dataset_index_.As<int16_t>();
    int64_t* dsi = b->dataset_sample_index_.As<int64_t>();
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
  for (size_t d = 0; d < nd; ++d)
    if (counts[d] > datasets[d]->size())
      return absl::FailedPreconditionError(fmt::format(
          "the {} blend asks dataset {} ({}) for {} samples but it has {}; increase --mid-level-dataset-surplus",
          SplitName(split), d, datasets[d]->cache_prefix(), counts[d], datasets[d]->size()));
  if (config.path_to_cache && config.write_cache) {
    absl::Status st = MakeDirs(*config.path_to_cache);
    if (st.ok()) st = WriteFileAtomic(prefix + "description.txt", b->description_, true, false);
    if (st.ok()) st = b->dataset_index_.Save(prefix + "dataset_index.npy");
    if (st.ok()) st = b->dataset_sample_index_.Save(prefix + "dataset_sample_index.npy");
    if (!st.ok()) log::Warning("cannot save the blend index cache ({}); continuing without it", StatusMessage(st));
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
