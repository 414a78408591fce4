// GPTDataset index build and loader throughput for bench/bench_gpt_dataset.py.
//   gpt_dataset_bench build DATA_PREFIX CACHE_DIR SEQ TRAIN VALID TEST SPLIT   -> seconds to build the indices
//   gpt_dataset_bench load  DATA_PREFIX CACHE_DIR SEQ TRAIN VALID TEST SPLIT MBS BATCHES -> samples/s
#include <chrono>
#include <cstdio>
#include <string>

#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "indexed_dataset/data_loader.h"

int main(int argc, char** argv) {
  if (argc < 9) {
    std::fprintf(stderr, "usage: gpt_dataset_bench build|load PREFIX CACHE SEQ TRAIN VALID TEST SPLIT [MBS BATCHES]\n");
    return 2;
  }
  std::string mode = argv[1];
  ptk::DataArgs args;
  args.data_path = {argv[2]};
  args.split = argv[8];
  args.sizes = {std::stoll(argv[5]), std::stoll(argv[6]), std::stoll(argv[7])};
  ptk::GPTDatasetConfig cfg;
  cfg.sequence_length = std::stoll(argv[4]);
  cfg.tokenizer = ptk::Gpt2TokenizerIdentifiers("gpt2-vocab.json", "gpt2-merges.txt");
  cfg.path_to_cache = argv[3];
  auto t0 = std::chrono::steady_clock::now();
  auto sets = ptk::BuildGPTDatasets(args, cfg);
  double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!sets.ok()) {
    std::fprintf(stderr, "%s\n", std::string(sets.status().message()).c_str());
    return 1;
  }
  if (mode == "build") {
    std::printf("{\"build_s\": %.6f, \"train_samples\": %lld}\n", build_s, static_cast<long long>((*sets)[0]->size()));
    return 0;
  }
  const int64_t mbs = argc > 9 ? std::stoll(argv[9]) : 8, batches = argc > 10 ? std::stoll(argv[10]) : 200;
  auto train = (*sets)[0];
  ptk::DataLoader loader(train, ptk::PretrainingSampler(train->size(), 0, mbs, 0, 1), mbs, 8);
  t0 = std::chrono::steady_clock::now();
  int64_t n = 0;
  for (int64_t b = 0; b < batches; ++b) {
    auto mb = loader.Next();
    if (!mb.ok() || !*mb) break;
    n += mbs;
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"samples_per_s\": %.1f, \"tokens_per_s\": %.1f}\n", n / s, n * cfg.sequence_length / s);
  return 0;
}
