// ptk-tokenize's reader: batches of whole lines, shrinking towards the end of the input when asked.
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dataprep/tokenize/tokenize_stages.h"
#include "tests/dataprep/compress_util.h"
#include "tests/test_util.h"

namespace ptk::tokenize_detail {
namespace {

using ::ptk::testing::TempDir;

// Lines of 1 to ~3,000 bytes (a few long ones) of words from a small list (so that zstd packs them
// several times smaller), newline-terminated.
std::string RandomLines(size_t bytes, uint32_t seed) {
  static const char* kWords[] = {"the ", "quick ", "brown ", "fox ", "jumps ", "over ", "a ", "lazy ", "dog. "};
  std::mt19937 rng(seed);
  std::string s;
  while (s.size() < bytes) {
    const size_t len = rng() % 50 == 0 ? 2000 + rng() % 1000 : 1 + rng() % 300;
    for (const size_t end = s.size() + len; s.size() < end;) s += kWords[rng() % 9];
    s += '\n';
  }
  return s;
}

struct Read {
  std::vector<size_t> sizes;  // bytes per batch
  std::string text;           // the batches' lines, each with its newline again
};

Read ReadAll(const std::string& path, size_t batch_bytes, uint64_t total_raw, double share) {
  const std::vector<std::string> files{path};
  BatchPool pool(4 * batch_bytes + (256 << 10));
  LineReader reader(files, batch_bytes, ReadPoint{}, /*announce=*/false, pool);
  if (share > 0) reader.ShrinkTowardsTheEnd(total_raw, share);
  Read r;
  while (true) {
    auto b = reader.Next();
    EXPECT_TRUE(b.ok()) << b.status();
    if (!b.ok() || !*b) break;
    r.sizes.push_back((*b)->size);
    for (const auto& ln : (*b)->lines) r.text.append((*b)->data.get() + ln.off, ln.len).push_back('\n');
    pool.Give(std::move(*b));
  }
  return r;
}

// Asked to shrink, the reader hands out every line once and in order; the batches keep their size
// until the end nears, then get smaller, the last ones no bigger than kMinTailBatch and a line.
// The same for a compressed input, whose decoded size it estimates from what it has read.
TEST(LineReader, BatchesShrinkTowardsTheEnd) {
  TempDir dir;
  const std::string text = RandomLines(3 << 20, 7);
  const std::string plain = dir / "in.jsonl", packed = dir / "in.jsonl.zst";
  testing::WriteFile(plain, text);
  const std::string z = testing::ZstdCompress(text);
  ASSERT_LT(z.size() * 3, text.size());  // the decoded size must be estimated, not taken as stored
  testing::WriteFile(packed, z);
  const size_t batch = 256 << 10;
  for (const auto& [path, raw] : {std::pair{plain, text.size()}, std::pair{packed, z.size()}}) {
    SCOPED_TRACE(path);
    const Read even = ReadAll(path, batch, raw, 0), tail = ReadAll(path, batch, raw, 0.25);
    EXPECT_EQ(even.text, text);
    EXPECT_EQ(tail.text, text);
    ASSERT_GE(tail.sizes.size(), 4u);
    // Without shrinking every batch but the last is about `batch`.
    for (size_t i = 0; i + 1 < even.sizes.size(); ++i) EXPECT_GE(even.sizes[i], batch) << i;
    // With it: more batches, the first as big, the last four small; for a plain file (whose size
    // is what it decodes to) none bigger than the one before once they shrink (but for a line's
    // length and the read past the target).
    EXPECT_GT(tail.sizes.size(), even.sizes.size() + 3);
    EXPECT_GE(tail.sizes.front(), batch);
    // They shrink only as the end nears (less than four batches' worth left): at least half of a
    // plain file comes in whole batches, and a quarter of a compressed one (whose decoder reads
    // ahead, so its decoded size left is underestimated; taken as stored, nearly none would).
    size_t whole = 0;
    for (size_t n : tail.sizes) whole += n >= batch ? n : 0;
    EXPECT_GE(whole * (path == plain ? 2 : 4), text.size());
    for (size_t i = 1; i < tail.sizes.size() && path == plain; ++i)
      if (tail.sizes[i - 1] < batch) {
        EXPECT_LE(tail.sizes[i], tail.sizes[i - 1] + (16 << 10) + 3000) << i;
      }
    for (size_t i = tail.sizes.size() - 4; i < tail.sizes.size(); ++i)
      EXPECT_LE(tail.sizes[i], LineReader::kMinTailBatch + (16 << 10) + 3000) << i;
  }
}

}  // namespace
}  // namespace ptk::tokenize_detail
