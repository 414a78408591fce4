"""Checks ptk-convert's multi-token prediction export to Megatron's `torch` format against megatron-core itself.

Two models with MTP depths are trained a few steps by ptk-train (CPU, fp32, no dropout) and exported by
`ptk-convert --saver megatron --saver-transformer-impl local` (tensor and pipeline size 1):
  gpt_tied:     GPT-2's line (LayerNorm, GELU with biases, learned positions), tied embeddings, two depths, factor 0.3;
  llama_untied: the Llama line (RMSNorm, SwiGLU, RoPE, no biases), untied output layer, one depth, factor 0.1.
For each, megatron-core 0.16.1 builds the model the export's args describe (TransformerConfig from every args
attribute that names one of its fields, Megatron-LM's SwiGLU / query-group overrides, the CPU settings) as GPTModel
with mtp_block_spec = get_gpt_mtp_block_spec(config, local layer spec, use_transformer_engine=False)
(MultiTokenPredictionBlock: mtp.layers.K.enorm, hnorm, eh_proj, transformer_layer, final_layernorm). Then:
  - model_optim_rng.pt's model loads with strict=True, its keys less _extra_state are megatron-core's
    named_parameters in order, and the optimizer's moments load (each of its parameter's shape, step 4);
  - megatron-core's forward in training mode (dropout 0) with labels (the next tokens) and the loss mask (every
    position but the last) on 2 sequences: the lm loss (masked mean of its per-token losses) and each depth's MTP
    loss (MTPLossLoggingHelper's tracker: the depth's masked mean over its rolled labels and mask) equal ptk's
    (logits_tool's lm and mtp losses on the ptk checkpoint) within LOSS_TOL = 1e-5 (fp32 both; losses near 6.4,
    where a float32 ulp is 4.8e-7: about 20 ulps for the summation orders of the logits behind a cross entropy);
    measured in the commit and docs/interop.md;
  - `ptk-convert --loader megatron` reads the export back to the same losses, bit for bit.
Then at tensor-parallel size 2 (check_tp2): each model trained by ptk-train on two tensor ranks, exported with
--target-tensor-parallel-size 2 and loaded by megatron-core at tensor size 2 in two gloo processes (as
check_mla_tp2.py): each rank's file strictly, in named_parameters' order (eh_proj column-parallel, each depth's
transformer_layer split as a decoder layer), and the lm and MTP losses (vocab-parallel cross entropy) ptk's within
LOSS_TOL; each rank's names and shapes written to tests/data/interop/mtp_megatron_names_tp2.txt.
It also writes the names megatron-core's state_dict has (tests/data/interop/mtp_megatron_names.txt: "case kind name
shape"), which tests/interop/megatron_mtp_test.cpp compares ptk's export with.
CPU only, one gloo rank (mcore_golden.one_cpu_rank), then two; run by hand:
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/check_mtp_export_with_megatron_core.py \\
      build/bin build/tests [tests/data/interop/mtp_megatron_names.txt [tests/data/interop/mtp_megatron_names_tp2.txt]]
"""
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_golden  # noqa: E402  (one_cpu_rank)
from export_check_common import check, failures, names_of, run  # noqa: E402

BIN, TEST_BIN = sys.argv[1], sys.argv[2]
NAMES_OUT = sys.argv[3] if len(sys.argv) > 3 else None
NAMES_TP2_OUT = sys.argv[4] if len(sys.argv) > 4 else None
LOSS_TOL = 1e-5
VOCAB = 500
TRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "3e-3", "--mock-data", "--threads", "2",
         "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.1", "--ffn-hidden-size", "96",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--vocab-size", str(VOCAB), "--train-iters", "4"]
CASES = {
    "gpt_tied": ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"],
    "llama_untied": ["--mtp-num-layers", "1", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                     "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"],
}
SEQS = [[1, 464, 210, 286, 262, 99, 318, 257], [11, 329, 17, 42, 99, 100, 310, 7, 8, 9, 10, 12]]


def build(torch, a):
    """GPTModel with its MTP block as Megatron-LM 0.16.1 builds it from args `a` (local spec), and its optimizer."""
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(a, f.name)}
    if a.swiglu:
        kw["activation_func"], kw["gated_linear_unit"] = F.silu, True
    kw["bias_activation_fusion"] = bool(getattr(a, "bias_gelu_fusion", False)) and not a.swiglu
    kw["num_query_groups"] = a.num_query_groups if a.group_query_attention else None
    kw["num_moe_experts"] = a.num_experts
    for k in ("params_dtype", "pipeline_dtype"):
        kw.pop(k, None)
    kw.update(use_cpu_initialization=True, apply_rope_fusion=False, masked_softmax_fusion=False,
              gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False)
    cfg = TransformerConfig(**kw)
    check(a.transformer_impl == "local" and cfg.mtp_num_layers == a.mtp_num_layers,
          "args: local spec, mtp_num_layers {}, mtp_loss_scaling_factor {}".format(a.mtp_num_layers,
                                                                                 a.mtp_loss_scaling_factor))
    spec = get_gpt_layer_local_spec(normalization=a.normalization)
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=a.padded_vocab_size,
                   max_sequence_length=a.max_position_embeddings, position_embedding_type=a.position_embedding_type,
                   rotary_percent=a.rotary_percent, rotary_base=a.rotary_base,
                   share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                   mtp_block_spec=mtp_spec)
    model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad), [model])
    return gpt, opt


def ptk_losses(ck, tmp):
    """logits_tool's lm loss and MTP losses of each sequence: a list of [lm, mtp_1, ...]."""
    seq_file, out, losses = (os.path.join(tmp, n) for n in ("seqs.txt", "logits.f32", "losses.txt"))
    with open(seq_file, "w") as f:
        for s in SEQS:
            f.write(" ".join(map(str, s)) + "\n")
    run([os.path.join(TEST_BIN, "logits_tool"), ck, seq_file, out, losses])
    with open(losses) as f:
        return [[float(v) for v in line.split()] for line in f if line.strip()]


def megatron_losses(torch, gpt, n):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    out = []
    gpt.train()  # the tracker records MTP losses in training mode only (the args' dropout is 0)
    for seq in SEQS:
        MTPLossLoggingHelper.tracker.clear()
        x = torch.tensor([seq])
        labels = torch.tensor([seq[1:] + [0]])
        mask = torch.ones(1, len(seq))
        mask[0, -1] = 0
        with torch.no_grad():
            per_token = gpt(x, torch.arange(len(seq)).unsqueeze(0), None, labels=labels, loss_mask=mask)
        lm = float((per_token.float() * mask).sum() / mask.sum())
        values = MTPLossLoggingHelper.tracker["values"]
        out.append([lm] + [float(values[k]) for k in range(n)])
    return out


def check_case(torch, name, flags, tmp, names):
    ck, meg, back = (os.path.join(tmp, name + s) for s in ("-ck", "-meg", "-back"))
    run([os.path.join(BIN, "ptk-train")] + TRAIN + flags + ["--save", ck])
    run([os.path.join(BIN, "ptk-convert"), "--loader", "ptk", "--saver", "megatron", "--load-dir", ck, "--save-dir",
         meg, "--saver-transformer-impl", "local"])
    sd = torch.load(os.path.join(meg, "iter_0000004", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    a = sd["args"]
    gpt, opt = build(torch, a)
    missing, unexpected = gpt.load_state_dict(sd["model"], strict=True)
    check(not missing and not unexpected, "{}: megatron-core loads the model strictly".format(name))
    ours = [k for k in sd["model"] if not k.endswith("_extra_state")]
    theirs = [n for n, _ in gpt.named_parameters()]
    check(ours == theirs, "{}: the export's {} parameters in megatron-core's named_parameters order ({} of them "
          "mtp.layers.*)".format(name, len(ours), sum(k.startswith("mtp.") for k in ours)))
    opt.load_state_dict(sd["optimizer"])
    inner = opt.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    check(len(params) == len(theirs) and all(inner.state[p]["exp_avg"].shape == p.shape and
                                             int(inner.state[p]["step"]) == 4 for p in params),
          "{}: its optimizer loads the moments, each of its parameter's shape, step 4".format(name))
    n = a.mtp_num_layers
    theirs_l, mine = megatron_losses(torch, gpt, n), ptk_losses(ck, tmp)
    worst = max(abs(x - y) for t, m in zip(theirs_l, mine) for x, y in zip(t, m))
    check(all(len(m) == n + 1 for m in mine) and worst <= LOSS_TOL,
          "{}: megatron-core's lm and {} MTP losses equal ptk's within {:.3g} (tolerance {}; megatron-core {}, ptk {})"
          .format(name, n, worst, LOSS_TOL, [["{:.6f}".format(v) for v in t] for t in theirs_l],
                  [["{:.6f}".format(v) for v in m] for m in mine]))
    run([os.path.join(BIN, "ptk-convert"), "--loader", "megatron", "--saver", "ptk", "--load-dir", meg, "--save-dir",
         back])
    check(ptk_losses(back, tmp) == mine, "{}: imported back, the same losses".format(name))
    names.extend((name,) + e for e in names_of(gpt))


def tp2_rank(rank, store, meg, out):
    """One of megatron-core's two tensor ranks: rank `rank`'s file of `meg` loaded, its losses into `out` (json)."""
    import json
    import torch
    import torch.distributed as dist
    from make_torch_dist_distopt_fixture import cpu_shims
    cpu_shims(torch)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state
    mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
    parallel_state.initialize_model_parallel(2, 1)
    mrandom.model_parallel_cuda_manual_seed(1234)
    sd = torch.load(os.path.join(meg, "iter_0000004", "mp_rank_{:02d}".format(rank), "model_optim_rng.pt"),
                    weights_only=False)
    gpt, opt = build(torch, sd["args"])
    missing, unexpected = gpt.load_state_dict(sd["model"], strict=True)
    ours = [k for k in sd["model"] if not k.endswith("_extra_state")]
    opt.load_state_dict(sd["optimizer"])
    res = {"tp": gpt.config.tensor_model_parallel_size, "strict": not missing and not unexpected,
           "order": ours == [n for n, _ in gpt.named_parameters()], "names": names_of(gpt),
           "losses": megatron_losses(torch, gpt, sd["args"].mtp_num_layers)}
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def check_tp2(name, flags, tmp, names):
    """`name` trained by ptk-train on two tensor ranks, exported at --target-tensor-parallel-size 2 (local names) and
    loaded by megatron-core at tensor size 2 in two gloo processes: each loads its rank's file strictly in
    named_parameters' order, and its lm and MTP losses (vocab-parallel cross entropy) equal ptk's within LOSS_TOL."""
    import json
    import multiprocessing as mp
    import check_mla_tp2
    ck, meg = os.path.join(tmp, name + "-tp2-ck"), os.path.join(tmp, name + "-tp2-meg")
    check_mla_tp2.train_tp2(sys.modules[__name__], flags, ck)
    run([os.path.join(BIN, "ptk-convert"), "--loader", "ptk", "--saver", "megatron", "--load-dir", ck, "--save-dir",
         meg, "--saver-transformer-impl", "local", "--target-tensor-parallel-size", "2"])
    outs = [os.path.join(tmp, name + "-rank{}.json".format(r)) for r in range(2)]
    procs = [mp.get_context("spawn").Process(target=tp2_rank, args=(r, os.path.join(tmp, name + "-store"), meg,
                                                                      outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit("a megatron-core rank failed: exit {}".format(p.exitcode))
    mine = ptk_losses(ck, tmp)
    for r, o in enumerate(outs):
        with open(o) as f:
            res = json.load(f)
        check(res["tp"] == 2 and res["strict"] and res["order"], "{} T=2: rank {} loads its file strictly at tensor "
              "size 2, in named_parameters' order".format(name, r))
        worst = max(abs(x - y) for t, m in zip(res["losses"], mine) for x, y in zip(t, m))
        check(worst <= LOSS_TOL, "{} T=2: rank {}'s lm and MTP losses equal ptk's within {:.3g} (tolerance {})".format(
            name, r, worst, LOSS_TOL))
        names.extend((name, r) + tuple(e) for e in res["names"])


def main():
    names, names_tp2 = [], []
    with mcore_golden.one_cpu_rank() as torch:
        with tempfile.TemporaryDirectory() as tmp:
            for name, flags in CASES.items():
                check_case(torch, name, flags, tmp, names)
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in CASES.items():
            check_tp2(name, flags, tmp, names_tp2)
    if NAMES_TP2_OUT and not failures:
        with open(NAMES_TP2_OUT, "w") as f:
            f.write("# megatron-core 0.16.1's state_dict of ptk's MTP test models at tensor-parallel size 2 (local "
                    "spec): case rank kind name shape.\n# Written by tests/support/check_mtp_export_with_megatron_core"
                    ".py; read by tests/interop/megatron_mtp_test.cpp.\n")
            for case, rank, kind, n, shape in names_tp2:
                f.write("{} {} {} {} {}\n".format(case, rank, kind, n, shape))
    if NAMES_OUT and not failures:
        with open(NAMES_OUT, "w") as f:
            f.write("# megatron-core 0.16.1's state_dict of ptk's MTP test models (local spec): case kind name shape.\n"
                    "# Written by tests/support/check_mtp_export_with_megatron_core.py; read by "
                    "tests/interop/megatron_mtp_test.cpp.\n")
            for case, kind, n, shape in names:
                f.write("{} {} {} {}\n".format(case, kind, n, shape))
    print("check_mtp_export_with_megatron_core: " + ("OK" if not failures else "{} failure(s)".format(len(failures))))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
