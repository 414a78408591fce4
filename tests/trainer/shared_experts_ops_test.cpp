// The shared experts' CPU op (trainer/cpu/shared_experts_cpu.h): the forward against its definition (an MLP
// without biases added to the output, with the gate scaled by sigmoid(x . gate_weight)), and the backward of the
// input, fc1, fc2 and gate weights against central finite differences in double precision, for each activation.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gradient_check.h"
#include "trainer/cpu/shared_experts_cpu.h"

namespace ptk {
namespace {

using cpu::MlpActivation;
using cpu::SharedExpertActivations;
using cpu::SharedExpertSettings;
using testing::CheckGradient;
using testing::Dot;
using testing::Random;

TEST(SharedExpertOps, ForwardAddsTheGatedMlpToTheOutput) {
  const int64_t n = 3, c = 4;
  SharedExpertSettings s;
  s.ffn = 2;
  s.activation = MlpActivation::kSquaredRelu;
  auto x = Random(n * c, 1), w1 = Random(s.ffn * c, 2), w2 = Random(c * s.ffn, 3), wg = Random(c, 4);
  for (bool gate : {false, true}) {
    s.gate = gate;
    std::vector<double> out(n * c, 1.0);  // added to
    SharedExpertActivations<double> a;
    cpu::SharedExpertForward(out.data(), &a, x.data(), w1.data(), w2.data(), gate ? wg.data() : nullptr, n, c, s);
    for (int64_t i = 0; i < n; ++i) {
      double logit = 0;
      for (int64_t j = 0; j < c; ++j) logit += x[i * c + j] * wg[j];
      const double g = gate ? 1 / (1 + std::exp(-logit)) : 1.0;
      for (int64_t o = 0; o < c; ++o) {
        double y = 0;
        for (int64_t k = 0; k < s.ffn; ++k) {
          double h = 0;
          for (int64_t j = 0; j < c; ++j) h += x[i * c + j] * w1[k * c + j];
          y += (h > 0 ? h * h : 0.0) * w2[o * s.ffn + k];
        }
        EXPECT_NEAR(out[i * c + o], 1.0 + g * y, 1e-12) << gate << " " << i << " " << o;
      }
    }
  }
}

// sum(out * r): every gradient against finite differences.
void CheckGradients(MlpActivation act, bool gate) {
  const int64_t n = 5, c = 4;
  SharedExpertSettings s;
  s.ffn = 3;
  s.gate = gate;
  s.activation = act;
  auto x = Random(n * c, 11), w1 = Random(s.fc1_rows() * c, 12, 0.5), w2 = Random(c * s.ffn, 13, 0.5),
       wg = Random(c, 14), r = Random(n * c, 15);
  auto objective = [&] {
    std::vector<double> out(n * c, 0.0);
    SharedExpertActivations<double> a;
    cpu::SharedExpertForward(out.data(), &a, x.data(), w1.data(), w2.data(), gate ? wg.data() : nullptr, n, c, s);
    return Dot(out, r);
  };
  std::vector<double> out(n * c, 0.0), dx(n * c, 0.0), dw1(w1.size(), 0.0), dw2(w2.size(), 0.0), dwg(c, 0.0);
  SharedExpertActivations<double> a;
  cpu::SharedExpertForward(out.data(), &a, x.data(), w1.data(), w2.data(), gate ? wg.data() : nullptr, n, c, s);
  cpu::SharedExpertBackward(dx.data(), dw1.data(), dw2.data(), gate ? dwg.data() : nullptr, r.data(), &a, x.data(),
                            w1.data(), w2.data(), gate ? wg.data() : nullptr, n, c, s);
  EXPECT_EQ(a.Floats(), cpu::SharedExpertActivationFloats(s, n, c));  // what the model's plan counts after a pass
  CheckGradient(x, dx, objective, "dx");
  CheckGradient(w1, dw1, objective, "dw_fc1");
  CheckGradient(w2, dw2, objective, "dw_fc2");
  if (gate) CheckGradient(wg, dwg, objective, "dw_gate");
}

TEST(SharedExpertOps, GradientsMatchFiniteDifferences) {
  for (MlpActivation act :
       {MlpActivation::kGelu, MlpActivation::kGeluExact, MlpActivation::kSquaredRelu, MlpActivation::kSwiglu})
    for (bool gate : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "activation " << static_cast<int>(act) << " gate " << gate);
      CheckGradients(act, gate);
    }
}

}  // namespace
}  // namespace ptk
