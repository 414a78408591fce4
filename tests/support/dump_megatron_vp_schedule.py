"""Writes the order of the forward and backward passes of megatron-core's interleaved (virtual pipeline)
schedule on every pipeline rank, for a few (pipeline size P, model chunks V, micro-batches M, micro-batch
group size N = --microbatch-group-size-per-virtual-pipeline-stage) cases: the golden of
tests/trainer/pipeline_interleaved_test.cpp (ptk's InterleavedOrder must give the same passes).

megatron-core's own functions make each rank's order, unchanged:
  get_schedule_table(M, V, N)                     the (micro-batch, chunk) of each virtual micro-batch
  get_pp_rank_microbatches(M, V, N, ...)          the rank's warm-up forwards
  convert_schedule_table_to_order(warmup, V, t)   the rank's passes: +c a forward of chunk c - 1,
                                                  -c a backward of chunk c - 1 (1-based chunk ids)
forward_backward_pipelining_with_interleaving runs its passes in this order (a forward per virtual
micro-batch of the table, the backwards after the warm-up). A forward's micro-batch is the table's; a
backward's is the oldest forward of its chunk still waiting for one (the schedule keeps each chunk's
inputs and outputs in a list it pops from the front), which this script counts.

get_pp_rank_microbatches reads only the pipeline group's size and rank and the virtual pipeline size
from the communicator it is given, so it is given those three (no process group is started: the
order of one rank depends on nothing else).

Usage (megatron-core 0.16.1 under /opt/ptk-pyref, PyTorch from /opt/ptk-torch26):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/dump_megatron_vp_schedule.py \\
      > tests/data/trainer/megatron_vp_schedule.txt
Each line: P V M N RANK WARMUP then the passes, F<micro-batch>.<chunk> or B<micro-batch>.<chunk> (chunks
from 0).
"""
import sys
import types
import warnings

warnings.filterwarnings("ignore")

from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table  # noqa: E402
from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order  # noqa: E402

# (P, V, M, N): the default N = P, the docstring's examples (P = 2, V = 2: N 2 of M 4, N 3 of M 5), a
# last group shorter than N but of at least P, N = M (one group: every chunk's forwards of the step
# before the next chunk's), M not a multiple of P, and steps that are all warm-up on some ranks.
CASES = [
    (2, 2, 4, 2), (2, 2, 5, 3), (2, 2, 8, 2), (2, 2, 8, 3), (2, 2, 8, 4), (2, 2, 8, 8), (2, 3, 6, 4), (2, 4, 6, 3),
    (3, 2, 6, 3), (3, 2, 7, 4), (3, 3, 9, 5), (4, 2, 4, 4), (4, 2, 8, 4), (4, 2, 8, 8), (4, 2, 9, 5), (4, 2, 12, 6),
    (4, 3, 10, 6), (4, 4, 16, 4), (8, 2, 16, 8), (8, 2, 20, 12),
]


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def rank_passes(P, V, M, N, rank):
    comm = types.SimpleNamespace(pp_group=_Group(P, rank), virtual_pipeline_model_parallel_size=V)
    total, _, warmup, _ = get_pp_rank_microbatches(M, V, N, forward_only=False, p2p_communicator=comm)
    assert total == M * V
    table = get_schedule_table(M, V, N)
    order = convert_schedule_table_to_order(warmup, V, table)
    assert len(order) == 2 * total
    passes, forwards, backwards = [], 0, [0] * V
    for op in order:
        if op > 0:
            mb, chunk = table[forwards]
            assert chunk == op - 1
            forwards += 1
            passes.append(f"F{mb}.{chunk}")
        else:
            chunk = -op - 1
            passes.append(f"B{backwards[chunk]}.{chunk}")
            backwards[chunk] += 1
    assert forwards == total and backwards == [M] * V
    return warmup, passes


def main():
    out = sys.stdout
    out.write("# megatron-core's interleaved schedule per rank: P V M N RANK WARMUP passes "
              "(tests/support/dump_megatron_vp_schedule.py)\n")
    for P, V, M, N in CASES:
        for rank in range(P):
            warmup, passes = rank_passes(P, V, M, N, rank)
            out.write(f"{P} {V} {M} {N} {rank} {warmup} {' '.join(passes)}\n")


if __name__ == "__main__":
    main()
