// Where one worker's time goes when ptk-tokenize encodes a jsonl file it has not seen: every stage
// of the pipeline timed on its own, single thread, over the whole file (best of REPEATS), so the
// split can be compared before and after a change:
//   start-up       the GPT-2 tokenizer's tables and one encoder (its cache) made ready
//   read           the file read into memory (page cache)
//   json           each line parsed for its "text" (simdjson; UTF-8 validation included)
//   utf8           of which: UTF-8 validation alone (simdjson's validator over the texts)
//   pre-tokenizer  GPT-2's split of every text into pieces (counted, nothing else)
//   cache          a pass whose every piece is already cached, less the pre-tokenizer
//   bpe            a first pass (fresh encoder) less the cached pass: BPE of the misses and
//                  filling the cache
//                  (of which merges: BPE alone over every distinct piece, once)
//   output         the ids written as Megatron .bin/.idx (IndexedDatasetBuilder, to a temporary
//                  prefix in the output directory)
// Prints a table and one JSON line. Usage: tokenize_cost_split FILE.jsonl [OUTDIR] [REPEATS]
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <simdjson.h>

#include "absl/container/flat_hash_set.h"

#include "common/file_io.h"
#include "dataprep/tokenize/json_record.h"
#include "indexed_dataset/indexed_dataset.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "tokenizer/pretokenizer.h"

namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Best of `repeats` runs of f (f returns false on a failed check).
double Best(int repeats, const std::function<bool()>& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = Now();
    if (!f()) {
      std::fprintf(stderr, "tokenize_cost_split: a stage's check failed\n");
      std::exit(1);
    }
    best = std::min(best, Now() - t0);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: tokenize_cost_split FILE.jsonl [OUTDIR] [REPEATS]\n");
    return 2;
  }
  const std::string path = argv[1];
  const std::string outdir = argc > 2 ? argv[2] : std::filesystem::temp_directory_path().string();
  if (!std::filesystem::is_directory(outdir)) {
    std::fprintf(stderr, "tokenize_cost_split: %s is not a directory\n", outdir.c_str());
    return 2;
  }
  const int repeats = argc > 3 ? std::max(1, std::atoi(argv[3])) : 5;

  std::string jsonl;
  const double t_read = Best(repeats, [&] {
    auto r = ptk::ReadFileToString(path);
    if (!r.ok()) return false;
    jsonl = std::move(*r);
    return true;
  });
  std::vector<std::string_view> lines;
  for (size_t pos = 0; pos < jsonl.size();) {
    size_t e = jsonl.find('\n', pos);
    if (e == std::string::npos) e = jsonl.size();
    if (e > pos) lines.push_back(std::string_view(jsonl).substr(pos, e - pos));
    pos = e + 1;
  }
  std::vector<std::string> texts;
  ptk::JsonRecordParser parser({"text"});
  const double t_json = Best(repeats, [&] {
    texts.clear();
    for (std::string_view l : lines) {
      auto r = parser.Parse(l, false);
      if (r.status != ptk::RecordStatus::kOk) return false;
      texts.emplace_back(parser.fields()[0][0]);
    }
    return true;
  });
  size_t bytes = 0;
  for (const auto& t : texts) bytes += t.size();
  const double t_utf8 = Best(repeats, [&] {
    for (const auto& t : texts)
      if (!simdjson::validate_utf8(t.data(), t.size())) return false;
    return true;
  });

  std::unique_ptr<ptk::Gpt2Tokenizer> tok;
  const double t_startup = Best(repeats, [&] {
    auto t = ptk::Gpt2Tokenizer::LoadDefault();
    if (!t.ok()) return false;
    tok = std::move(*t);
    ptk::Gpt2Encoder enc(*tok, {.special_endoftext = false});
    return enc.cache_bytes() > 0;
  });

  size_t pieces = 0;
  const double t_pretok = Best(repeats, [&] {
    pieces = 0;
    for (const auto& t : texts) ptk::ForEachPiece(t, [&](const uint8_t*, const uint8_t*) { ++pieces; });
    return pieces > 0 || bytes == 0;
  });

  // First pass: a fresh encoder each time (constructing it is start-up's, not timed here).
  std::vector<int32_t> ids, lens;
  std::vector<int32_t> first_ids;
  double t_cold = 1e30;
  for (int r = 0; r < repeats; ++r) {
    ptk::Gpt2Encoder enc(*tok, {.special_endoftext = false});
    const double t0 = Now();
    ids.clear();
    for (const auto& t : texts) enc.Encode(t, &ids);
    t_cold = std::min(t_cold, Now() - t0);
    if (r == 0) first_ids = ids;
  }
  ptk::Gpt2Encoder warm(*tok, {.special_endoftext = false});
  for (const auto& t : texts) warm.Encode(t, &ids);
  const double t_warm = Best(repeats, [&] {
    ids.clear();
    for (const auto& t : texts) warm.Encode(t, &ids);
    return ids == first_ids;
  });

  // Of which BPE proper: every distinct piece merged once (what a first pass cannot avoid).
  std::vector<std::string_view> distinct;
  {
    absl::flat_hash_set<std::string_view> seen;
    for (const auto& t : texts)
      ptk::ForEachPiece(t, [&](const uint8_t* b, const uint8_t* e) {
        std::string_view s(reinterpret_cast<const char*>(b), static_cast<size_t>(e - b));
        if (seen.insert(s).second) distinct.push_back(s);
      });
  }
  size_t merged_ids = 0;
  const double t_merge = Best(repeats, [&] {
    std::vector<int32_t> out;
    merged_ids = 0;
    for (std::string_view s : distinct) {
      out.clear();
      tok->BpePiece(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &out);
      merged_ids += out.size();
    }
    return merged_ids > 0 || distinct.empty();
  });

  // Output: the same ids, document by document, as ptk-tokenize writes them.
  std::vector<size_t> doc_end;
  {
    ptk::Gpt2Encoder enc(*tok, {.special_endoftext = false});
    ids.clear();
    for (const auto& t : texts) {
      enc.Encode(t, &ids);
      ids.push_back(tok->eod());
      doc_end.push_back(ids.size());
    }
  }
  const std::string prefix = outdir + "/tokenize_cost_split." + std::to_string(::getpid());
  const double t_output = Best(repeats, [&] {
    auto b = ptk::IndexedDatasetBuilder::Create(prefix, ptk::DType::kUInt16);
    if (!b.ok()) return false;
    size_t begin = 0;
    for (size_t end : doc_end) {
      const int32_t n = static_cast<int32_t>(end - begin);
      if (!(*b)->AddDocument(std::span<const int32_t>(ids.data() + begin, n), std::span<const int32_t>(&n, 1)).ok())
        return false;
      begin = end;
    }
    return (*b)->Finalize().ok();
  });
  std::filesystem::remove(prefix + ".bin");
  std::filesystem::remove(prefix + ".idx");

  const double t_cache = std::max(0.0, t_warm - t_pretok);
  const double t_bpe = std::max(0.0, t_cold - t_warm);
  const double total = t_startup + t_read + t_json + t_pretok + t_cache + t_bpe + t_output;
  struct Row {
    const char* name;
    double s;
  };
  const Row rows[] = {{"start-up", t_startup},     {"read", t_read},   {"json", t_json}, {"  of which utf8", t_utf8},
                      {"pre-tokenizer", t_pretok}, {"cache", t_cache}, {"bpe", t_bpe},   {"  of which merges", t_merge},
                      {"output", t_output}};
  std::printf("%zu documents, %.1f MB of text, %zu pieces, %zu ids; best of %d, one thread\n", texts.size(),
              bytes / 1e6, pieces, first_ids.size(), repeats);
  std::printf("%-16s %9s %7s %10s\n", "stage", "ms", "share", "MB/s");
  for (const Row& r : rows)
    std::printf("%-16s %9.1f %6.1f%% %10.1f\n", r.name, r.s * 1e3, 100 * r.s / total, bytes / 1e6 / r.s);
  std::printf("%-16s %9.1f %6.1f%% %10.1f\n", "sum", total * 1e3, 100.0, bytes / 1e6 / total);
  std::printf(
      "{\"bytes\": %zu, \"pieces\": %zu, \"startup_s\": %.6f, \"read_s\": %.6f, \"json_s\": %.6f, \"utf8_s\": %.6f, "
      "\"pretokenizer_s\": %.6f, \"cache_s\": %.6f, \"bpe_s\": %.6f, \"output_s\": %.6f, \"first_pass_s\": %.6f, "
      "\"warm_pass_s\": %.6f, \"distinct_pieces\": %zu, \"merges_s\": %.6f}\n",
      bytes, pieces, t_startup, t_read, t_json, t_utf8, t_pretok, t_cache, t_bpe, t_output, t_cold, t_warm,
      distinct.size(), t_merge);
  return 0;
}
