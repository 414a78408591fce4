// The counter-based random numbers of the trainer, one definition for host and device: dropout
// masks (a pure function of seed, stream and element index) and the init normals. Nothing here
// keeps state, so a mask comes out the same in backward, in recomputation, on any thread count
// and on either backend.
#pragma once

#include <cmath>
#include <cstdint>

#include "trainer/host_device.h"

namespace ptk {

PTK_HD uint64_t Mix64(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The key of one dropout stream under `seed`; DropoutKeepKeyed tests one element of it.
PTK_HD uint64_t DropoutKey(uint64_t seed, uint64_t stream) {
  return Mix64(seed * 0x9e3779b97f4a7c15ULL + Mix64(stream + 0x632be59bd9b4e019ULL));
}
PTK_HD bool DropoutKeepKeyed(uint64_t key, uint64_t i, uint32_t threshold) {
  return static_cast<uint32_t>(Mix64(key + i * 0x9e3779b97f4a7c15ULL) >> 32) < threshold;
}
// Element i of stream `stream` is kept when the top 32 bits of its hash fall below `threshold`.
PTK_HD bool DropoutKeep(uint64_t seed, uint64_t stream, uint64_t i, uint32_t threshold) {
  return DropoutKeepKeyed(DropoutKey(seed, stream), i, threshold);
}
// The stream of one dropout site of one sample: the global sample position (so a mask does not
// depend on the micro-batch size or the data-parallel layout), the layer and the site.
PTK_HD uint64_t DropoutStream(uint64_t sample, uint64_t layer, uint64_t site) {
  return Mix64(Mix64(sample + 0x2545f4914f6cdd1dULL) ^ (layer << 32) ^ (site << 16));
}
// Where token row `row` of a (samples * seq_len, c) activation lies in the hidden dropout masks:
// its sample (whose stream is the sample's entry of the site's stream table) and the index of its
// element 0 within the sample's (seq_len, c) block; element j is tested at first + j. The same
// numbering as a dropout pass over each sample's row of seq_len * c elements (the CPU model's
// Dropout, the CUDA DropoutRows), so the LayerNorm kernels that fuse the masks drop exactly those.
struct TokenDropoutIndex {
  int64_t sample;
  uint64_t first;
};
PTK_HD TokenDropoutIndex TokenDropoutAt(int64_t row, int64_t seq_len, int64_t c) {
  const int64_t sample = row / seq_len;
  return {sample, static_cast<uint64_t>((row - sample * seq_len) * c)};
}
// keep when the 32-bit hash < threshold; p = 0 keeps everything.
inline uint32_t DropoutKeepThreshold(double p) {
  double keep = 1.0 - p;
  if (keep >= 1.0) return 0xffffffffu;
  return static_cast<uint32_t>(std::ldexp(keep, 32));
}

// The key of parameter tensor k's init stream under `seed`.
PTK_HD uint64_t InitKey(uint64_t seed, uint64_t k) { return Mix64(seed * 0x9e3779b97f4a7c15ULL + k + 1); }
// Standard normal number i of stream `key` (Box-Muller on two 53-bit uniforms). Weights are drawn
// on the host and copied to a device, so both backends start from the same bits.
inline double CounterNormal(uint64_t key, uint64_t i) {
  uint64_t a = Mix64(key + 2 * i * 0x9e3779b97f4a7c15ULL), b = Mix64(key + (2 * i + 1) * 0x9e3779b97f4a7c15ULL);
  double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Number i of stream `key` uniform in [-1, 1) (a 53-bit uniform, 2u - 1): xavier-uniform's draws,
// on the host as CounterNormal's.
inline double CounterUniformSymmetric(uint64_t key, uint64_t i) {
  const uint64_t a = Mix64(key + 2 * i * 0x9e3779b97f4a7c15ULL);
  return static_cast<double>(a >> 11) * 0x1.0p-52 - 1.0;
}

// Dropout sites within a layer (the stream's `site`); attention probabilities key per head.
enum DropoutSite : uint64_t {
  kEmbeddingDropout = 0,
  kAttentionOutDropout = 1,
  kMlpOutDropout = 2,
  kAttentionProbs = 3
};

}  // namespace ptk
