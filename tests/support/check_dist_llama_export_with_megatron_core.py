"""Checks megatron -> ptk -> megatron on the torch_dist fixtures of tests/data/torch_dist_llama/ against
megatron-core itself: each fixture (what megatron-core saved) is imported by `ptk-convert --loader megatron
--saver ptk`, exported again by `ptk-convert --saver megatron --target-use-distributed-optimizer` (Megatron's
`torch` format: model_optim_rng.pt and distrib_optim.pt per rank) at a tensor and pipeline size, and on each rank
(one gloo process per tensor and pipeline rank) megatron-core builds the Llama-line model twice:
  A  loads the fixture with dist_checkpointing.load (megatron-core's own loader of its format), and
  B  loads ptk's export as Megatron-LM's load_checkpoint does for `--ckpt-format torch --use-distributed-optimizer`
     (the model strict from model_optim_rng.pt, the optimizer's load_state_dict, then load_parameter_state of
     distrib_optim.pt: its numel_unpadded check and scatter into each parameter's main param and moments).
Every parameter's model weight, fp32 main param, exp_avg and exp_avg_sq, and Adam's step, must be equal in A and B
bit for bit on every rank. So megatron-core decides on both sides how the ranks' shards and grad buffers hold the
state (the tied output layer's copy on the last stage too); the script compares its own two loads.

Cases:
  tied_pp2_distopt             dp_reshardable, tied over 2 pipeline stages, exported at pipeline size 2
  tied_tp2_pp2_distopt         the same at tensor size 2 x pipeline size 2, exported so
  distopt_tp2_fs_model_space   fully_sharded_model_space at tensor size 2, exported at tensor size 2, and at
                               tensor size 1 (A: megatron-core's TP 1 load of the TP 2 file, which that format
                               reshards)
The fs_model_space cases need megatron-core 0.13.1 (0.16.1 no longer builds that format's sharded tensors); the
dp_reshardable ones 0.16.1. CPU only, run by hand under PyTorch 2.6 (CI's Debian PyTorch 1.13 cannot run
megatron-core):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python \\
      tests/support/check_dist_llama_export_with_megatron_core.py build/bin tied_pp2_distopt tied_tp2_pp2_distopt
  PYTHONPATH=/tmp/mcore013 /opt/ptk-torch26/bin/python \\
      tests/support/check_dist_llama_export_with_megatron_core.py build/bin distopt_tp2_fs_model_space
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_torch_dist_llama_fixture as fx  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "data", "torch_dist_llama")
# fixture -> (its sharding, tied, [(export tensor size, export pipeline size)])
CASES = {
    "tied_pp2_distopt": ("dp_reshardable", True, [(1, 2)]),
    "tied_tp2_pp2_distopt": ("dp_reshardable", True, [(2, 2)]),
    "distopt_tp2_fs_model_space": ("fully_sharded_model_space", False, [(2, 1), (1, 1)]),
}


def load_fixture(gpt, opt, sharding, iter_dir):
    """The fixture loaded by dist_checkpointing.load, as Megatron-LM's load_checkpoint; Adam's step it loaded (its
    param groups': dp_reshardable's per-parameter `step` is megatron-core's LocalNonpersistentObject, the value the
    optimizer held before the load, which torch Adam on the CPU keeps)."""
    import torch
    from megatron.core import dist_checkpointing
    md = fx.sd_metadata(sharding)
    model_sd = {"model": gpt.sharded_state_dict(metadata=md)}
    state = dist_checkpointing.load(dict(model_sd, optimizer=opt.sharded_state_dict(model_sd, is_loading=True,
                                                                                   metadata=md)), iter_dir)
    gpt.load_state_dict(state["model"], strict=False)
    with torch.no_grad():  # an fp32 run's main params are views of the model's (leaf) parameters
        opt.load_state_dict(state["optimizer"])
    groups = state["optimizer"]["optimizer"]["param_groups"]
    return {float(g["step"]) for g in groups}


def load_export(gpt, opt, rank_dir):
    """ptk's export loaded as Megatron-LM's load_checkpoint loads --ckpt-format torch --use-distributed-optimizer."""
    import torch
    sd = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), weights_only=False)
    gpt.load_state_dict(sd["model"], strict=True)
    opt.load_state_dict(sd["optimizer"])
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    # As check_distopt_export_with_megatron_core.py: torch Adam's per-parameter step (the CPU's stand-in for
    # Transformer Engine's FusedAdam) set aside around load_parameter_state, whose file holds none.
    steps = {p: st.pop("step") for p, st in inner.optimizer.state.items() if "step" in st}
    with torch.no_grad():
        opt.load_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    for p, step in steps.items():
        inner.optimizer.state[p]["step"] = step


def compare(gpt_a, opt_a, step_a, gpt_b, opt_b, where):
    inner_a = opt_a.chained_optimizers[0] if hasattr(opt_a, "chained_optimizers") else opt_a
    inner_b = opt_b.chained_optimizers[0] if hasattr(opt_b, "chained_optimizers") else opt_b
    bad, checked = [], 0
    for (name, pa), (name_b, pb) in zip(gpt_a.named_parameters(), gpt_b.named_parameters()):
        assert name == name_b, (name, name_b)
        sa, sb = inner_a._get_main_param_and_optimizer_states(pa), inner_b._get_main_param_and_optimizer_states(pb)
        if not bool(sa["exp_avg_sq"].abs().sum() > 0):  # the fixture's state loaded, not a fresh optimizer's
            bad.append(f"{where}: {name}: megatron-core's load of the fixture has no second moment")
        for key in ("param", "exp_avg", "exp_avg_sq"):
            if sa[key].detach().numpy().tobytes() != sb[key].detach().numpy().tobytes():
                bad.append(f"{where}: {name} {key}")
        if pa.detach().numpy().tobytes() != pb.detach().numpy().tobytes():
            bad.append(f"{where}: {name}: the model's weight")
        checked += 1
    step_b = {float(st["step"]) for st in inner_b.optimizer.state.values()}
    if step_a != step_b or step_a != {float(fx.ITERATION)}:
        bad.append(f"{where}: Adam step {step_b}, megatron-core's load of the fixture {step_a}")
    return bad, checked


def rank(r, tp, pp, fixture, export, store, result):
    import torch
    import torch.distributed as dist
    fx.cpu_shims(torch)
    sharding, tied, _ = CASES[fixture]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=r, world_size=tp * pp)
    layers = fx.RESHARDS.get(fixture, {}).get("layers")  # the fixture's (tied_tp2_pp2_distopt: 4)
    built = [fx.build(tp, False, True, pp=pp, layers=layers, tied=tied, init=i == 0) for i in range(2)]
    (gpt_a, _, opt_a, _), (gpt_b, _, opt_b, _) = [
        (g[0], m[0], o, s) if isinstance(g, list) else (g, m, o, s) for g, m, o, s in built]
    fx.init_optimizer_state(opt_a)
    fx.step_shim()
    step_a = load_fixture(gpt_a, opt_a, sharding, os.path.join(FIXTURES, fixture, f"iter_{fx.ITERATION:07d}"))
    t, p = r % tp, r // tp
    it = int(open(os.path.join(export, "latest_checkpointed_iteration.txt")).read())
    rank_dir = os.path.join(export, f"iter_{it:07d}", f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
    load_export(gpt_b, opt_b, rank_dir)
    bad, checked = compare(gpt_a, opt_a, step_a, gpt_b, opt_b, f"tensor rank {t}, pipeline rank {p}")
    dist.destroy_process_group()
    with open(result, "w") as f:
        json.dump({"bad": bad, "checked": checked}, f)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "rank":  # rank R TP PP FIXTURE EXPORT STORE RESULT
        rank(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:9])
        return
    bin_dir, fixtures = sys.argv[1], sys.argv[2:] or list(CASES)
    convert = os.path.join(bin_dir, "ptk-convert")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in fixtures:
            ptk = os.path.join(tmp, fixture + "-ptk")
            subprocess.run([convert, "--loader", "megatron", "--saver", "ptk", "--load-dir",
                            os.path.join(FIXTURES, fixture), "--save-dir", ptk], check=True, capture_output=True)
            for tp, pp in CASES[fixture][2]:
                export = os.path.join(tmp, f"{fixture}-tp{tp}-pp{pp}")
                subprocess.run([convert, "--loader", "ptk", "--saver", "megatron", "--load-dir", ptk, "--save-dir",
                                export, "--target-use-distributed-optimizer", "--saver-transformer-impl", "local",
                                "--make-vocab-size-divisible-by", str(fx.ARGS["divisible"]),
                                "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)],
                               check=True, capture_output=True)
                store = os.path.join(tmp, f"store-{fixture}-{tp}-{pp}")
                results = [os.path.join(tmp, f"r-{fixture}-{tp}-{pp}.{r}") for r in range(tp * pp)]
                procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(tp), str(pp), fixture, export,
                                           store, results[r]]) for r in range(tp * pp)]
                what = f"{fixture} exported at tensor size {tp} x pipeline size {pp}"
                if any(x.wait() != 0 for x in procs):
                    print(f"FAIL: {what}: a rank failed (above)")
                    failures += 1
                    continue
                for r, path in enumerate(results):
                    res = json.load(open(path))
                    for b in res["bad"]:
                        print("FAIL:", what, b)
                    failures += len(res["bad"])
                    print(f"{what}, rank {r}: {res['checked']} parameters, megatron-core's load of ptk's export "
                          f"{'equals its load of the fixture bit for bit' if not res['bad'] else 'DIFFERS'}")
    if failures:
        print(f"{failures} failure(s)")
        sys.exit(1)
    print("megatron -> ptk -> megatron: megatron-core loads ptk's export with the fixture's weights, moments and step")


if __name__ == "__main__":
    main()
