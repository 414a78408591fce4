"""Writes Megatron-core's process groups for a few (world, tensor, pipeline) layouts, made by
megatron-core's own RankGenerator (megatron/core/parallel_state.py, order "tp-cp-ep-dp-pp"), in the
order initialize_model_parallel creates them.

parallel_state.py imports torch (and torch >= 2 pieces) at its top; the rank arithmetic does not
need it. So the module's source is parsed and only Megatron's own definitions of
generate_masked_orthogonal_rank_groups, RankGenerator and default_embedding_ranks are executed,
unchanged. Nothing of Megatron's logic is replaced.

Usage: /usr/bin/python3 tests/support/gen_parallel_layout_golden.py > tests/data/trainer/parallel_layout_groups.txt
(megatron-core 0.16.1 under /opt/ptk-pyref or on PTK_PYREF_DIR: scripts/install-deps.sh --with-python-ref).
Each line: WORLD TENSOR PIPELINE KIND GROUP;GROUP;... with GROUP the comma-separated global ranks.

With --expert: the expert groups (tensor and context size 1) of initialize_model_parallel's
expert_decoder_rank_generator, RankGenerator(tp=1, ep=E, dp=world // (E * pipeline), pp, cp=1), its
get_ranks('ep') and get_ranks('dp'), into tests/data/trainer/parallel_layout_expert_groups.txt; each line
WORLD PIPELINE EXPERT KIND GROUP;GROUP;... (KIND expert or expert-data).

With --expert-context: the same generator's groups where the dense layout has context or tensor ranks (megatron-core
builds the expert mesh with cp=1 whatever --context-parallel-size is: its expert ranks come from the data x
context ranks), into tests/data/trainer/parallel_layout_expert_context_groups.txt; each line
WORLD TENSOR CONTEXT PIPELINE EXPERT KIND GROUP;GROUP;... (the expert tensor size the tensor size, Megatron's
default --expert-tensor-parallel-size).
"""
import ast
import os
import sys
import typing

LAYOUTS = [(1, 1, 1), (8, 1, 1), (8, 8, 1), (8, 2, 1), (8, 2, 2), (16, 2, 4), (24, 2, 3), (32, 8, 2), (16, 4, 4),
           (12, 3, 2), (1024, 8, 16)]
# initialize_model_parallel: get_ranks('dp'), get_ranks('tp-pp') (model parallel), get_ranks('tp'),
# get_ranks('pp') and, for each pipeline group, get_embedding_ranks(ranks).
KINDS = [("data", "dp"), ("model", "tp-pp"), ("tensor", "tp"), ("pipeline", "pp")]
WANTED = ("generate_masked_orthogonal_rank_groups", "RankGenerator", "default_embedding_ranks")


def load_megatron():
    for p in ("/opt/ptk-pyref", os.environ.get("PTK_PYREF_DIR", "")) + tuple(sys.path):
        path = os.path.join(p or ".", "megatron", "core", "parallel_state.py")
        if os.path.exists(path):
            break
    else:
        raise SystemExit("megatron-core is not installed: scripts/install-deps.sh --with-python-ref")
    tree = ast.parse(open(path).read(), path)
    body = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in WANTED]
    if len(body) != len(WANTED):
        raise SystemExit(f"{path}: expected definitions {WANTED}, found {[n.name for n in body]}")
    ns = {name: getattr(typing, name) for name in ("List", "Optional", "Callable")}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    return ns


EXPERT_LAYOUTS = [(2, 1, 2), (4, 1, 2), (4, 1, 4), (8, 1, 2), (8, 2, 2), (16, 2, 4), (12, 3, 2)]


def main_expert(mg):
    for world, pp, ep in EXPERT_LAYOUTS:
        gen = mg["RankGenerator"](tp=1, ep=ep, dp=world // (ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        for kind, token in (("expert", "ep"), ("expert-data", "dp")):
            text = ";".join(",".join(str(r) for r in g) for g in gen.get_ranks(token))
            print(f"{world} {pp} {ep} {kind} {text}")


# (world, tensor, context, pipeline, expert): E dividing data x context but not always data; with tensor ranks the
# expert tensor size is the tensor size (Megatron's default --expert-tensor-parallel-size).
EXPERT_CONTEXT_LAYOUTS = [(2, 1, 2, 1, 2), (4, 1, 2, 1, 2), (4, 1, 2, 1, 4), (4, 1, 4, 1, 2), (8, 1, 2, 1, 4),
                          (8, 1, 2, 2, 2), (8, 1, 4, 1, 2), (12, 1, 2, 2, 3), (16, 1, 2, 2, 4), (16, 1, 4, 2, 8),
                          (4, 2, 1, 1, 2), (8, 2, 1, 1, 2), (8, 2, 1, 1, 4), (8, 2, 2, 1, 2), (16, 2, 2, 2, 2),
                          (16, 2, 1, 2, 4), (24, 2, 2, 2, 3), (16, 4, 2, 1, 2)]


def main_expert_context(mg):
    for world, tp, cp, pp, ep in EXPERT_CONTEXT_LAYOUTS:
        assert world % (tp * cp * pp) == 0 and (world // (tp * pp)) % ep == 0
        gen = mg["RankGenerator"](tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        for kind, token in (("expert", "ep"), ("expert-data", "dp")):
            text = ";".join(",".join(str(r) for r in g) for g in gen.get_ranks(token))
            print(f"{world} {tp} {cp} {pp} {ep} {kind} {text}")


def main():
    mg = load_megatron()
    if sys.argv[1:] == ["--expert"]:
        return main_expert(mg)
    if sys.argv[1:] == ["--expert-context"]:
        return main_expert_context(mg)
    for world, tp, pp in LAYOUTS:
        gen = mg["RankGenerator"](tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        groups = {kind: gen.get_ranks(token) for kind, token in KINDS}
        groups["embedding"] = [mg["default_embedding_ranks"](r) for r in groups["pipeline"]]
        for kind in ("tensor", "data", "pipeline", "embedding", "model"):
            text = ";".join(",".join(str(r) for r in g) for g in groups[kind])
            print(f"{world} {tp} {pp} {kind} {text}")


if __name__ == "__main__":
    main()
