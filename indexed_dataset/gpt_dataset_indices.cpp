// The index-building arithmetic of Megatron's GPTDataset (gpt_dataset.py's _build_document_sample_shuffle_indices
// and helpers.cpp's build_sample_idx): epochs, numpy's shuffles and draws, sample rows, and the cache writes
// overlapped with the build.
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/logging.h"
#include "common/status.h"
#include "indexed_dataset/gpt_dataset.h"
#include "indexed_dataset/numpy_random.h"

namespace ptk {

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
    // No samples asked of an empty split (e.g. --eval-iters 0 with a split too small to hold a
    // document) is no error: the split stays empty.
    if (tpe == 0 && *num_samples > 0)
      return absl::FailedPreconditionError(
          fmt::format("{}: the {} split holds no tokens ({} documents) but {} samples were requested; adjust --split "
                      "or the sample counts (--eval-iters 0 asks none of the valid and test splits)",
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
  // Caches are validated on load and rebuilt when damaged: atomic, not durable.
  if (st.ok() && save) st = WriteFileAtomic(cache_prefix_ + "description.txt", description_, /*durable=*/false);
  if (!st.ok()) log::Warning("cannot save the GPTDataset index cache ({}); continuing without it", StatusMessage(st));
  return absl::OkStatus();
}

}  // namespace ptk
