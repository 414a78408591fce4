"""Checks ptk-convert's mixture-of-experts export to Megatron's `torch` format against megatron-core itself.

A Llama-line MoE model (RMSNorm, RoPE base 500000, 4 query heads in 2 groups, untied, SwiGLU experts: 4 of width
40, top 2, the load-balancing loss on; a second one with --moe-layer-freq [1,0] and --moe-router-pre-softmax; a third
with gated shared experts, the z-loss, a top-k scaling factor, group-limited routing, token dropping by position and
aux_loss with seq_aux_loss; a fourth with sigmoid scores and the expert bias, ungated shared experts, token dropping
by probability and global_aux_loss) is trained a few steps by ptk-train, exported by `ptk-convert --saver megatron` (tensor and pipeline size 1, the
local layer names) and loaded as Megatron-LM's load_checkpoint loads `--ckpt-format torch`: megatron-core 0.16.1
builds the GPTModel the export's args describe (get_gpt_decoder_block_spec, local spec: TopKRouter, SequentialMLP
experts, the allgather dispatcher), wrapped in its DistributedDataParallel, loads model_optim_rng.pt's model with
strict=True (every name and shape megatron-core's own; the routers' expert_bias buffers the run's) and its optimizer state with get_megatron_optimizer's
load_state_dict (the groups and ids: every parameter's exp_avg and exp_avg_sq of its shape, Adam's step the run's);
then its forward's logits on 3 sequences equal ptk's (logits_tool on the ptk checkpoint) within 1e-4 (fp32 both;
the summation orders differ), and ptk-convert --loader megatron reads the export back to the same weights.
Token dropping's "position" policy takes a stable top-k (gen_moe_golden.stable_token_dropping: torch's CPU top-k
keeps an arbitrary set among the routing map's equal values, not the earliest tokens Megatron documents).
CPU only, one gloo rank, CUDA calls pointed at the CPU (make_torch_dist_distopt_fixture.cpu_shims); run by hand
(CI's Debian PyTorch 1.13 cannot run megatron-core):
  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/check_moe_export_with_megatron_core.py \\
      build/bin build/tests
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_check_common  # noqa: E402
from export_check_common import check, failures, run  # noqa: E402
from make_torch_dist_distopt_fixture import cpu_shims  # noqa: E402
import gen_moe_golden  # noqa: E402  (stable_token_dropping: the "position" policy's ties as Megatron documents)

BIN, TEST_BIN = sys.argv[1], sys.argv[2]
TOL = 1e-4
TRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "3e-3", "--mock-data", "--threads", "2",
         "--eval-iters", "0", "--log-interval", "10", "--init-method-std", "0.2", "--normalization", "RMSNorm",
         "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--rotary-base", "500000",
         "--ffn-hidden-size", "96", "--attention-dropout", "0", "--hidden-dropout", "0", "--disable-bias-linear",
         "--swiglu", "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--num-experts", "4", "--moe-ffn-hidden-size", "40", "--moe-router-topk", "2", "--moe-aux-loss-coeff",
         "0.01", "--train-iters", "4"]
CASES = {
    "every_layer": [],
    "freq_pre_softmax": ["--moe-layer-freq", "[1,0]", "--moe-router-pre-softmax"],
    # Gated shared experts, the z-loss, a top-k scaling factor, group-limited routing, token dropping by position
    # and two load-balancing types.
    "shared_gate_groups_capacity": [
        "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate", "--moe-z-loss-coeff", "1e-3",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
        "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
        "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "0.02"],
    # Sigmoid scores with the expert bias (moved by a large rate, so that it routes), ungated shared experts,
    # global_aux_loss, token dropping by probability.
    "sigmoid_expert_bias_shared": [
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        "0.05", "--moe-shared-expert-intermediate-size", "40", "--moe-expert-capacity-factor", "1.0",
        "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"],
}
SEQS = [[50256, 464, 2106, 286, 262, 995, 318, 257], [11, 3290, 17, 42, 99, 1000, 31000, 7, 8, 9, 10, 12]]


def build(torch, args):
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    a = args
    cfg = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=a.add_bias_linear,
        normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, gated_linear_unit=a.swiglu,
        activation_func=F.silu, bias_activation_fusion=False, num_moe_experts=a.num_experts,
        moe_router_topk=a.moe_router_topk, moe_ffn_hidden_size=a.moe_ffn_hidden_size,
        moe_aux_loss_coeff=a.moe_aux_loss_coeff, moe_router_load_balancing_type=a.moe_router_load_balancing_type,
        moe_router_pre_softmax=a.moe_router_pre_softmax, moe_router_score_function=a.moe_router_score_function,
        moe_token_dispatcher_type=a.moe_token_dispatcher_type, moe_grouped_gemm=a.moe_grouped_gemm,
        moe_layer_freq=a.moe_layer_freq, moe_router_dtype=a.moe_router_dtype,
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=a.moe_shared_expert_gate, moe_z_loss_coeff=a.moe_z_loss_coeff,
        moe_router_topk_scaling_factor=a.moe_router_topk_scaling_factor,
        moe_router_num_groups=a.moe_router_num_groups, moe_router_group_topk=a.moe_router_group_topk,
        moe_expert_capacity_factor=a.moe_expert_capacity_factor, moe_token_drop_policy=a.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=a.moe_pad_expert_input_to_capacity,
        moe_router_enable_expert_bias=a.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=a.moe_router_bias_update_rate)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=a.transformer_impl == "transformer_engine")
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=a.padded_vocab_size,
                   max_sequence_length=a.max_position_embeddings, position_embedding_type=a.position_embedding_type,
                   rotary_base=a.rotary_base, share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights)
    model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad), [model])
    return gpt, model, opt


def ptk_logits(numpy, ck, tmp, vocab):
    return export_check_common.ptk_logits(numpy, TEST_BIN, ck, tmp, SEQS, vocab)


def check_case(torch, numpy, name, flags, tmp):
    ck, meg, back = (os.path.join(tmp, name + s) for s in ("-ck", "-meg", "-back"))
    run([os.path.join(BIN, "ptk-train")] + TRAIN + flags + ["--save", ck])
    run([os.path.join(BIN, "ptk-convert"), "--loader", "ptk", "--saver", "megatron", "--load-dir", ck, "--save-dir",
         meg, "--saver-transformer-impl", "local"])
    sd = torch.load(os.path.join(meg, "iter_0000004", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    gpt, model, opt = build(torch, sd["args"])
    missing, unexpected = gpt.load_state_dict(sd["model"], strict=True)
    check(not missing and not unexpected, "{}: megatron-core loads the model strictly".format(name))
    if sd["args"].moe_router_enable_expert_bias:  # the buffer as loaded is the ptk run's, moved from 0
        biases = [b for n, b in gpt.named_buffers() if n.endswith("router.expert_bias")]
        ours = [v for k, v in sd["model"].items() if k.endswith("router.expert_bias")]
        check(len(biases) == len(ours) > 0 and all(torch.equal(b, v) for b, v in zip(biases, ours)) and
              any(float(v.abs().max()) > 0 for v in ours),
              "{}: the routers' expert_bias loaded, {} of them, moved by training".format(name, len(ours)))
    opt.load_state_dict(sd["optimizer"])
    inner = opt.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    ok = len(params) == len(list(gpt.parameters())) and all(
        inner.state[p]["exp_avg"].shape == p.shape and inner.state[p]["exp_avg_sq"].shape == p.shape and
        int(inner.state[p]["step"]) == 4 for p in params)
    check(ok, "{}: its optimizer loads the moments, each of its parameter's shape, step 4".format(name))
    if sd["args"].moe_shared_expert_intermediate_size:  # megatron-core's groups: shared experts decayed (2-D)
        decayed = {id(p) for g in inner.param_groups if g.get("wd_mult", 1.0) > 0 for p in g["params"]}
        shared = [(n, p) for n, p in gpt.named_parameters() if "shared_experts" in n]
        check(shared and all(id(p) in decayed for _, p in shared),
              "{}: the shared experts' {} parameters ({}) in the decayed group".format(
                  name, len(shared), ", ".join(n.split("shared_experts.")[1] for n, _ in shared[:3])))
    nonzero = sum(float(inner.state[p]["exp_avg_sq"].abs().sum()) > 0 for p in params)
    check(nonzero == len(params), "{}: {} of {} parameters have moments".format(name, nonzero, len(params)))
    gpt.eval()
    worst = 0.0
    for k in gen_moe_golden.DROPS:
        gen_moe_golden.DROPS[k] = 0
    for seq, ours in zip(SEQS, ptk_logits(numpy, ck, tmp, 50257)):
        x = torch.tensor([seq])
        with torch.no_grad():
            theirs = gpt(x, torch.arange(len(seq)).unsqueeze(0), None)[0, :, :50257].float().numpy()
        worst = max(worst, float(numpy.abs(theirs - ours).max()))
    check(worst <= TOL, "{}: megatron-core's logits and ptk's differ by at most {:.3g} (tolerance {})".format(
        name, worst, TOL))
    if sd["args"].moe_expert_capacity_factor is not None:  # the forward really dropped slots
        d = gen_moe_golden.DROPS
        check(d["dropped"] > 0, "{}: megatron-core's forward dropped {} of {} routed slots".format(
            name, d["dropped"], d["routed"]))
    if sd["args"].moe_router_enable_expert_bias:  # the biases route: zeroed, megatron-core's logits move
        x = torch.tensor([SEQS[1]])
        with torch.no_grad():
            before = gpt(x, torch.arange(len(SEQS[1])).unsqueeze(0), None)
            for n, b in gpt.named_buffers():
                if n.endswith("router.expert_bias"):
                    b.zero_()
            after = gpt(x, torch.arange(len(SEQS[1])).unsqueeze(0), None)
        moved = float((before - after).abs().max())
        check(moved > 100 * TOL, "{}: the expert biases zeroed move the logits by {:.3g}".format(name, moved))
    run([os.path.join(BIN, "ptk-convert"), "--loader", "megatron", "--saver", "ptk", "--load-dir", meg, "--save-dir",
         back])
    a, b = ptk_logits(numpy, ck, tmp, 50257), ptk_logits(numpy, back, tmp, 50257)
    check(all(numpy.array_equal(x, y) for x, y in zip(a, b)), "{}: imported back, the same logits".format(name))


def main():
    import numpy
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    gen_moe_golden.stable_token_dropping(torch)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core import parallel_state
        mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
        mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
        import megatron.core.transformer.moe.moe_utils as moe_utils
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        parallel_state.initialize_model_parallel(1, 1)
        mrandom.model_parallel_cuda_manual_seed(1234)
        for name, flags in CASES.items():
            check_case(torch, numpy, name, flags, tmp)
        dist.destroy_process_group()
    print("check_moe_export_with_megatron_core: " + ("OK" if not failures else "{} failure(s)".format(len(failures))))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
