// Tokenizer throughput: encodes the "text" of every record of a jsonl file with ptk's GPT-2 tokenizer,
// single thread and with N threads, after checking the ids against an uncached BPE of the same
// text. Prints one JSON object. Driven by bench/bench_tokenizer.py, which times the references.
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include <fmt/core.h>

#include "common/file_io.h"
#include "dataprep/tokenize/json_record.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "tokenizer/pretokenizer.h"

namespace {
double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: tokenizer_bench FILE.jsonl [THREADS] [REPEATS]\n");
    return 2;
  }
  auto text_or = ptk::ReadFileToString(argv[1]);
  if (!text_or.ok()) {
    std::fprintf(stderr, "%s\n", std::string(text_or.status().message()).c_str());
    return 1;
  }
  const std::string jsonl = *text_or;
  int threads = argc > 2 ? std::atoi(argv[2]) : static_cast<int>(std::thread::hardware_concurrency());
  int repeats = argc > 3 ? std::atoi(argv[3]) : 3;
  std::vector<std::string> texts;
  ptk::JsonRecordParser parser({"text"});
  for (size_t pos = 0; pos < jsonl.size();) {
    size_t e = jsonl.find('\n', pos);
    if (e == std::string::npos) e = jsonl.size();
    auto r = parser.Parse(std::string_view(jsonl).substr(pos, e - pos), false);
    if (r.status == ptk::RecordStatus::kOk) texts.emplace_back(parser.fields()[0][0]);
    pos = e + 1;
  }
  size_t total_bytes = 0;
  std::vector<std::string_view> docs;
  for (const auto& t : texts) {
    docs.push_back(t);
    total_bytes += t.size();
  }
  auto tok = ptk::Gpt2Tokenizer::LoadDefault();
  if (!tok.ok()) return 1;

  // Correctness gate: cached encoder == plain BPE over the pre-tokenizer, on every document.
  {
    ptk::Gpt2Encoder enc(**tok, {.special_endoftext = false});
    std::vector<int32_t> a, b;
    for (auto d : docs) {
      a.clear();
      b.clear();
      enc.Encode(d, &a);
      ptk::ForEachPiece(
          d, [&](const uint8_t* x, const uint8_t* y) { (*tok)->BpePiece(x, static_cast<size_t>(y - x), &b); });
      if (a != b) {
        std::fprintf(stderr, "tokenizer_bench: ids differ from plain BPE\n");
        return 1;
      }
    }
  }

  // Single thread: cold (fresh cache) and best of `repeats` warm passes.
  size_t n_ids = 0;
  double cold = 0, warm = 1e30;
  {
    ptk::Gpt2Encoder enc(**tok, {.special_endoftext = false});
    std::vector<int32_t> ids;
    for (int r = 0; r <= repeats; ++r) {
      double t0 = Now();
      n_ids = 0;
      for (auto d : docs) {
        ids.clear();
        enc.Encode(d, &ids);
        n_ids += ids.size();
      }
      double el = Now() - t0;
      if (r == 0)
        cold = el;
      else
        warm = std::min(warm, el);
    }
  }
  // Pre-tokenizer alone.
  double pretok = 1e30;
  for (int r = 0; r < repeats; ++r) {
    double t0 = Now();
    size_t pieces = 0;
    for (auto d : docs) ptk::ForEachPiece(d, [&](const uint8_t*, const uint8_t*) { ++pieces; });
    pretok = std::min(pretok, Now() - t0);
    if (pieces == 0 && total_bytes > 0) return 1;
  }
  // Multi-thread over documents, one encoder per thread.
  double multi = 1e30;
  {
    tbb::global_control gc(tbb::global_control::max_allowed_parallelism, threads);
    for (int r = 0; r <= repeats; ++r) {
      double t0 = Now();
      std::atomic<size_t> total{0};
      tbb::parallel_for(tbb::blocked_range<size_t>(0, docs.size(), 256), [&](const tbb::blocked_range<size_t>& rg) {
        thread_local std::unique_ptr<ptk::Gpt2Encoder> enc;
        if (!enc)
          enc = std::make_unique<ptk::Gpt2Encoder>(**tok, ptk::Gpt2Encoder::Options{.special_endoftext = false});
        std::vector<int32_t> ids;
        size_t n = 0;
        for (size_t i = rg.begin(); i < rg.end(); ++i) {
          ids.clear();
          enc->Encode(docs[i], &ids);
          n += ids.size();
        }
        total += n;
      });
      double el = Now() - t0;
      if (r > 0) multi = std::min(multi, el);
      if (total != n_ids) return 1;
    }
  }
  const double mb = total_bytes / 1e6;
  std::printf(
      "{\"bytes\": %zu, \"documents\": %zu, \"tokens\": %zu, \"st_cold_mb_s\": %.2f, \"st_warm_mb_s\": %.2f, "
      "\"pretokenize_mb_s\": %.2f, \"threads\": %d, \"mt_mb_s\": %.2f}\n",
      total_bytes, docs.size(), n_ids, mb / cold, mb / warm, mb / pretok, threads, mb / multi);
  return 0;
}
