"""Writes tests/data/trainer/swa_NAME.{json,bin}: megatron-core's own GPT with sliding window attention and
its softmax types trained on the CPU, the golden of ptk's CPU attention with --window-size,
--window-attn-skip-freq and --softmax-type (tests/trainer/swa_model_golden_test.cpp).

megatron-core 0.16.1 (/opt/ptk-pyref) builds a tiny GPTModel from its local (non-TE) spec
(get_gpt_layer_local_spec: DotProductAttention, whose FusedScaleMaskSoftmax takes the torch path in fp32:
get_sliding_window_causal_mask's mask on the layers is_layer_window_attention names, SoftmaxOne with the
softmax_offset of off-by-one (zeros) or learnable (a parameter per head, init_method's normal)) from a
TransformerConfig with window_size, window_attn_skip_freq and softmax_type. LayerNorm, the exact GELU MLP
(bias_activation_fusion False), biases, learned absolute positions, fp32, no dropout, on one gloo rank with
the CUDA calls pointed at the CPU (make_torch_dist_distopt_fixture.cpu_shims). It is wrapped in megatron-core's
DistributedDataParallel and stepped by its optimizer (get_megatron_optimizer: Adam with decoupled weight decay,
no decay on 1-D tensors such as softmax_offset, clipping) and OptimizerParamScheduler, each micro-batch's loss
the masked mean over its tokens divided by the number of micro-batches (gen_mla_golden.py's loop). Written: the
initial weights (init:NAME), the first step's gradients (grad:NAME, the DDP buffer's main_grad before the
update), the weights after the last step (final:NAME), per step the lm loss and the grad norm, and per layer
whether megatron-core's is_layer_window_attention gives it the window.

Usage: PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_swa_golden.py tests/data/trainer
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_golden  # noqa: E402

STEPS = 3
COMMON = dict(num_layers=3, hidden_size=16, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=24,
              seq_length=8, max_position_embeddings=8, vocab_size=40, padded_vocab_size=40, micro_batch_size=2,
              num_micro_batches=2, lr=1e-2, min_lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              adam_eps=1e-8, clip_grad=1.0, init_method_std=0.02, window_size=None, window_attn_skip_freq=None,
              softmax_type="vanilla")
GOLDENS = {
    # A window of 2 keys before each query on layers 1 and 2 of 3 (skip frequency 3: layer_number 3 has full
    # attention), the learnable softmax offset, grouped-query attention (2 groups of 2 heads). The init std is
    # larger than Megatron's default so that the offsets (init_method's normal) weigh in the softmax.
    "swa_learnable": dict(window_size=(2, 0), window_attn_skip_freq=3, softmax_type="learnable",
                          num_query_groups=2, init_method_std=0.5, lr=5e-2),
    # Off-by-one softmax (a zero logit beside the scores) with a window of 1 on the layers a list pattern names
    # ([0,1,1]: layer 1 full, layers 2 and 3 windowed).
    "swa_off_by_one": dict(window_size=(1, 0), window_attn_skip_freq=[0, 1, 1], softmax_type="off-by-one"),
    # The vanilla softmax with a window of 3 on every layer (no skip frequency).
    "swa_vanilla": dict(window_size=(3, 0)),
    # The learnable softmax offset without a window.
    "swa_learnable_full": dict(softmax_type="learnable", init_method_std=0.5),
}


def build(torch, g):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    c = dict(COMMON, **g)
    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_query_groups"], ffn_hidden_size=c["ffn_hidden_size"], use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=True, init_method_std=c["init_method_std"],
        activation_func=F.gelu, bias_activation_fusion=False, normalization="LayerNorm",
        window_size=c["window_size"], window_attn_skip_freq=c["window_attn_skip_freq"],
        softmax_type=c["softmax_type"])
    spec = get_gpt_layer_local_spec()
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["padded_vocab_size"],
                   max_sequence_length=c["max_position_embeddings"],
                   position_embedding_type="learned_absolute", share_embeddings_and_output_weights=False)
    return (c, gpt) + mcore_golden.ddp_optimizer_scheduler(cfg, gpt, c)


def run(torch, name, g, out_dir):
    torch.manual_seed(1234)
    c, gpt, model, opt, sched = build(torch, g)
    blob = mcore_golden.Blob()
    steps = mcore_golden.train(torch, c, gpt, model, opt, sched, blob, STEPS)
    from megatron.core.transformer.utils import is_layer_window_attention
    config = dict(c)
    config["window_size"] = list(c["window_size"]) if c["window_size"] else None
    mcore_golden.write_golden(torch, out_dir, name, "tests/support/gen_swa_golden.py", config, steps, blob, gpt,
                              window_layers=[is_layer_window_attention(c["window_size"], c["window_attn_skip_freq"],
                                                                       n + 1) for n in range(c["num_layers"])])


def main():
    out_dir = sys.argv[1]
    with mcore_golden.one_cpu_rank() as torch:
        for name, g in GOLDENS.items():
            run(torch, name, g, out_dir)


if __name__ == "__main__":
    main()
