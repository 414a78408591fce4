"""What the goldens that train megatron-core's own GPT on the CPU share (gen_swa_golden.py,
gen_gated_attention_golden.py, gen_mla_golden.py, gen_mtp_golden.py, gen_mtp_moe_golden.py, gen_moe_golden.py and
gen_moe_shared_golden.py): megatron-core 0.16.1 on one gloo rank with the CUDA calls
pointed at the CPU (make_torch_dist_distopt_fixture.cpu_shims), the model wrapped in its DistributedDataParallel and
stepped by its optimizer (get_megatron_optimizer: Adam with decoupled weight decay, clipping) and
OptimizerParamScheduler (a constant learning rate), each micro-batch's loss the masked mean over its tokens divided
by the number of micro-batches (or with --calculate-per-token-loss the masked sum, the gradients divided by the
global batch's loss tokens in finalize_model_grads), as megatron-core's schedules do.

A golden is NAME.json (sort_keys, indent 1: the generator, the versions, the configuration, per step the lm loss
and grad norm and what the script adds, the tensor directory: key -> shape and byte offset, and the parameters'
order) and NAME.bin (the tensors back to back, little-endian float32 or int32): the initial weights (init:NAME),
the tokens, labels and loss mask, the first step's gradients (grad:NAME, the DDP buffer's main_grad before the
update) and the weights after the last step (final:NAME).
"""
import contextlib
import json
import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_torch_dist_distopt_fixture import cpu_shims  # noqa: E402


@contextlib.contextmanager
def one_cpu_rank(moe=False, mla=False):
    """megatron-core on this one process: cpu_shims, a gloo group of one rank, Megatron's CUDA RNG state taken
    from torch's, model parallel sizes 1 and the model-parallel seed 1234. Yields torch. With moe, moe_utils'
    te_general_gemm (imported under HAVE_TE) set to None: the torch.mm path without TE. With mla,
    multi_latent_attention's HAVE_TE False: its TE imports half succeed without TE (HAVE_TE True, TELinear None)
    and the fp8 check on linear_proj then calls isinstance(x, None)."""
    import torch
    import torch.distributed as dist
    cpu_shims(torch)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core import parallel_state
        mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
        mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
        if moe:
            import megatron.core.transformer.moe.moe_utils as moe_utils
            if not hasattr(moe_utils, "te_general_gemm"):
                moe_utils.te_general_gemm = None
        if mla:
            import megatron.core.transformer.multi_latent_attention as mla_module
            mla_module.HAVE_TE = False
        parallel_state.initialize_model_parallel(1, 1)
        mrandom.model_parallel_cuda_manual_seed(1234)
        yield torch
        dist.destroy_process_group()


def ddp_optimizer_scheduler(cfg, gpt, c):
    """gpt wrapped in megatron-core's DistributedDataParallel, its optimizer from c's lr, min_lr, weight_decay,
    adam_* and clip_grad, and an OptimizerParamScheduler at a constant lr and weight decay."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=c["lr"], min_lr=c["min_lr"], weight_decay=c["weight_decay"], adam_beta1=c["adam_beta1"],
        adam_beta2=c["adam_beta2"], adam_eps=c["adam_eps"], clip_grad=c["clip_grad"]), [model])
    gbs = c["micro_batch_size"] * c["num_micro_batches"]
    sched = OptimizerParamScheduler(opt, init_lr=c["lr"], max_lr=c["lr"], min_lr=c["min_lr"], lr_warmup_steps=0,
                                    lr_decay_steps=100 * gbs, lr_decay_style="constant",
                                    start_wd=c["weight_decay"], end_wd=c["weight_decay"], wd_incr_steps=100 * gbs,
                                    wd_incr_style="constant")
    return model, opt, sched


class Blob:
    """The golden's tensors: `tensors` (key -> shape and byte offset) and the bytes."""

    def __init__(self):
        self.blob = bytearray()
        self.tensors = {}

    def put(self, key, t, fmt="<f"):
        flat = t.detach().flatten().tolist()
        self.tensors[key] = {"shape": list(t.shape), "offset": len(self.blob)}
        self.blob.extend(struct.pack(f"<{len(flat)}{fmt[-1]}", *flat))

    def put_params(self, prefix, gpt, main_grad=False):
        for n, p in gpt.named_parameters():
            self.put(prefix + n, (p.main_grad if main_grad else p).float())


def train(torch, c, gpt, model, opt, sched, blob, steps, moe=False, mtp=False, on_step=None):
    """`steps` optimizer steps of c["num_micro_batches"] micro-batches (c's micro_batch_size x seq_length tokens below
    vocab_size, torch.Generator seed 7; with c["calculate_per_token_loss"] a quarter of them masked, seed 11),
    written to blob with the initial weights, the first step's gradients and the final weights. With moe, the aux
    losses' tracker cleared before each step and MoEAuxLossAutoScaler given the schedule's loss scale (1 /
    micro-batches; 1 per token) before each backward; with mtp, MTPLossAutoScaler given it and the model's forward
    the loss mask. Each step's record is {"lm_loss", "grad_norm"}; on_step(step, record), if given, runs after the
    scheduler's step and may add to the record and write to blob. Returns the records."""
    from megatron.core.distributed import finalize_model_grads
    scalers = []
    if moe:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker
        scalers.append(MoEAuxLossAutoScaler)
    if mtp:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
        scalers.append(MTPLossAutoScaler)
    blob.put_params("init:", gpt)
    gen = torch.Generator().manual_seed(7)
    b, s, m = c["micro_batch_size"], c["seq_length"], c["num_micro_batches"]
    tokens = torch.randint(0, c["vocab_size"], (steps * m, b, s + 1), generator=gen)
    blob.put("tokens", tokens[:, :, :-1].to(torch.int32), "<i")
    blob.put("labels", tokens[:, :, 1:].to(torch.int32), "<i")
    per_token = c.get("calculate_per_token_loss", False)
    # --calculate-per-token-loss: a quarter of the tokens masked, so that its scaling (the router's tokens,
    # padding too, over the loss's) differs from 1 / micro-batches.
    mask = ((torch.rand(steps * m, b, s, generator=torch.Generator().manual_seed(11)) > 0.25).float() if per_token
            else torch.ones(steps * m, b, s))
    blob.put("loss_mask", mask)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    records = []
    for step in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        if moe:
            clear_aux_losses_tracker()
        lm, total = 0.0, float(mask[step * m:(step + 1) * m].sum())
        for k in range(m):
            x, mk = tokens[step * m + k], mask[step * m + k]
            extra = {"loss_mask": mk} if mtp else {}
            losses = model(x[:, :-1], pos, None, labels=x[:, 1:], **extra).float()
            # pretrain_gpt's loss_func and the schedule's scaling (forward_step_calc_loss, the auto-scalers').
            loss = (losses * mk).sum() if per_token else (losses * mk).sum() / mk.sum() / m
            for cls in scalers:
                cls.set_loss_scale(torch.ones(1) if per_token else torch.ones(1) / m)
            loss.backward()
            lm += float(loss) / total if per_token else float(loss)
        # Megatron-LM's finalize_model_grads: the data-parallel reduction, and with per-token loss the
        # division by the global batch's loss tokens.
        finalize_model_grads([model], num_tokens=torch.tensor(total) if per_token else None)
        if step == 0:
            blob.put_params("grad:", gpt, main_grad=True)
        ok, grad_norm, _ = opt.step()
        assert ok
        sched.step(increment=b * m)
        records.append({"lm_loss": lm, "grad_norm": float(grad_norm)})
        if on_step is not None:
            on_step(step, records[-1])
    blob.put_params("final:", gpt)
    return records


def write_golden(torch, out_dir, name, generator, config, steps, blob, gpt, **extra):
    """OUT_DIR/NAME.json and OUT_DIR/NAME.bin (the module's docstring); `extra`: more top-level json keys."""
    from megatron.core import package_info
    meta = {"generator": generator, "megatron_core": package_info.__version__, "torch": torch.__version__,
            "config": config, "steps": steps, "tensors": blob.tensors,
            "param_order": [n for n, _ in gpt.named_parameters()], **extra}
    with open(os.path.join(out_dir, name + ".json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.write("\n")
    with open(os.path.join(out_dir, name + ".bin"), "wb") as fh:
        fh.write(bytes(blob.blob))
    print(f"wrote {name}: {steps}", file=sys.stderr)
