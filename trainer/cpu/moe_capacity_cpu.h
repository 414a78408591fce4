// Megatron-core's token dropping for the mixture-of-experts router (--moe-expert-capacity-factor,
// apply_router_token_dropping): each expert takes at most `capacity` of the slots routed to it, the others
// are dropped: they reach no expert (no output, no expert gradient) and their probability's gradient is zero,
// while the kept probabilities stay what the router computed (their softmax or normalisation still over all
// k chosen experts, so the dropped logits keep their share of the gradient through them). The
// load-balancing loss counts the routing before the drop (Megatron's routing_map_for_aux_loss).
#pragma once

#include <cstdint>
#include <vector>

namespace ptk::cpu {

// Megatron's get_capacity over the router's tokens: ceil(tokens x topk / experts x factor), computed in double
// as Python computes (tokens·topk / experts) · factor.
int64_t MoeExpertCapacity(int64_t tokens, int64_t topk, int64_t experts, double factor);

// The token order Megatron's router sees: its tokens are [sequence, micro-batch] flattened, ptk's rows
// [micro-batch, sequence]: row i of n (sample_rows positions per sample) is Megatron's token
// (i % sample_rows) · (n / sample_rows) + i / sample_rows.
int64_t MegatronTokenIndex(int64_t row, int64_t n, int64_t sample_rows);

// Marks in dropped (n·K, assigned 0/1) the slots (token i's k-th chosen expert expert[i·K + k], probability
// prob[i·K + k]) beyond each expert's capacity. by_position false (Megatron's "probs"): each expert keeps the
// capacity slots of the largest probabilities, among equal ones the earlier Megatron token; true ("position"):
// the capacity earliest Megatron tokens routed to it. Nothing is dropped when capacity >= n (Megatron's
// `expert_capacity > num_tokens`, and at equality its top-k keeps every token). Returns the slots dropped.
template <typename T>
int64_t MoeDropOverCapacity(std::vector<uint8_t>* dropped, const T* prob, const int32_t* expert, int64_t n, int64_t K,
                            int64_t E, int64_t capacity, bool by_position, int64_t sample_rows);

}  // namespace ptk::cpu
