"""Writes tests/data/trainer/moe_NAME.{json,bin}: megatron-core's own mixture-of-experts GPT trained on
the CPU, the golden of ptk's CPU MoE layers (tests/trainer/moe_model_golden_test.cpp).

megatron-core 0.16.1 (/opt/ptk-pyref) builds a tiny GPTModel from its local (non-TE) spec with MoE layers
(get_gpt_layer_local_spec(num_experts=E): TopKRouter, the allgather token dispatcher (the alltoall one makes CUDA streams; at one rank both permute alike), SequentialMLP
experts), no biases (--disable-bias-linear), fp32, no dropout, on one gloo rank with the CUDA calls
pointed at the CPU (make_torch_dist_distopt_fixture.cpu_shims). It is wrapped in megatron-core's
DistributedDataParallel and stepped by its optimizer (get_megatron_optimizer: Adam with decoupled weight
decay, clipping) and OptimizerParamScheduler, each micro-batch's loss the masked mean over its tokens
divided by the number of micro-batches, with MoEAuxLossAutoScaler's scale set to 1 / micro-batches,
as megatron-core's schedules do. Written: the initial weights (init:NAME), the first step's gradients
(grad:NAME, the DDP buffer's main_grad before the update), the weights after the last step
(final:NAME), and per step the lm loss, the grad norm and load_balancing_loss as Megatron-LM's
training_log computes it (the tracker's per-layer sums x 1 / micro-batches, summed over the layers, over
the MoE layers).

The router's options: the z-loss (z_loss, logged as the load-balancing loss is), the top-k scaling factor and
group-limited routing.
Token dropping (moe_capacity_*): --moe-expert-capacity-factor with either drop policy (stable_token_dropping).

Load balancing (moe_expert_bias, moe_seq_aux, moe_global_aux): aux-loss-free routing's expert bias, whose
update after each step is megatron-core's own (finalize_model_grads calls _update_router_expert_bias, i.e.
get_updated_expert_bias on the router's local_tokens_per_expert, then zeroes them; written per step as
expert_bias:L, the buffer after the update), and the seq_aux_loss and global_aux_loss types (logged as
seq_load_balancing_loss and global_load_balancing_loss; global_aux_loss's token counts reset by the same
finalize_model_grads).

The training loop, the optimizer and the files' layout are mcore_golden.py's (shared with the other megatron-core
goldens); this script adds the MoE settings, the load-balancing losses' logging and the expert bias per step.
Every golden was rewritten by this script as it is (the four oldest, moe_gelu, moe_swiglu, moe_sigmoid and
moe_per_token, had been written by an earlier version: their fp32 gradients changed in the last bits, up to 7e-3
relative in the smallest, within the test's tolerances; the others only gained the router's option keys).

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_moe_golden.py tests/data/trainer [NAME ...]
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_golden  # noqa: E402

STEPS = 3
COMMON = dict(num_layers=3, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, seq_length=8,
              max_position_embeddings=8, vocab_size=40, padded_vocab_size=40, micro_batch_size=2,
              num_micro_batches=2, lr=1e-2, min_lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              adam_eps=1e-8, clip_grad=1.0, init_method_std=0.02, num_experts=4, moe_router_score_function="softmax",
              calculate_per_token_loss=False)
GOLDENS = {
    # GELU experts (torch's exact GELU without biases), top-2 of 4, softmax after top-k, layers MoE, dense, MoE.
    "moe_gelu": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                     moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1]),
    # SwiGLU experts, top-3 of 4, softmax before top-k, every layer MoE, the experts' ffn the dense one's.
    "moe_swiglu": dict(moe_router_topk=3, moe_ffn_hidden_size=None, moe_aux_loss_coeff=0.1, swiglu=True,
                       moe_router_pre_softmax=True, moe_layer_freq=1),
    # GELU experts, top-2 of 4 by the sigmoid score function, layers dense, MoE, MoE.
    "moe_sigmoid": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                        moe_router_pre_softmax=False, moe_layer_freq=[0, 1, 1], moe_router_score_function="sigmoid"),
    # moe_gelu's model with --calculate-per-token-loss (the load-balancing loss x the micro-batch's tokens,
    # the gradients over the global batch's loss tokens) and a quarter of the tokens masked.
    "moe_per_token": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                          moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1], calculate_per_token_loss=True),
    # moe_gelu's model with the router z-loss (its coefficient large enough that the routers' gradients show it).
    "moe_zloss": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                      moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1], moe_z_loss_coeff=0.1),
    # The z-loss with --calculate-per-token-loss (its gradient x the micro-batch's tokens) and masked tokens.
    "moe_zloss_per_token": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                                moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1], moe_z_loss_coeff=0.1,
                                calculate_per_token_loss=True),
    # Group-limited routing and the top-k scaling factor: 8 experts in 4 groups, 2 groups chosen by their best
    # expert, top-2 of those after the softmax over all (pre-softmax), the probabilities x 2.5; every layer MoE.
    "moe_groups": dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05,
                       swiglu=False, moe_router_pre_softmax=True, moe_layer_freq=1, moe_router_num_groups=4,
                       moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5),
    # The same groups after the top-k's softmax over the logits (the groups chosen by the logits), with the
    # z-loss; MoE, dense, MoE layers. (With MoE, MoE, dense layers one element of an expert's fc2 gradient is
    # below Adam's eps, 1e-8: its first update, g / (|g| + eps), turns fp32's last bits into 1.6e-3 of the
    # tensor, beyond the weights' 1e-4.)
    "moe_groups_softmax": dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05,
                               swiglu=False, moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1],
                               moe_router_num_groups=4, moe_router_group_topk=2, moe_z_loss_coeff=0.01),
    # Sigmoid scores in the same groups, top-4 (each group scored by its two) x 1.5, SwiGLU experts.
    "moe_groups_sigmoid": dict(num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=None, moe_aux_loss_coeff=0.05,
                               swiglu=True, moe_router_pre_softmax=False, moe_layer_freq=[0, 1, 1],
                               moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                               moe_router_topk_scaling_factor=1.5),
    # Aux-loss-free load balancing: sigmoid scores plus the expert bias choose the top-2 of 4 (the bias, updated
    # by 0.01 x sign(mean load - load) after each step, large enough to change the routing), with the aux loss.
    "moe_expert_bias": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                            moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1], moe_router_score_function="sigmoid",
                            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01),
    # The sequence-level load-balancing loss (each sequence's switch loss, their mean), softmax after top-k.
    "moe_seq_aux": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                        moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1],
                        moe_router_load_balancing_type="seq_aux_loss"),
    # The global-batch load-balancing loss (the counts summed over the step's micro-batches so far, averaged).
    "moe_global_aux": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                           moe_router_pre_softmax=False, moe_layer_freq=[1, 1, 0],
                           moe_router_load_balancing_type="global_aux_loss"),
    # Token dropping (--moe-expert-capacity-factor): moe_gelu's model, each expert keeping at most
    # ceil(16 tokens x 2 / 4 x 0.75) = 6 of a micro-batch's slots, those of the largest probabilities.
    "moe_capacity_probs": dict(moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.05, swiglu=False,
                               moe_router_pre_softmax=False, moe_layer_freq=[1, 0, 1],
                               moe_expert_capacity_factor=0.75, moe_token_drop_policy="probs"),
    # moe_swiglu's model (top-3 before the softmax, every layer MoE), each expert keeping the earliest
    # ceil(16 x 3 / 4 x 0.5) = 6 tokens routed to it (sequence then micro-batch order).
    "moe_capacity_position": dict(moe_router_topk=3, moe_ffn_hidden_size=None, moe_aux_loss_coeff=0.1, swiglu=True,
                                  moe_router_pre_softmax=True, moe_layer_freq=1, moe_expert_capacity_factor=0.5,
                                  moe_token_drop_policy="position"),
}
# Megatron's defaults of the router's options the goldens above leave out.
ROUTER_DEFAULTS = dict(moe_z_loss_coeff=None, moe_router_topk_scaling_factor=None, moe_router_num_groups=None,
                       moe_router_group_topk=None)
# The load-balancing options' defaults (Megatron's), which the goldens above leave out.
BALANCE_DEFAULTS = dict(moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3,
                        moe_router_load_balancing_type="aux_loss")
# TransformerConfig fields a golden may set beyond the above (gen_moe_shared_golden.py's shared experts), with their
# defaults' types: recorded in the golden's config as given (the gate as 0 or 1), passed as that type.
EXTRA_CONFIG = dict(moe_shared_expert_intermediate_size=0, moe_shared_expert_gate=False)


def build(torch, g):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    c = dict(COMMON, **ROUTER_DEFAULTS, **BALANCE_DEFAULTS)
    c.update(g)
    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["ffn_hidden_size"], use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, init_method_std=c["init_method_std"], gated_linear_unit=c["swiglu"],
        activation_func=F.silu if c["swiglu"] else F.gelu, bias_activation_fusion=False,
        num_moe_experts=c["num_experts"], moe_router_topk=c["moe_router_topk"],
        moe_ffn_hidden_size=c["moe_ffn_hidden_size"] or c["ffn_hidden_size"],
        moe_aux_loss_coeff=c["moe_aux_loss_coeff"], moe_router_load_balancing_type=c["moe_router_load_balancing_type"],
        moe_router_pre_softmax=c["moe_router_pre_softmax"], moe_token_dispatcher_type="allgather",
        moe_router_score_function=c["moe_router_score_function"],
        calculate_per_token_loss=c["calculate_per_token_loss"],
        moe_grouped_gemm=False, moe_layer_freq=c["moe_layer_freq"], moe_router_dtype="fp32",
        moe_z_loss_coeff=c["moe_z_loss_coeff"], moe_router_topk_scaling_factor=c["moe_router_topk_scaling_factor"],
        moe_router_num_groups=c["moe_router_num_groups"], moe_router_group_topk=c["moe_router_group_topk"],
        moe_router_enable_expert_bias=c["moe_router_enable_expert_bias"],
        moe_router_bias_update_rate=c["moe_router_bias_update_rate"],
        moe_expert_capacity_factor=c.get("moe_expert_capacity_factor"),
        moe_token_drop_policy=c.get("moe_token_drop_policy", "probs"),
        moe_pad_expert_input_to_capacity=c.get("moe_pad_expert_input_to_capacity", False),
        **{k: type(v)(c[k]) for k, v in EXTRA_CONFIG.items() if k in c})
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["padded_vocab_size"],
                   max_sequence_length=c["max_position_embeddings"], position_embedding_type="learned_absolute",
                   share_embeddings_and_output_weights=False)
    return (c, gpt) + mcore_golden.ddp_optimizer_scheduler(cfg, gpt, c)


def run(torch, name, g, out_dir):
    """Trains golden `name` (settings g) and writes OUT_DIR/NAME.{json,bin}; returns the step records and the
    tensors' bytes."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    torch.manual_seed(1234)
    get_moe_layer_wise_logging_tracker().clear()  # a fresh run's: its entries in the order its layers save them
    c, gpt, model, opt, sched = build(torch, g)
    blob = mcore_golden.Blob()
    m = c["num_micro_batches"]
    moe_layers = sum(c["moe_layer_freq"]) if isinstance(c["moe_layer_freq"], list) else c["num_layers"]

    def on_step(step, record):
        # Megatron-LM's training_log: the tracker's per-layer sums x 1 / micro-batches, over the MoE layers.
        tracker = get_moe_layer_wise_logging_tracker()
        logged = {k: float((tracker[k]["values"] * (1.0 / m)).sum() / moe_layers) for k in tracker}
        record.update({"load_balancing_loss": logged.get("load_balancing_loss", 0.0),
                       "z_loss": logged.get("z_loss", 0.0), "tracker_order": list(tracker)})
        for k in ("seq_load_balancing_loss", "global_load_balancing_loss"):
            if k in logged:
                record[k] = logged[k]
        if c["moe_router_enable_expert_bias"]:
            for n, buf in gpt.named_buffers():
                if n.endswith("router.expert_bias"):
                    blob.put(f"expert_bias:{step}:{n}", buf.float())

    steps = mcore_golden.train(torch, c, gpt, model, opt, sched, blob, STEPS, moe=True, on_step=on_step)
    config = {k: v for k, v in c.items() if k != "moe_layer_freq"}
    config["moe_ffn_hidden_size"] = c["moe_ffn_hidden_size"] or 0
    for k in ROUTER_DEFAULTS:  # None: 0
        config[k] = c[k] or 0
    if c["moe_router_enable_expert_bias"]:
        config["state_dict_keys"] = [k for k in gpt.state_dict() if "router" in k]
    config["moe_layer_pattern"] = (c["moe_layer_freq"] if isinstance(c["moe_layer_freq"], list)
                                   else [1 if i % c["moe_layer_freq"] == 0 else 0 for i in range(c["num_layers"])])
    mcore_golden.write_golden(torch, out_dir, name, "tests/support/gen_moe_golden.py", config, steps, blob, gpt)
    return steps, bytes(blob.blob)


# Token dropping's count over a run, and how often torch's own top-k kept another set than the stable one.
DROPS = {"routed": 0, "dropped": 0, "torch_differs": 0}


def stable_token_dropping(torch):
    """Megatron's apply_router_token_dropping with a stable top-k: among equal values the earlier token.

    Its "position" policy is a top-k of the 0/1 routing map over the tokens: torch's CPU top-k (sorted=False)
    returns an arbitrary set among equal values (in torch 2.6 not the earliest tokens), while Megatron documents
    the policy as dropping the tokens at the end. The goldens use the documented selection; the probabilities'
    policy is checked to keep the very set torch's own top-k keeps (no ties among the routed probabilities)."""
    import megatron.core.transformer.moe.router as router
    from megatron.core.transformer.moe import moe_utils
    original = moe_utils.apply_router_token_dropping

    def stable_topk(x, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)

    def dropping(probs, routing_map, **kw):
        own = original(probs, routing_map, **kw)
        topk, torch.topk = torch.topk, stable_topk
        try:
            stable = original(probs, routing_map, **kw)
        finally:
            torch.topk = topk
        kept = stable[1] & routing_map
        differs = not torch.equal(own[1] & routing_map, kept)
        assert not (differs and kw["drop_policy"] == "probs"), "torch's top-k kept other slots among equal probs"
        DROPS["routed"] += int(routing_map.sum())
        DROPS["dropped"] += int(routing_map.sum() - kept.sum())
        DROPS["torch_differs"] += int(differs)
        return stable

    router.apply_router_token_dropping = dropping


def run_capacity(torch, name, g, out_dir):
    """A token-dropping golden: written as the others, with slots really dropped; the same run with
    --moe-pad-expert-input-to-capacity (the padded rows' probability 0) gives the same numbers."""
    for k in DROPS:
        DROPS[k] = 0
    steps, blob = run(torch, name, g, out_dir)
    assert DROPS["dropped"] > 0, f"{name}: no token was dropped"
    print(f"{name}: {DROPS}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        padded, padded_blob = run(torch, name, dict(g, moe_pad_expert_input_to_capacity=True), tmp)
    import numpy
    a, b = numpy.frombuffer(blob, "<f4"), numpy.frombuffer(padded_blob, "<f4")
    worst = float(numpy.max(numpy.abs(a - b) / numpy.maximum(numpy.abs(a), 1e-6)))
    for mine, pad in zip(steps, padded):
        for key in ("lm_loss", "grad_norm", "load_balancing_loss"):
            assert abs(mine[key] - pad[key]) <= 1e-6 * max(1.0, abs(mine[key])), (name, key, mine[key], pad[key])
    assert worst <= 1e-5, (name, "padding changed the tensors", worst)
    print(f"{name}: padded to capacity, the largest relative difference {worst:.3g}", file=sys.stderr)


def main():
    out_dir = sys.argv[1]
    with mcore_golden.one_cpu_rank(moe=True) as torch:
        names = sys.argv[2:] or list(GOLDENS)  # some of them: the others' files stay as they are
        stable_token_dropping(torch)
        for name in names:
            if "moe_expert_capacity_factor" in GOLDENS[name]:
                run_capacity(torch, name, GOLDENS[name], out_dir)
            else:
                run(torch, name, GOLDENS[name], out_dir)


if __name__ == "__main__":
    main()
