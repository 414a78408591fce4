// Multi-latent attention's host side on the CUDA backend (mla_plan.h).
#include "trainer/cuda/mla_plan.h"

#include <algorithm>

namespace ptk::cuda {
namespace {
constexpr int64_t kAlign = 256;  // MemoryPlan::kAlignment
int64_t Align(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Appends `bytes` at the next aligned offset of a region.
struct Region {
  int64_t end = 0;
  int64_t operator()(int64_t bytes) {
    const int64_t at = end;
    end += Align(bytes);
    return at;
  }
};
}  // namespace

MlaShape MlaShapeOf(const GPTConfig& cf, int64_t b, int64_t t, int64_t tensor, int64_t act_bytes) {
  MlaShape s;
  s.n = b * t;
  s.t = t;
  s.c = cf.hidden_size;
  s.heads = cf.num_attention_heads / std::max<int64_t>(1, tensor);
  s.q_lora = cf.q_lora_rank;
  s.kv_lora = cf.kv_lora_rank;
  s.qk = cf.qk_head_dim;
  s.pe = cf.qk_pos_emb_head_dim;
  s.v = cf.v_head_dim;
  s.norms = cf.qk_layernorm;
  s.rms = cf.normalization == Normalization::kRMSNorm;
  s.act_bytes = act_bytes;
  return s;
}

MlaBuffers PlanMlaBuffers(const MlaShape& s) {
  MlaBuffers m;
  const int64_t n = s.n, a = s.act_bytes, stats = s.norms ? (s.rms ? n : 2 * n) : 0;
  Region saved;
  if (s.q_lora > 0) {
    m.qd = saved(n * s.q_lora * a);
    m.qn = s.norms ? saved(n * s.q_lora * a) : m.qd;
    if (s.norms) m.q_stats = saved(stats * 4);
    m.saved_values += (s.norms ? 2 : 1) * n * s.q_lora;
    m.saved_stats += stats;
  }
  m.kvd = saved(n * s.kv_down_rows() * a);
  m.kvc = saved(n * s.kv_lora * a);
  m.kvn = s.norms ? saved(n * s.kv_lora * a) : m.kvc;
  if (s.norms) m.kv_stats = saved(stats * 4);
  m.saved_values += n * s.kv_down_rows() + (s.norms ? 2 : 1) * n * s.kv_lora;
  m.saved_stats += stats;
  m.saved_bytes = saved.end;
  Region scratch;
  m.q = scratch(n * s.q_rows() * a);
  m.kvu = scratch(n * s.kv_up_rows() * a);
  m.dkvd = scratch(n * s.kv_down_rows() * a);
  m.dkvn = scratch(n * s.kv_lora * a);
  m.dkvc = s.norms ? scratch(n * s.kv_lora * a) : m.dkvn;
  if (s.q_lora > 0) {
    m.dqn = scratch(n * s.q_lora * a);
    m.dqd = s.norms ? scratch(n * s.q_lora * a) : m.dqn;
  }
  m.scratch_bytes = scratch.end;
  return m;
}

int64_t MlaWidestNorm(const GPTConfig& cf) {
  if (!cf.mla() || !cf.qk_layernorm) return 0;
  return std::max(cf.q_lora_rank, cf.kv_lora_rank);
}

}  // namespace ptk::cuda
