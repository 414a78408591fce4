// numpy.random.RandomState(seed) as Megatron uses it: MT19937 seeded like std::mt19937(seed), and
// the legacy RandomState.shuffle (Fisher-Yates with numpy's masked rejection sampling), so that
// shuffles are identical to numpy's element for element.
#pragma once

#include <cstdint>
#include <random>
#include <utility>

namespace ptk {

class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : gen_(seed) {}

  // numpy's legacy random_interval(max): uniform in [0, max].
  uint64_t RandomInterval(uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    uint64_t value;
    if (max <= 0xFFFFFFFFull) {
      while ((value = (static_cast<uint64_t>(gen_()) & mask)) > max) {
      }
    } else {
      while ((value = (Next64() & mask)) > max) {
      }
    }
    return value;
  }

  // RandomState.shuffle of a 1-D array.
  template <typename T>
  void Shuffle(T* x, size_t n) {
    if (n < 2) return;
    for (size_t i = n - 1; i >= 1; --i) {
      size_t j = static_cast<size_t>(RandomInterval(i));
      std::swap(x[i], x[j]);
    }
  }

 private:
  uint64_t Next64() {
    uint64_t hi = gen_();
    uint64_t lo = gen_();
    return (hi << 32) | lo;
  }
  std::mt19937 gen_;
};

}  // namespace ptk
