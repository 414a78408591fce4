// Build-time generator of the GPT-2 tables embedded in ptk::tokenizer: builds the tokenizer from
// the shipped vocab and merges (compiled in), checks that the blob reads back to the same tables,
// and writes it. Gpt2Tokenizer::LoadDefault then reads the tables where they lie in the binary.
// Usage: gen_gpt2_tables OUT.bin
#include <cstdio>

#include "common/atomic_file.h"
#include "common/status.h"
#include "tokenizer/gpt2_tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: gen_gpt2_tables OUT.bin\n");
    return 2;
  }
  auto tok = ptk::Gpt2Tokenizer::FromStrings(ptk::Gpt2Tokenizer::DefaultVocabJson(),
                                             ptk::Gpt2Tokenizer::DefaultMergesTxt(), "built-in gpt2");
  if (!tok.ok()) {
    std::fprintf(stderr, "gen_gpt2_tables: %s\n", std::string(ptk::StatusMessage(tok.status())).c_str());
    return 1;
  }
  const std::string blob = (*tok)->SerializeTables();
  auto back = ptk::Gpt2Tokenizer::FromTables(blob);
  if (!back.ok() || (*back)->SerializeTables() != blob) {
    std::fprintf(stderr, "gen_gpt2_tables: the tables do not read back\n");
    return 1;
  }
  absl::Status st = ptk::WriteFileAtomic(argv[1], blob, /*durable=*/false);
  if (!st.ok()) {
    std::fprintf(stderr, "gen_gpt2_tables: %s\n", std::string(ptk::StatusMessage(st)).c_str());
    return 1;
  }
  return 0;
}
