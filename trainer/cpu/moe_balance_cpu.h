// The MoE router's load-balancing losses whose token counts span a group of ranks (megatron-core 0.16.1's
// TopKRouter): aux_loss's and seq_aux_loss's counts over the context ranks (Megatron's tensor x context group; ptk's
// tensor ranks route the gathered rows, so the context group is what is left to sum), global_aux_loss's over the
// data x context ranks, and the z-loss's coefficient on a context rank. Each rank's value and gradient are its own
// tokens' part: their sum over the group is the whole sequence's (or batch's) loss.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "trainer/comm.h"
#include "trainer/cpu/moe_cpu.h"

namespace ptk::cpu {

// aux_loss: a->group_count and group_n the context group's sums of this rank's expert counts and tokens
// (get_tokens_per_expert_and_token_count over the tensor x context group). context: null or one rank: none.
absl::Status MoeContextAuxCounts(MoeActivations<float>* a, const MoeSettings& s, Communicator* context);

// The z-loss's coefficient on each of `context` ranks: Megatron's coefficient over the context ranks
// (router.py's apply_z_loss), each rank's z-loss the mean over its own tokens, so the ranks' gradients add up to
// the whole sequence's mean's. Megatron logs each rank's own mean (tracked without a reduce group).
inline double MoeZLossRankCoeff(double coeff, int context) { return coeff / (context > 1 ? context : 1); }

// seq_aux_loss (router.py's _apply_seq_aux_loss) on a's n rows, samples of `rows` consecutive rows (this rank's
// positions of each): each sample's plain top-k counts summed over the context group, the loss's total tokens the
// whole sequence's (rows x context ranks). Returns this rank's part of the loss without its coefficient (the mean
// over the samples) and adds coeff x its gradient to a->balance_grad (one row of E per sample, sized by the caller).
absl::StatusOr<double> MoeSeqAuxLoss(MoeActivations<float>* a, const MoeSettings& s, int64_t rows, double coeff,
                                     Communicator* context);

// global_aux_loss (router.py's _apply_global_aux_loss): this pass's plain top-k counts summed over `group` (the data
// x context ranks) added to *counts (the step's so far, *steps passes), their mean the loss's counts, its total tokens
// n x the group's ranks. Returns this rank's part without its coefficient and adds coeff x its gradient to every row
// of a->balance_grad.
absl::StatusOr<double> MoeGlobalAuxLoss(MoeActivations<float>* a, const MoeSettings& s, double coeff,
                                        Communicator* group, std::vector<double>* counts, double* steps);

}  // namespace ptk::cpu
