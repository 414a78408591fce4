"""Writes tests/data/trainer/mtp_NAME.{json,bin}: megatron-core's own GPT with multi-token prediction trained on
the CPU, the golden of ptk's CPU multi-token prediction (tests/trainer/mtp_model_golden_test.cpp).

megatron-core 0.16.1 (/opt/ptk-pyref) builds a tiny dense GPTModel from its local (non-TE) spec with
mtp_block_spec = get_gpt_mtp_block_spec(config, layer spec, use_transformer_engine=False) (MultiTokenPredictionBlock:
enorm, hnorm, eh_proj, a transformer layer and final_layernorm per depth), fp32, no dropout, on one gloo rank with
the CUDA calls pointed at the CPU (gen_moe_golden.py's setup). It is wrapped in megatron-core's
DistributedDataParallel and stepped by its optimizer and OptimizerParamScheduler; each micro-batch's loss is the
masked mean over its tokens divided by the micro-batches (or with --calculate-per-token-loss the masked sum, the
gradients divided by the global batch's tokens in finalize_model_grads), with MTPLossAutoScaler's scale set as
megatron-core's schedules set it (1 / micro-batches; 1 per token). Written: the initial weights (init:NAME), the
first step's gradients (grad:NAME, main_grad before the update), the weights after the last step (final:NAME), and
per step the lm loss, the grad norm and each depth's mtp loss as Megatron-LM's training_log computes it
(MTPLossLoggingHelper's per-micro-batch values x 1 / micro-batches; one rank, so its average over the data ranks is
the value itself).

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_mtp_golden.py tests/data/trainer [NAME ...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_golden  # noqa: E402

STEPS = 3
COMMON = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, seq_length=8,
              max_position_embeddings=8, vocab_size=40, padded_vocab_size=40, micro_batch_size=2,
              num_micro_batches=2, lr=1e-2, min_lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              adam_eps=1e-8, clip_grad=1.0, init_method_std=0.02, calculate_per_token_loss=False)
GOLDENS = {
    # Two depths, tied embeddings (the depths' embedding and output layer are the word embeddings), learned
    # positions (rolled with the tokens), GELU MLP with biases, LayerNorm; factor 0.3.
    "mtp_tied": dict(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, untie=False),
    # One depth, untied output layer, --calculate-per-token-loss with a quarter of the tokens masked; Megatron's
    # default factor 0.1.
    "mtp_per_token": dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.1, untie=True, calculate_per_token_loss=True),
}


def build(torch, g):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    c = dict(COMMON)
    c.update(g)
    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["ffn_hidden_size"], use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=True, init_method_std=c["init_method_std"], activation_func=F.gelu,
        bias_activation_fusion=False, calculate_per_token_loss=c["calculate_per_token_loss"],
        mtp_num_layers=c["mtp_num_layers"], mtp_loss_scaling_factor=c["mtp_loss_scaling_factor"])
    spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["padded_vocab_size"],
                   max_sequence_length=c["max_position_embeddings"], position_embedding_type="learned_absolute",
                   share_embeddings_and_output_weights=not c["untie"], mtp_block_spec=mtp_spec)
    return (c, gpt) + mcore_golden.ddp_optimizer_scheduler(cfg, gpt, c)


def run(torch, name, g, out_dir):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    torch.manual_seed(1234)
    MTPLossLoggingHelper.tracker.clear()
    c, gpt, model, opt, sched = build(torch, g)
    m = c["num_micro_batches"]

    def log_mtp(step, record):
        values = MTPLossLoggingHelper.tracker["values"]
        record["mtp_losses"] = [float(v) / m for v in values]  # track_mtp_metrics' loss_scale 1 / micro-batches
        values.zero_()

    blob = mcore_golden.Blob()
    # mtp: MTPLossAutoScaler's scale set before each backward (the MTP losses' gradients are made in backward),
    # the loss mask passed to the forward.
    steps = mcore_golden.train(torch, c, gpt, model, opt, sched, blob, STEPS, mtp=True, on_step=log_mtp)
    assert len(steps[0]["mtp_losses"]) == c["mtp_num_layers"]
    mcore_golden.write_golden(torch, out_dir, name, "tests/support/gen_mtp_golden.py", dict(c), steps, blob, gpt)


def main():
    out_dir = sys.argv[1]
    with mcore_golden.one_cpu_rank() as torch:
        for name in sys.argv[2:] or list(GOLDENS):
            run(torch, name, GOLDENS[name], out_dir)


if __name__ == "__main__":
    main()
