"""Checks ptk-convert's multi-latent attention export to Megatron's `torch` format against megatron-core itself.

Three MLA models are trained a few steps by ptk-train (CPU, fp32) and exported by `ptk-convert --saver megatron`
(tensor and pipeline size 1, the local layer names):
  lora_yarn:  queries through a latent of 24 (linear_q_down_proj, q_layernorm, linear_q_up_proj), --qk-layernorm,
              RMSNorm, SwiGLU, no biases, RoPE positions, YaRN (factor 4, mscale 0.7, mscale_all_dim 0.9), untied;
  plain_rope: linear_q_proj, no latent norms, LayerNorm, GELU, biases (linear_proj's), learned absolute positions,
              --rope-type rope, tied embeddings;
  deepseek:   lora_yarn's attention with DeepSeek-style experts on the second layer (--moe-layer-freq [0,1]): 4
              experts, top 2, sigmoid scores with the expert bias, a top-k scaling factor, shared experts.
For each, megatron-core 0.16.1 builds the model the export's args describe as Megatron-LM's
core_transformer_config_from_args does (MLATransformerConfig from every args attribute that names one of its
fields, then Megatron-LM's own overrides: num_moe_experts, SwiGLU, query groups, rope_type None dropped), the
CPU-only settings aside (use_cpu_initialization, no fused kernels but the bias-GELU one args ask for, whose tanh
GELU is ptk's with biases); GPTModel from get_gpt_decoder_block_spec(config,
use_transformer_engine=False) (the local spec: MLASelfAttention with ColumnParallelLinear projections,
DotProductAttention; as shipped the local spec's core attention does not take MLA's k_channels / v_channels:
gen_mla_golden.mla_core_attention gives it them, the local attention's own math). Then:
  - model_optim_rng.pt's model loads with strict=True (every name and shape megatron-core's own), and its keys, less
    the _extra_state entries and the routers' expert_bias buffers, are megatron-core's named_parameters in order
    (the order its optimizer numbers them in);
  - the optimizer's state loads into get_megatron_optimizer's (every exp_avg / exp_avg_sq of its parameter's shape,
    Adam's step the run's 4);
  - megatron-core's logits on 2 sequences equal ptk's (logits_tool on the ptk checkpoint) within TOL = 1e-4 (fp32
    both; the summation orders differ; measured 1.7e-6, 1.4e-6 and 1.7e-6 on logits up to 2.9, 3.1 and 3.4);
  - `ptk-convert --loader megatron` reads the export back to the same logits, bit for bit;
  - the dense cases exported again with --target-use-distributed-optimizer: megatron-core's DistributedOptimizer
    loads model_optim_rng.pt's optimizer and distrib_optim.pt, and every parameter's fp32 main param and moments are
    the ptk checkpoint's bit for bit (check_distopt).
Then at tensor-parallel size 2 (check_tp2), each case trained by ptk-train on two tensor ranks (WORLD_SIZE=2, as
tests/trainer/train_cli_support.h launches them) and exported with --target-tensor-parallel-size 2 (local names):
two gloo processes build megatron-core's model at tensor size 2 (parallel_state.initialize_model_parallel(2, 1),
as gen_moe_tp_router_golden.py), and each
  - loads its rank's mp_rank_0R/model_optim_rng.pt strictly (megatron-core's shard of every MLA tensor: linear_q_proj,
    the up projections and the local spec's ColumnParallelLinear down projections by rows, linear_proj by columns),
    its keys in named_parameters' order, its optimizer's moments of its shards' shapes;
  - computes its vocabulary shard of the logits and the per-token loss (GPTModel with labels: megatron-core's
    vocab-parallel cross entropy over both ranks) of the 2 sequences;
the gathered logits equal ptk's (logits_tool on ptk's T=2 checkpoint) within TOL, the mean losses ptk's (logits_tool's
lm loss) within LOSS_TOL = 1e-5 (fp32 both; about 20 float32 ulps at losses near 6.5: logits off by ~2e-6 in their
summation orders move a cross entropy by as much, the vocab-parallel sum over two ranks adding its own rounding;
measured 2.0e-7, 1.4e-7 and 3.4e-7, the logits within 1.7e-6 in each case), and the
import of the T=2 files gives ptk's logits bit for bit. Each rank's state_dict names and shapes go to
tests/data/interop/mla_megatron_names_tp2.txt ("case rank kind name shape"), which megatron_mla_tp_test.cpp compares
ptk's T=2 export with.
It also writes the names megatron-core's state_dict has for each case (tests/data/interop/mla_megatron_names.txt:
"case kind name shape", kind param / buffer / extra, in state_dict order), which tests/interop/megatron_mla_test.cpp
compares ptk's export with (CI cannot run megatron-core).
CPU only, one gloo rank (mcore_golden.one_cpu_rank), then two (check_mla_tp2.py); run by hand (about 2 minutes):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/check_mla_export_with_megatron_core.py \\
      build/bin build/tests [tests/data/interop/mla_megatron_names.txt [tests/data/interop/mla_megatron_names_tp2.txt]]
"""
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_check_common  # noqa: E402
import gen_mla_golden  # noqa: E402  (mla_core_attention)
import mcore_golden  # noqa: E402  (one_cpu_rank)
from export_check_common import check, failures, names_of, run  # noqa: E402

BIN, TEST_BIN = sys.argv[1], sys.argv[2]
NAMES_OUT = sys.argv[3] if len(sys.argv) > 3 else None
NAMES_TP2_OUT = sys.argv[4] if len(sys.argv) > 4 else None
TOL = 1e-4
LOSS_TOL = 1e-5
VOCAB = 500
TRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "3e-3", "--mock-data", "--threads", "2",
         "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.1", "--ffn-hidden-size", "96",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--vocab-size", str(VOCAB), "--train-iters", "4",
         "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
         "--v-head-dim", "12"]
LORA_YARN = ["--q-lora-rank", "24", "--qk-layernorm", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
             "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope", "--rope-type", "yarn",
             "--rotary-scaling-factor", "4", "--mscale", "0.7", "--mscale-all-dim", "0.9",
             "--untie-embeddings-and-output-weights"]
CASES = {
    "lora_yarn": LORA_YARN,
    "plain_rope": ["--rope-type", "rope", "--rotary-base", "20000"],
    "deepseek": LORA_YARN + ["--num-experts", "4", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2",
                             "--moe-layer-freq", "[0,1]", "--moe-router-score-function", "sigmoid",
                             "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
                             "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "32",
                             "--moe-aux-loss-coeff", "0.01"],
}
SEQS = [[1, 464, 210, 286, 262, 99, 318, 257], [11, 329, 17, 42, 99, 100, 310, 7, 8, 9, 10, 12]]


def config_from_args(torch, a):
    """MLATransformerConfig as Megatron-LM 0.16.1's core_transformer_config_from_args builds it from args `a`."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(MLATransformerConfig) if hasattr(a, f.name)}
    kw["num_moe_experts"] = a.num_experts
    kw["rotary_interleaved"] = a.rotary_interleaved
    if a.swiglu:
        kw["activation_func"], kw["gated_linear_unit"] = F.silu, True
    # Megatron-LM's bias_activation_fusion: --bias-gelu-fusion's (the tanh GELU of its fused bias-GELU kernel, which
    # runs on the CPU too); SwiGLU's fused kernel computes the unfused math, so it stays off here.
    kw["bias_activation_fusion"] = bool(getattr(a, "bias_gelu_fusion", False)) and not a.swiglu
    kw["num_query_groups"] = a.num_query_groups if a.group_query_attention else None
    if getattr(a, "rope_type", None) is None:
        kw.pop("rope_type", None)
    for k in ("params_dtype", "pipeline_dtype"):  # torch dtypes as pickled: the run's fp32
        kw.pop(k, None)
    # The CPU: initialised there, no fused kernels (their math is the unfused one's).
    kw.update(use_cpu_initialization=True, apply_rope_fusion=False,
              masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
              bias_dropout_fusion=False, moe_router_fusion=False)
    return MLATransformerConfig(**kw)


def build(torch, a, distopt=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    cfg = config_from_args(torch, a)
    check(a.transformer_impl == "local", "args.transformer_impl local")
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = gen_mla_golden.mla_core_attention()
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=a.padded_vocab_size,
                   max_sequence_length=a.max_position_embeddings, position_embedding_type=a.position_embedding_type,
                   rotary_percent=a.rotary_percent, rotary_base=a.rotary_base,
                   share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights)
    if distopt:  # Megatron-LM's load_checkpoint loads the weights before get_model's DDP wraps them (strict)
        gpt.load_state_dict(torch.load(distopt, weights_only=False)["model"], strict=True)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=bool(distopt),
                                               overlap_grad_reduce=a.overlap_grad_reduce,
                                               bucket_size=getattr(a, "ddp_bucket_size", None))
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad, use_distributed_optimizer=bool(distopt)),
        [model])
    return gpt, opt


def check_distopt(torch, name, tmp):
    """`name`'s run exported with --target-use-distributed-optimizer: megatron-core's DistributedOptimizer loads
    model_optim_rng.pt's optimizer and distrib_optim.pt as Megatron-LM's load_checkpoint does (the step set aside
    around load_parameter_state as check_distopt_export_with_megatron_core.py explains), and every parameter's fp32
    main param, exp_avg and exp_avg_sq equal the ptk checkpoint's bit for bit, Adam's step too."""
    from check_distopt_export_with_megatron_core import read_ptk
    ck, meg = os.path.join(tmp, name + "-ck"), os.path.join(tmp, name + "-meg-distopt")
    run([os.path.join(BIN, "ptk-convert"), "--loader", "ptk", "--saver", "megatron", "--load-dir", ck, "--save-dir",
         meg, "--saver-transformer-impl", "local", "--target-use-distributed-optimizer"])
    rank_dir = os.path.join(meg, "iter_0000004", "mp_rank_00")
    sd = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), weights_only=False)
    gpt, opt = build(torch, sd["args"], distopt=os.path.join(rank_dir, "model_optim_rng.pt"))
    opt.load_state_dict(sd["optimizer"])
    dopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    steps = {p: st.pop("step") for p, st in dopt.optimizer.state.items()}
    with torch.no_grad():
        opt.load_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    for p, step in steps.items():
        dopt.optimizer.state[p]["step"] = step
    want, want_step = read_ptk(ck)
    bad, checked = [], 0
    for n, param in gpt.named_parameters():
        st = dopt._get_main_param_and_optimizer_states(param)
        w = want[n]
        for k, key in enumerate(("param", "exp_avg", "exp_avg_sq")):
            got = st[key].detach().reshape(param.shape).numpy()
            rows = min(got.shape[0], w[k].shape[0])  # the vocabulary: ptk's 512 rows, as padded
            if got.shape != w[k].shape or got[:rows].tobytes() != w[k][:rows].tobytes():
                bad.append("{} {}".format(n, key))
        if float(st["step"]) != want_step:
            bad.append("{}: Adam step {}, ptk's {}".format(n, float(st["step"]), want_step))
        checked += 1
    check(not bad and checked == len(want), "{}: --target-use-distributed-optimizer: megatron-core's "
          "DistributedOptimizer loads distrib_optim.pt; {} parameters' fp32 params and moments are ptk's bit for bit, "
          "step {}{}".format(name, checked, want_step, "" if not bad else " (differ: " + ", ".join(bad[:5]) + ")"))


def ptk_logits(numpy, ck, tmp):
    return export_check_common.ptk_logits(numpy, TEST_BIN, ck, tmp, SEQS, VOCAB)


def check_case(torch, numpy, name, flags, tmp, names):
    ck, meg, back = (os.path.join(tmp, name + s) for s in ("-ck", "-meg", "-back"))
    run([os.path.join(BIN, "ptk-train")] + TRAIN + flags + ["--save", ck])
    run([os.path.join(BIN, "ptk-convert"), "--loader", "ptk", "--saver", "megatron", "--load-dir", ck, "--save-dir",
         meg, "--saver-transformer-impl", "local"])
    sd = torch.load(os.path.join(meg, "iter_0000004", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    a = sd["args"]
    gpt, opt = build(torch, a)
    check(gpt.config.multi_latent_attention and gpt.config.q_lora_rank == a.q_lora_rank and
          gpt.config.rope_type == a.rope_type,
          "{}: megatron-core builds MLA (q_lora_rank {}, rope_type {})".format(name, a.q_lora_rank, a.rope_type))
    missing, unexpected = gpt.load_state_dict(sd["model"], strict=True)
    check(not missing and not unexpected, "{}: megatron-core loads the model strictly".format(name))
    ours = [k for k in sd["model"] if not k.endswith("_extra_state") and not k.endswith("router.expert_bias")]
    theirs = [n for n, _ in gpt.named_parameters()]
    check(ours == theirs, "{}: the export's {} parameters in megatron-core's named_parameters order".format(
        name, len(ours)))
    extras = {k for k in sd["model"] if k.endswith("_extra_state")}
    their_extras = {n for kind, n, _ in names_of(gpt) if kind == "extra"}
    check(extras == their_extras, "{}: the export's {} _extra_state entries are megatron-core's ({} missing, {} "
          "more)".format(name, len(extras), len(their_extras - extras), len(extras - their_extras)))
    opt.load_state_dict(sd["optimizer"])
    inner = opt.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    ok = len(params) == len(theirs) and all(
        inner.state[p]["exp_avg"].shape == p.shape and inner.state[p]["exp_avg_sq"].shape == p.shape and
        int(inner.state[p]["step"]) == 4 for p in params)
    check(ok, "{}: its optimizer loads the moments, each of its parameter's shape, step 4".format(name))
    gpt.eval()
    worst, scale = 0.0, 0.0
    for seq, mine in zip(SEQS, ptk_logits(numpy, ck, tmp)):
        x = torch.tensor([seq])
        with torch.no_grad():
            out = gpt(x, torch.arange(len(seq)).unsqueeze(0), None)[0, :, :VOCAB].float().numpy()
        worst = max(worst, float(numpy.abs(out - mine).max()))
        scale = max(scale, float(numpy.abs(mine).max()))
    check(worst <= TOL, "{}: megatron-core's logits and ptk's differ by at most {:.3g} (tolerance {}; logits up to "
          "{:.3g})".format(name, worst, TOL, scale))
    run([os.path.join(BIN, "ptk-convert"), "--loader", "megatron", "--saver", "ptk", "--load-dir", meg, "--save-dir",
         back])
    x, y = ptk_logits(numpy, ck, tmp), ptk_logits(numpy, back, tmp)
    check(all(numpy.array_equal(p, q) for p, q in zip(x, y)), "{}: imported back, the same logits".format(name))
    names.extend((name,) + e for e in names_of(gpt))


def main():
    import numpy
    names, names_tp2 = [], []
    with mcore_golden.one_cpu_rank(moe=True, mla=True) as torch:
        with tempfile.TemporaryDirectory() as tmp:
            for name, flags in CASES.items():
                check_case(torch, numpy, name, flags, tmp, names)
                if name != "deepseek":  # MoE models are not written with the distributed optimizer yet
                    check_distopt(torch, name, tmp)
    import check_mla_tp2
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in CASES.items():
            check_mla_tp2.check_tp2(sys.modules[__name__], name, flags, tmp, names_tp2)
    if NAMES_TP2_OUT and not failures:
        with open(NAMES_TP2_OUT, "w") as f:
            f.write("# megatron-core 0.16.1's state_dict of ptk's MLA test models at tensor-parallel size 2 (local "
                    "spec): case rank kind name shape.\n# Written by tests/support/check_mla_export_with_megatron_core"
                    ".py; read by tests/interop/megatron_mla_tp_test.cpp.\n")
            for case, rank, kind, n, shape in names_tp2:
                f.write("{} {} {} {} {}\n".format(case, rank, kind, n, shape))
    if NAMES_OUT and not failures:
        with open(NAMES_OUT, "w") as f:
            f.write("# megatron-core 0.16.1's state_dict of ptk's MLA test models (local spec): case kind name shape.\n"
                    "# Written by tests/support/check_mla_export_with_megatron_core.py; read by "
                    "tests/interop/megatron_mla_test.cpp.\n")
            for case, kind, n, shape in names:
                f.write("{} {} {} {}\n".format(case, kind, n, shape))
    print("check_mla_export_with_megatron_core: " + ("OK" if not failures else "{} failure(s)".format(len(failures))))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
