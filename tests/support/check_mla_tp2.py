"""check_mla_export_with_megatron_core.py's tensor-parallel size 2 stage (its docstring says what it checks): ptk-train
on two tensor ranks, ptk-convert --target-tensor-parallel-size 2, megatron-core 0.16.1 at tensor size 2 in two gloo
processes on the CPU loading each rank's file and computing its logits' vocabulary shard and the per-token loss."""
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_tp2(m, flags, ck):
    """ptk-train at --tensor-model-parallel-size 2 (with experts, --sequence-parallel): ranks 1 and 0 launched as
    train_cli_support.h launches them."""
    moe = ["--sequence-parallel"] if "--num-experts" in flags else []  # Megatron's rule for MoE under TP
    cmd = [os.path.join(m.BIN, "ptk-train")] + m.TRAIN + flags + moe + ["--tensor-model-parallel-size", "2",
                                                                         "--save", ck]
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in (1, 0)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("ptk-train at T=2 failed:\n" + "\n".join(o[-2000:] for o in outs))


def rank_main(rank, store, meg, out):
    """One of megatron-core's two tensor ranks: rank `rank`'s file of `meg` loaded, its results into `out` (json)."""
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    from make_torch_dist_distopt_fixture import cpu_shims
    cpu_shims(torch)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla_module
    from megatron.core import parallel_state
    mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    mla_module.HAVE_TE = False  # mcore_golden.one_cpu_rank's reason
    parallel_state.initialize_model_parallel(2, 1)
    mrandom.model_parallel_cuda_manual_seed(1234)
    import check_mla_export_with_megatron_core as m
    sd = torch.load(os.path.join(meg, "iter_0000004", "mp_rank_{:02d}".format(rank), "model_optim_rng.pt"),
                    weights_only=False)
    a = sd["args"]
    gpt, opt = m.build(torch, a)
    res = {"tp": gpt.config.tensor_model_parallel_size, "checks": [], "logits": [], "loss": []}
    missing, unexpected = gpt.load_state_dict(sd["model"], strict=True)
    res["checks"].append([not missing and not unexpected, "loads its rank's model strictly"])
    ours = [k for k in sd["model"] if not k.endswith("_extra_state") and not k.endswith("router.expert_bias")]
    res["checks"].append([ours == [n for n, _ in gpt.named_parameters()], "its keys in named_parameters order"])
    opt.load_state_dict(sd["optimizer"])
    inner = opt.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    res["checks"].append([all(inner.state[p]["exp_avg"].shape == p.shape and int(inner.state[p]["step"]) == 4
                              for p in params), "its optimizer's moments of its shards' shapes, step 4"])
    res["names"] = m.names_of(gpt)
    gpt.eval()
    for seq in m.SEQS:
        x = torch.tensor([seq])
        pos = torch.arange(len(seq)).unsqueeze(0)
        labels = torch.tensor([seq[1:] + [0]])
        with torch.no_grad():
            res["logits"].append(gpt(x, pos, None)[0].float().tolist())
            res["loss"].append(gpt(x, pos, None, labels=labels)[0].float().tolist())
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def megatron_tp2(meg, tmp):
    import multiprocessing as mp
    outs = [os.path.join(tmp, "rank{}.json".format(r)) for r in range(2)]
    store = os.path.join(tmp, "store")
    procs = [mp.get_context("spawn").Process(target=rank_main, args=(r, store, meg, outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit("a megatron-core rank failed: exit {}".format(p.exitcode))
    res = []
    for o in outs:
        with open(o) as f:
            res.append(json.load(f))
    return res


def check_tp2(m, name, flags, tmp, names):
    import numpy
    ck, meg, back = (os.path.join(tmp, name + s) for s in ("-tp2-ck", "-tp2-meg", "-tp2-back"))
    train_tp2(m, flags, ck)
    m.run([os.path.join(m.BIN, "ptk-convert"), "--loader", "ptk", "--saver", "megatron", "--load-dir", ck,
           "--save-dir", meg, "--saver-transformer-impl", "local", "--target-tensor-parallel-size", "2"])
    with tempfile.TemporaryDirectory() as rt:
        ranks = megatron_tp2(meg, rt)
    for r, res in enumerate(ranks):
        m.check(res["tp"] == 2, "{} T=2: rank {} builds megatron-core's model at tensor size 2".format(name, r))
        for ok, what in res["checks"]:
            m.check(ok, "{} T=2: rank {} {}".format(name, r, what))
        names.extend((name, r) + tuple(e) for e in res["names"])
    seq_file, out, loss_file = (os.path.join(tmp, name + s) for s in ("-seqs.txt", "-logits.f32", "-loss.txt"))
    with open(seq_file, "w") as f:
        for s in m.SEQS:
            f.write(" ".join(map(str, s)) + "\n")
    m.run([os.path.join(m.TEST_BIN, "logits_tool"), ck, seq_file, out, loss_file])
    flat, at = numpy.fromfile(out, dtype=numpy.float32), 0
    ptk_loss = [float(v) for v in open(loss_file).read().split()]
    worst = worst_loss = scale = 0.0
    for i, s in enumerate(m.SEQS):
        mine = flat[at:at + len(s) * m.VOCAB].reshape(len(s), m.VOCAB)
        at += len(s) * m.VOCAB
        theirs = numpy.concatenate([numpy.array(res["logits"][i]) for res in ranks], axis=-1)[:, :m.VOCAB]
        worst = max(worst, float(numpy.abs(theirs - mine).max()))
        scale = max(scale, float(numpy.abs(mine).max()))
        per_token = [numpy.array(res["loss"][i]) for res in ranks]
        m.check(numpy.array_equal(per_token[0], per_token[1]), "{} T=2: both ranks' losses alike".format(name))
        worst_loss = max(worst_loss, abs(float(per_token[0][:-1].mean()) - ptk_loss[i]))
    m.check(worst <= m.TOL, "{} T=2: megatron-core's gathered logits and ptk's differ by at most {:.3g} (tolerance {}; "
            "logits up to {:.3g})".format(name, worst, m.TOL, scale))
    m.check(worst_loss <= m.LOSS_TOL, "{} T=2: megatron-core's lm losses and ptk's differ by at most {:.3g} (tolerance "
            "{}; losses {})".format(name, worst_loss, m.LOSS_TOL, ", ".join("{:.6f}".format(v) for v in ptk_loss)))
    m.run([os.path.join(m.BIN, "ptk-convert"), "--loader", "megatron", "--saver", "ptk", "--load-dir", meg,
           "--save-dir", back])
    other = os.path.join(tmp, name + "-back-logits.f32")
    m.run([os.path.join(m.TEST_BIN, "logits_tool"), back, seq_file, other])
    m.check(numpy.array_equal(numpy.fromfile(other, dtype=numpy.float32), flat),
            "{} T=2: imported back, the same logits".format(name))
