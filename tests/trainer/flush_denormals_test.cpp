// The CPU matrix products flush denormals (flush_denormals.h): a run whose weights blew up (--lr 1e6)
// spent 100 times longer per iteration in them. Only the product's own thread, only while it computes.
#include "trainer/cpu/flush_denormals.h"

#include <cfloat>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/cpu/ops_cpu.h"

namespace ptk {
namespace {

float Denormal() { return FLT_MIN / 1024.0f; }  // 1.1e-41

TEST(FlushDenormals, GemmTakesDenormalOperandsAsZero) {
  // 1.1e-41 x 1e30 is 1.1e-11, a normal float: only an operand read as 0 gives 0.
  const std::vector<float> a = {Denormal(), 1.0f}, b = {1e30f, 0.0f};
  std::vector<float> c(1, 5.0f);
  cpu::Gemm<float>(false, false, 1, 1, 2, 1.0f, a.data(), 2, b.data(), 1, 0.0f, c.data(), 1);
  EXPECT_EQ(c[0], 0.0f);
}

TEST(FlushDenormals, GemmFlushesDenormalResults) {
  const std::vector<float> a = {1e-20f}, b = {1e-20f};  // 1e-40: a denormal result, written as 0
  std::vector<float> c(1, 5.0f);
  cpu::Gemm<float>(false, false, 1, 1, 1, 1.0f, a.data(), 1, b.data(), 1, 0.0f, c.data(), 1);
  EXPECT_EQ(c[0], 0.0f);
}

// The smallest normal floats are kept, operands and results.
TEST(FlushDenormals, TheSmallestNormalsAreKept) {
  const std::vector<float> a = {FLT_MIN, 2.0f * FLT_MIN}, b = {1.0f, 0.5f};
  std::vector<float> c(1, 0.0f);
  cpu::Gemm<float>(false, false, 1, 1, 2, 1.0f, a.data(), 2, b.data(), 1, 0.0f, c.data(), 1);
  EXPECT_EQ(c[0], 2.0f * FLT_MIN);
}

// The caller's thread keeps its own floating-point state: denormals still there after a product, on
// this thread and on any other.
TEST(FlushDenormals, TheCallersStateIsLeftAsItWas) {
  const std::vector<float> a = {Denormal()}, b = {1e30f};
  std::vector<float> c(1, 0.0f);
  cpu::Gemm<float>(false, false, 1, 1, 1, 1.0f, a.data(), 1, b.data(), 1, 0.0f, c.data(), 1);
  volatile float tiny = 1e-20f;
  EXPECT_GT(tiny * tiny, 0.0f);  // a denormal result, not flushed
  volatile float d = Denormal();
  EXPECT_GT(d * 1e30f, 1e-12f);  // a denormal operand, not read as 0
  float other = 0.0f;
  std::thread([&] {
    volatile float t = 1e-20f;
    other = t * t;
  }).join();
  EXPECT_GT(other, 0.0f);
  {
    const cpu::ScopedFlushDenormals flush;
    EXPECT_EQ(tiny * tiny, 0.0f);
  }
  EXPECT_GT(tiny * tiny, 0.0f);
}

}  // namespace
}  // namespace ptk
