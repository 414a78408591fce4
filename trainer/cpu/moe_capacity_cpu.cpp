// Token dropping over the experts' capacity (moe_capacity_cpu.h).
#include "trainer/cpu/moe_capacity_cpu.h"

#include <algorithm>
#include <cmath>

#include "common/status.h"

namespace ptk::cpu {

int64_t MoeExpertCapacity(int64_t tokens, int64_t topk, int64_t experts, double factor) {
  const double per_expert = static_cast<double>(tokens * topk) / static_cast<double>(experts);
  return static_cast<int64_t>(std::ceil(per_expert * factor));
}

int64_t MegatronTokenIndex(int64_t row, int64_t n, int64_t sample_rows) {
  return row % sample_rows * (n / sample_rows) + row / sample_rows;
}

template <typename T>
int64_t MoeDropOverCapacity(std::vector<uint8_t>* dropped, const T* prob, const int32_t* expert, int64_t n, int64_t K,
                            int64_t E, int64_t capacity, bool by_position, int64_t sample_rows) {
  PTK_CHECK(sample_rows >= 1 && n % sample_rows == 0 && capacity >= 0);
  dropped->assign(static_cast<size_t>(n * K), 0);
  if (capacity >= n) return 0;
  // Each expert's slots, then the order it keeps them in.
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(E));
  for (int64_t i = 0; i < n * K; ++i) slots[static_cast<size_t>(expert[i])].push_back(i);
  auto token = [&](int64_t slot) { return MegatronTokenIndex(slot / K, n, sample_rows); };
  int64_t count = 0;
  for (std::vector<int64_t>& mine : slots) {
    if (static_cast<int64_t>(mine.size()) <= capacity) continue;
    std::sort(mine.begin(), mine.end(), [&](int64_t a, int64_t b) {
      if (!by_position && prob[a] != prob[b]) return prob[a] > prob[b];
      return token(a) < token(b);
    });
    for (size_t j = static_cast<size_t>(capacity); j < mine.size(); ++j) (*dropped)[static_cast<size_t>(mine[j])] = 1;
    count += static_cast<int64_t>(mine.size()) - capacity;
  }
  return count;
}

template int64_t MoeDropOverCapacity<float>(std::vector<uint8_t>*, const float*, const int32_t*, int64_t, int64_t,
                                            int64_t, int64_t, bool, int64_t);
template int64_t MoeDropOverCapacity<double>(std::vector<uint8_t>*, const double*, const int32_t*, int64_t, int64_t,
                                             int64_t, int64_t, bool, int64_t);

}  // namespace ptk::cpu
