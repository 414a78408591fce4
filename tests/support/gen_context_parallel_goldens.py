"""Writes megatron-core's context-parallel goldens: its process groups with a context-parallel size
(RankGenerator, order "tp-cp-ep-dp-pp", as initialize_model_parallel makes them) and the positions
get_batch_on_this_cp_rank keeps on each context rank (the sequence in 2·CP chunks, rank r keeping
chunks r and 2·CP − 1 − r), both by megatron-core's own code (its parallel_state's rank queries
answered for each rank in turn; nothing of its logic is replaced).

Usage (megatron-core 0.16.1 and PyTorch 2):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_context_parallel_goldens.py \\
      > tests/data/trainer/context_parallel_goldens.txt
Lines: "layout WORLD TENSOR PIPELINE CONTEXT KIND GROUP;GROUP;..." (GROUP: comma-separated global ranks) and
"split SEQ CONTEXT RANK POSITION,POSITION,..." (the positions of the rank's rows, in order).
"""
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from megatron.core import parallel_state, utils  # noqa: E402

LAYOUTS = [(2, 1, 1, 2), (4, 1, 1, 2), (4, 1, 1, 4), (4, 2, 1, 2), (8, 2, 1, 2), (8, 2, 2, 2), (16, 2, 2, 2),
           (24, 2, 3, 2), (16, 1, 2, 4), (32, 2, 2, 4), (24, 1, 4, 2), (48, 2, 2, 3)]
# initialize_model_parallel's tokens: dp, dp-cp, cp, tp-pp (model parallel), tp, pp; the embedding
# group from each pipeline group.
KINDS = [("tensor", "tp"), ("context", "cp"), ("data", "dp"), ("data-context", "dp-cp"), ("pipeline", "pp"),
         ("model", "tp-pp")]
SPLITS = [(8, 2), (16, 2), (32, 2), (32, 4), (24, 3), (64, 8)]


def layouts():
    for world, tp, pp, cp in LAYOUTS:
        gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp,
                                           order="tp-cp-ep-dp-pp")
        groups = {kind: gen.get_ranks(token) for kind, token in KINDS}
        groups["embedding"] = [parallel_state.default_embedding_ranks(r) for r in groups["pipeline"]]
        for kind in ("tensor", "context", "data", "data-context", "pipeline", "embedding", "model"):
            text = ";".join(",".join(str(r) for r in g) for g in groups[kind])
            print(f"layout {world} {tp} {pp} {cp} {kind} {text}")


def splits():
    for seq, cp in SPLITS:
        for rank in range(cp):
            parallel_state.get_context_parallel_world_size = lambda cp=cp: cp
            parallel_state.get_context_parallel_rank = lambda rank=rank: rank
            # Two samples: the second's positions offset by 1000, so a mix-up of samples shows.
            positions = torch.arange(seq, dtype=torch.int64).repeat(2, 1)
            positions[1] += 1000
            batch = utils.get_batch_on_this_cp_rank({"position_ids": positions.clone(), "attention_mask": None})
            got = batch["position_ids"]
            assert got.shape == (2, seq // cp) and torch.equal(got[1], got[0] + 1000), got
            print(f"split {seq} {cp} {rank} {','.join(str(int(p)) for p in got[0])}")


if __name__ == "__main__":
    layouts()
    splits()
