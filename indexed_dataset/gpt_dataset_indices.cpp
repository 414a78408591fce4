// The index-building arithmetic of Megatron's GPTDataset (gpt_dataset.py's _build_document_sample_shuffle_indices
// and helpers.cpp's build_sample_idx), cut where Megatron cuts it: _get_num_epochs, _build_document_index,
// _build_shuffle_index, build_sample_idx, and BuildIndices, the driver that overlaps numpy's draws, the
// shuffles, the sample rows and the cache writes on two threads.
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/status.h"
#include "indexed_dataset/gpt_dataset.h"
#include "indexed_dataset/numpy_random.h"

namespace ptk {
namespace {

// Megatron's _get_num_epochs and the sizes _build_document_sample_shuffle_indices derives from it:
// how many epochs the requested samples need, whether the last epoch is shuffled separately, and
// the lengths of the three arrays.
struct EpochPlan {
  int64_t seq = 0, add = 0;    // sequence length, 1 with the extra token
  int64_t ndocs = 0, tpe = 0;  // the split's documents and tokens per epoch
  int64_t epochs = 1;
  bool separate = false;   // separate_final_epoch
  int64_t ns = 0, nd = 0;  // samples; documents in the document index
  int64_t first = 0;       // the shuffle index's first shuffle: [0, first), then [first, ns)
  // The document shuffles: [0, region_a) and, when separate, [region_a, nd); their draw count.
  std::vector<uint64_t> doc_lengths;
  int64_t region_a = 0;
  size_t doc_draws = 0;
  int64_t total_tokens = 0, end_a = 0;  // tokens in all epochs; the token where region a ends
  int64_t inside = 0;                   // the last sample row whose last token exists
};

absl::StatusOr<EpochPlan> GetNumEpochs(int64_t seq, int64_t add, int64_t ndocs, int64_t tpe,
                                       std::optional<int64_t> num_samples, bool drop_last, const std::string& prefix,
                                       std::string_view split) {
  EpochPlan p;
  p.seq = seq;
  p.add = add;
  p.ndocs = ndocs;
  p.tpe = tpe;
  int64_t epochs = 1;
  if (num_samples) {
    // More tokens than int64 counts: no index could hold them (and the product would overflow).
    if (seq > 0 && *num_samples > (std::numeric_limits<int64_t>::max() - add) / seq)
      return absl::FailedPreconditionError(
          fmt::format("{}: {} samples of {} tokens asked of the {} split: more tokens than any index can hold; ask "
                      "fewer samples",
                      prefix, *num_samples, seq, split));
    const int64_t requested = *num_samples * seq + add;
    // No samples asked of an empty split (e.g. --eval-iters 0 with a split too small to hold a
    // document) is no error: the split stays empty.
    if (tpe == 0 && *num_samples > 0)
      return absl::FailedPreconditionError(
          fmt::format("{}: the {} split holds no tokens ({} documents) but {} samples were requested; adjust --split "
                      "or the sample counts (--eval-iters 0 asks none of the valid and test splits)",
                      prefix, split, ndocs, *num_samples));
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
  // Megatron's document index is int32 too. Not a full disk (exit 3): a request too large.
  if (ndocs > 0 && epochs > std::numeric_limits<int32_t>::max() / ndocs)
    return absl::FailedPreconditionError(
        fmt::format("{}: the {} split's {} samples need {} epochs of its {} documents, a document index of {:.0f} "
                    "entries, more than "
                    "its int32 entries can number (as in Megatron); ask fewer samples",
                    prefix, split, num_samples.value_or(0), epochs, ndocs,
                    static_cast<double>(ndocs) * static_cast<double>(epochs)));
  int64_t ns;
  if (drop_last)
    ns = (epochs * tpe - add) / seq;
  else
    ns = static_cast<int64_t>(std::ceil(static_cast<float>(epochs * tpe - add) / static_cast<float>(seq)));
  if (ns < 0) ns = 0;
  const int64_t nd = ndocs * epochs;
  if (ns > 0 && nd == 0) return absl::InternalError("samples without documents");
  p.epochs = epochs;
  p.separate = separate;
  p.ns = ns;
  p.nd = nd;
  p.first = separate ? sans : ns;
  if (!separate)
    p.doc_lengths.push_back(static_cast<uint64_t>(nd));
  else {
    p.doc_lengths.push_back(static_cast<uint64_t>(ndocs * (epochs - 1)));
    p.doc_lengths.push_back(static_cast<uint64_t>(ndocs));
  }
  p.region_a = static_cast<int64_t>(p.doc_lengths[0]);
  for (uint64_t m : p.doc_lengths) p.doc_draws += m >= 2 ? static_cast<size_t>(m - 1) : 0;
  p.total_tokens = epochs * tpe;
  p.end_a = separate ? (epochs - 1) * tpe : p.total_tokens;
  p.inside = std::min<int64_t>(ns, p.total_tokens - add >= 0 ? (p.total_tokens - add) / seq : 0);
  return p;
}

// _build_document_index before its shuffle: every epoch's document ids in order (the shuffles are
// the generator's, applied by the driver: directly, or from the drawing thread's ring).
void BuildDocumentIndex(const EpochPlan& p, int64_t beg, int32_t* doc) {
  for (int64_t e = 0; e < p.epochs; ++e)
    for (int64_t i = 0; i < p.ndocs; ++i) doc[e * p.ndocs + i] = static_cast<int32_t>(beg + i);
}

// _build_shuffle_index: 0..ns-1, shuffled in [0, first) and [first, ns), with the generator that
// shuffled the document index.
void BuildShuffleIndex(const EpochPlan& p, NumpyRandomState& rng, IndexArray& shuffle_index) {
  auto shuffle = [&](auto* out) {
    for (int64_t i = 0; i < p.ns; ++i) out[i] = static_cast<std::remove_pointer_t<decltype(out)>>(i);
    rng.Shuffle(out, static_cast<size_t>(p.first));
    if (p.first < p.ns) rng.Shuffle(out + p.first, static_cast<size_t>(p.ns - p.first));
  };
  if (shuffle_index.type() == NpyType::kInt64)
    shuffle(shuffle_index.As<int64_t>());
  else
    shuffle(shuffle_index.As<uint32_t>());
}

// helpers.cpp's build_sample_idx. Sample s >= 1 starts at token s*seq of the documents
// concatenated in document_index order; its row names the document that holds token
// q = s*seq + add - 1 (the last token of sample s-1) and the offset of token s*seq in it. Empty
// documents hold no token and are never named. Rows whose q lies past the last token (a partial
// last validation sample) get what the walk gives when it runs out: the last document, offset (its
// length - add). Row 0 is (0, 0).
// The rows are computed region by region (the range of each document shuffle, whose first and
// last tokens are known from the token counts), from its end downwards: a document either holds
// the current top row or not. One no longer than a sample holds at most one row, so that common
// case is branch-free: the row is written always and kept (the row pointer moves down) only when
// q falls inside the document; otherwise a later, lower document overwrites it. The two regions'
// rows are disjoint, so two threads may fill them.
class SampleIdxBuilder {
 public:
  // `lens` indexed by document id; `doc` the final document index.
  SampleIdxBuilder(const EpochPlan& p, const int32_t* lens, const int32_t* doc, IndexArray* out)
      : p_(p), lens_(lens), doc_(doc), out_(out) {}

  void FillRegion(int region) const {
    auto run = [&](auto* out) {
      if (region == 0)
        FillRows(out, 0, p_.region_a - 1, p_.end_a, 1, std::min(p_.inside, FirstRowFrom(p_.end_a) - 1));
      else
        FillRows(out, p_.region_a, p_.nd - 1, p_.total_tokens, FirstRowFrom(p_.end_a), p_.inside);
    };
    if (out_->type() == NpyType::kInt64)
      run(out_->As<int64_t>());
    else
      run(out_->As<int32_t>());
  }

  // Row 0 and the rows past the last token.
  void Finish() const {
    auto finish = [&](auto* out) {
      using T = std::remove_pointer_t<decltype(out)>;
      out[0] = 0;
      out[1] = 0;
      if (p_.inside < p_.ns) {
        const T last = static_cast<T>(p_.nd - 1), off = static_cast<T>(lens_[doc_[p_.nd - 1]] - p_.add);
        for (int64_t s = std::max<int64_t>(p_.inside + 1, 1); s <= p_.ns; ++s) {
          out[2 * s] = last;
          out[2 * s + 1] = off;
        }
      }
    };
    if (out_->type() == NpyType::kInt64)
      finish(out_->As<int64_t>());
    else
      finish(out_->As<int32_t>());
  }

 private:
  int64_t FirstRowFrom(int64_t token) const {  // the first s >= 1 whose q >= token
    const int64_t num = token - p_.add + 1;
    return std::max<int64_t>(1, num <= 0 ? 0 : (num + p_.seq - 1) / p_.seq);
  }

  // Rows [row_min, row] from documents [lo, hi], the last of which ends at token `end`.
  template <typename T>
  void FillRows(T* out, int64_t lo, int64_t hi, int64_t end, int64_t row_min, int64_t row) const {
    constexpr int64_t kAhead = 64;
    const int64_t seq = p_.seq, add = p_.add;
    const int32_t* lens = lens_;
    const int32_t* doc = doc_;
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
  }

  const EpochPlan& p_;
  const int32_t* lens_;
  const int32_t* doc_;
  IndexArray* out_;
};

// Called as each array is final (the cache writes), on whichever thread finishes it.
struct ArraysDone {
  std::function<void()> shuffle_index, document_index, sample_index;
};

// The build for large splits. The random draws depend only on the generator, never on the arrays,
// so a second thread makes them all, in numpy's order (the document shuffle or shuffles, then the
// shuffle-index shuffle or shuffles), handing the document draws to this thread through a ring; it
// then shuffles the shuffle index, and, once the document index is final, fills the sample rows of
// a separate last epoch. This thread applies the document swaps as they arrive and fills the other
// sample rows. Same draws, same swaps, same order: arrays identical to numpy's and to helpers.cpp's.
void BuildOnTwoThreads(const EpochPlan& p, uint64_t seed, int32_t* doc, IndexArray& shuffle_index,
                       const SampleIdxBuilder& sample_idx, const ArraysDone& done) {
  const bool wide_draws = p.nd > static_cast<int64_t>(std::numeric_limits<uint32_t>::max());
  // The ring holds all the document draws up to 8 Mi of them (32 MiB), so that the drawing thread
  // is not held back by the swaps and goes on to the shuffle index; pages are touched as written.
  const size_t ring_size = std::min<size_t>(std::bit_ceil(std::max<size_t>(p.doc_draws, 1)), size_t{1} << 23);
  IndexArray ring =
      IndexArray::Owned(wide_draws ? NpyType::kInt64 : NpyType::kUInt32, {static_cast<int64_t>(ring_size)});
  DrawRing<uint32_t> draws32;
  DrawRing<int64_t> draws64;
  if (wide_draws)
    draws64.buf = ring.As<int64_t>();
  else
    draws32.buf = ring.As<uint32_t>();
  draws32.capacity = draws64.capacity = ring_size;
  std::atomic<bool> doc_done{false}, last_epoch_rows_done{false};
  std::thread worker([&] {
    NumpyRandomState rng(seed);
    if (wide_draws)
      rng.Draw(p.doc_lengths, &draws64);
    else
      rng.Draw(p.doc_lengths, &draws32);
    BuildShuffleIndex(p, rng, shuffle_index);  // the same generator continues with the shuffle index
    done.shuffle_index();
    doc_done.wait(false, std::memory_order_acquire);
    if (p.separate) {
      sample_idx.FillRegion(1);  // the separate last epoch's sample rows
      last_epoch_rows_done.store(true, std::memory_order_release);
      last_epoch_rows_done.notify_one();
    }
    done.document_index();
  });
  auto apply_doc = [&](auto* ring) {
    ApplyDraws(doc, static_cast<size_t>(p.doc_lengths[0]), ring, 0);
    if (p.separate)
      ApplyDraws(doc + p.region_a, static_cast<size_t>(p.doc_lengths[1]), ring,
                 static_cast<size_t>(std::max<int64_t>(0, p.region_a - 1)));
  };
  if (wide_draws)
    apply_doc(&draws64);
  else
    apply_doc(&draws32);
  doc_done.store(true, std::memory_order_release);
  doc_done.notify_one();
  sample_idx.FillRegion(0);  // while the drawing thread fills a separate last epoch's rows
  if (p.separate) last_epoch_rows_done.wait(false, std::memory_order_acquire);
  sample_idx.Finish();
  done.sample_index();
  worker.join();
}

absl::StatusOr<EpochPlan> PlanOf(const IndexedDataset& dataset, int64_t beg, int64_t end, Split split,
                                 const GPTDatasetConfig& config, std::optional<int64_t> num_samples) {
  int64_t tpe = 0;
  for (int64_t i = beg; i < end; ++i) tpe += dataset.sequence_length(i);
  const bool drop_last = split != Split::kValid || config.drop_last_partial_validation_sequence;
  return GetNumEpochs(config.sequence_length, config.add_extra_token_to_sequence ? 1 : 0, end - beg, tpe, num_samples,
                      drop_last, dataset.prefix(), SplitName(split));
}

}  // namespace

absl::StatusOr<GPTDataset::IndexShapes> GPTDataset::ExpectedIndexShapes(std::optional<int64_t> num_samples) const {
  PTK_ASSIGN_OR_RETURN(const EpochPlan p, PlanOf(*dataset_, beg_, end_, split_, config_, num_samples));
  return IndexShapes{.documents = p.nd, .samples = p.ns, .epochs = p.epochs};
}

absl::Status GPTDataset::BuildIndices(std::optional<int64_t> num_samples, bool save) {
  const int64_t ndocs = end_ - beg_;
  PTK_ASSIGN_OR_RETURN(const EpochPlan p, PlanOf(*dataset_, beg_, end_, split_, config_, num_samples));
  num_epochs_ = p.epochs;

  document_index_ = IndexArray::Owned(NpyType::kInt32, {p.nd});
  const bool big = p.ns >= static_cast<int64_t>(std::numeric_limits<uint32_t>::max()) - 1;
  shuffle_index_ = IndexArray::Owned(big ? NpyType::kInt64 : NpyType::kUInt32, {p.ns});
  int32_t* doc = document_index_.As<int32_t>();
  const int64_t max_len = dataset_->max_sequence_length();
  const bool wide = std::max(p.nd, max_len) > std::numeric_limits<int32_t>::max();
  sample_index_ = IndexArray::Owned(wide ? NpyType::kInt64 : NpyType::kInt32, {p.ns + 1, 2});
  // The split's lengths, copied to an aligned (huge-page) array: gathered from in random order, it
  // misses the TLB far less than the mapped index file.
  IndexArray split_lengths = IndexArray::Owned(NpyType::kInt32, {std::max<int64_t>(ndocs, 1)});
  int32_t* slen = split_lengths.As<int32_t>();
  if (ndocs > 0) std::memcpy(slen, dataset_->lengths_data() + 4 * beg_, static_cast<size_t>(ndocs) * 4);
  const SampleIdxBuilder sample_idx(p, slen - beg_, doc, &sample_index_);
  // Cache writes: each array as soon as it is final; the description only after all three, since
  // Megatron takes the four files' presence as a cache hit.
  absl::Status save_shuffle, save_doc, save_sample;
  auto save_array = [&](const IndexArray& a, const char* name) {
    return save ? a.Save(cache_prefix_ + name) : absl::OkStatus();
  };
  BuildDocumentIndex(p, beg_, doc);

  // Small splits in numpy's order on this thread; large ones on two (BuildOnTwoThreads).
  const bool threaded = p.doc_draws > (1u << 18);
  if (!threaded) {
    NumpyRandomState rng(config_.random_seed);
    rng.Shuffle(doc, static_cast<size_t>(p.doc_lengths[0]));
    if (p.separate) rng.Shuffle(doc + p.region_a, static_cast<size_t>(p.doc_lengths[1]));
    BuildShuffleIndex(p, rng, shuffle_index_);
    save_shuffle = save_array(shuffle_index_, "shuffle_index.npy");
    save_doc = save_array(document_index_, "document_index.npy");
    sample_idx.FillRegion(0);
    if (p.separate) sample_idx.FillRegion(1);
    sample_idx.Finish();
    save_sample = save_array(sample_index_, "sample_index.npy");
  } else {
    BuildOnTwoThreads(p, config_.random_seed, doc, shuffle_index_, sample_idx,
                      {.shuffle_index = [&] { save_shuffle = save_array(shuffle_index_, "shuffle_index.npy"); },
                       .document_index = [&] { save_doc = save_array(document_index_, "document_index.npy"); },
                       .sample_index = [&] { save_sample = save_array(sample_index_, "sample_index.npy"); }});
  }
  absl::Status st = save_shuffle;
  if (st.ok()) st = save_doc;
  if (st.ok()) st = save_sample;
  // Caches are validated on load and rebuilt when damaged: atomic, not durable.
  if (st.ok() && save) st = WriteFileAtomic(cache_prefix_ + "description.txt", description_, /*durable=*/false);
  if (!st.ok()) return IndexCacheNotSaved("GPTDataset", Dirname(cache_prefix_), config_, st);
  return absl::OkStatus();
}

}  // namespace ptk
