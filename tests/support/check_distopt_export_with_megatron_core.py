"""Checks `ptk-convert --saver megatron --target-use-distributed-optimizer` against megatron-core 0.16.1
itself: its DistributedOptimizer loads the export as Megatron-LM's load_checkpoint does for
`--ckpt-format torch --use-distributed-optimizer` (load_state_dict of model_optim_rng.pt's optimizer, then
load_parameter_state of distrib_optim.pt beside it: megatron-core's own torch.load, numel_unpadded
check and scatter into each parameter's main param and Adam moments), and every parameter's fp32 main
param, exp_avg and exp_avg_sq must then equal the ptk checkpoint's bit for bit, Adam's step too.

The ptk checkpoint: gen_megatron_checkpoint.py's GPT (local layer names, tied, 4 layers, a real torch
Adam's moments after two steps) imported by ptk-convert. Exported three times: pipeline size 2 with
--target-num-layers-per-virtual-pipeline-stage 1 (2 model chunks a rank: distrib_optim.pt holds a grad
buffer per chunk, and the tied embedding's copy a bucket of its own), pipeline size 1, and the first again
with --target-ddp-bucket-size 40 (a run of --overlap-grad-reduce --ddp-bucket-size 40: stage 0's chunk 0
in buckets whose end padding the file leaves out). Each pipeline
rank is a process (gloo): megatron-core's parallel_state with the virtual stages, each chunk a GPTModel of
its vp_stage in DistributedDataParallel as Megatron-LM's get_model wraps it, one optimizer from
get_megatron_optimizer over the chunks; the chunks' weights loaded from model0, model1, ... (strict).

Needs PyTorch >= 2.4 and megatron-core (/opt/ptk-torch26 with PYTHONPATH=/opt/ptk-pyref); CPU only, run
by hand (CI's Debian PyTorch 1.13 cannot run megatron-core). megatron-core's CUDA calls are pointed at the
CPU as make_torch_dist_distopt_fixture.py does.

Usage: /opt/ptk-torch26/bin/python tests/support/check_distopt_export_with_megatron_core.py BIN_DIR
           [/opt/ptk-pyref]
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, HIDDEN, HEADS, VOCAB, DIVISIBLE, POSITIONS = 4, 16, 4, 50, 8, 16


def read_ptk(save):
    """The ptk checkpoint's tensors by name: (params, exp_avg, exp_avg_sq) as float32 arrays; Adam's step."""
    import numpy
    it = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    data = open(os.path.join(save, f"iter_{it:07d}", "mp_rank_00", "model_optim_rng.ptk"), "rb").read()
    (n,) = struct.unpack("<Q", data[8:16])
    h = json.loads(data[16:16 + n])
    arr = numpy.frombuffer(data[16 + n:-64], dtype="<f4").reshape(3, h["num_params"])
    out = {}
    for t in h["tensors"]:
        size = int(numpy.prod(t["shape"]))
        out[t["name"]] = [arr[k, t["offset"]:t["offset"] + size].reshape(t["shape"]) for k in range(3)]
    return out, h["adam_step"]


def rank(p, pp, vp, export, ptk, pyref, store, result):
    """Pipeline rank p of pp: load the export's files into megatron-core and compare with the ptk checkpoint."""
    sys.path.insert(0, pyref)
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    from make_torch_dist_distopt_fixture import cpu_shims
    cpu_shims(torch)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=p, world_size=pp)
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    mrandom._set_cuda_rng_state = lambda state, *x, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *x, **k: torch.get_rng_state()
    parallel_state.initialize_model_parallel(1, pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    mrandom.model_parallel_cuda_manual_seed(1234)
    it = int(open(os.path.join(export, "latest_checkpointed_iteration.txt")).read())
    rank_dir = os.path.join(export, f"iter_{it:07d}", f"mp_rank_00_{p:03d}" if pp > 1 else "mp_rank_00")
    sd = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), weights_only=False)
    a = sd["args"]
    cfg = TransformerConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                            ffn_hidden_size=a.ffn_hidden_size, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vp if vp > 1 else None, pipeline_dtype=torch.float32,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    chunks = [GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=a.padded_vocab_size,
                       max_sequence_length=a.max_position_embeddings, position_embedding_type="learned_absolute",
                       share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                       vp_stage=v if vp > 1 else None, pre_process=v == 0 and p == 0,
                       post_process=v == vp - 1 and p == pp - 1) for v in range(vp)]
    for v, m in enumerate(chunks):  # the weights, as Megatron-LM's load_checkpoint loads them (strict)
        m.load_state_dict(sd[f"model{v}" if vp > 1 else "model"], strict=True)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=a.use_distributed_optimizer,
                                               overlap_grad_reduce=a.overlap_grad_reduce,
                                               bucket_size=getattr(a, "ddp_bucket_size", None))
    ddp = [DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=m, disable_bucketing=v > 0)
           for v, m in enumerate(chunks)]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay,
                                                 adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, adam_eps=a.adam_eps,
                                                 use_distributed_optimizer=True), ddp)
    # Megatron-LM's load_checkpoint (--ckpt-format torch, --use-distributed-optimizer).
    opt.load_state_dict(sd["optimizer"])
    dopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    # megatron-core 0.16.1's _set_main_param_and_optimizer_states copies every key of a parameter's Adam
    # state from the file, which holds no "step": torch's Adam (this CPU's fallback for Transformer Engine's
    # FusedAdam, which keeps no per-parameter step) has one since load_state_dict, so the step is set aside
    # around the load as a GPU run's state lacks it (its own save_parameter_state's files fail alike here).
    steps = {p_: st.pop("step") for p_, st in dopt.optimizer.state.items()}
    with torch.no_grad():  # an fp32 run's main params are views of the model's (leaf) parameters
        opt.load_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    for p_, step in steps.items():
        dopt.optimizer.state[p_]["step"] = step
    want, want_step = read_ptk(ptk)
    per_chunk = LAYERS // (pp * vp)
    bad, checked = [], 0
    for v, m in enumerate(chunks):
        first_layer = (v * pp + p) * per_chunk
        for name, param in m.named_parameters():
            if name.startswith("decoder.layers."):
                _, _, layer, rest = name.split(".", 3)
                ptk_name = f"decoder.layers.{first_layer + int(layer)}.{rest}"
            else:
                ptk_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" and \
                    not a.untie_embeddings_and_output_weights else name
            st = dopt._get_main_param_and_optimizer_states(param)
            for k, key in enumerate(("param", "exp_avg", "exp_avg_sq")):
                got = st[key].detach().reshape(param.shape).numpy()
                w = want[ptk_name][k]
                rows = min(got.shape[0], w.shape[0])  # the vocabulary's rows beyond ptk's: none at divisor 8
                if got.shape != w.shape or got[:rows].tobytes() != w[:rows].tobytes():
                    bad.append(f"rank {p} chunk {v} {name} {key}")
            if float(st["step"]) != want_step:
                bad.append(f"rank {p} chunk {v} {name}: Adam step {float(st['step'])}, ptk's {want_step}")
            if param.detach().numpy().tobytes() != want[ptk_name][0].tobytes():
                bad.append(f"rank {p} chunk {v} {name}: the model's weight")
            checked += 1
    dist.destroy_process_group()
    with open(result, "w") as f:
        json.dump({"bad": bad, "checked": checked, "buffers": len(dopt.buffers)}, f)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "rank":  # rank P PP VP EXPORT PTK PYREF STORE RESULT
        rank(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:10])
        return
    bin_dir = sys.argv[1]
    pyref = sys.argv[2] if len(sys.argv) > 2 else "/opt/ptk-pyref"
    convert = os.path.join(bin_dir, "ptk-convert")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        meg, ptk = os.path.join(tmp, "meg"), os.path.join(tmp, "ptk")
        subprocess.run([sys.executable, os.path.join(HERE, "gen_megatron_checkpoint.py"), meg, "--impl", "local",
                        "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--heads", str(HEADS), "--vocab", str(VOCAB),
                        "--divisible", str(DIVISIBLE), "--positions", str(POSITIONS)], check=True)
        subprocess.run([convert, "--loader", "megatron", "--saver", "ptk", "--load-dir", meg, "--save-dir", ptk],
                       check=True, capture_output=True)
        for pp, vp, bucket in ((2, 2, 0), (1, 1, 0), (2, 2, 40)):
            export = os.path.join(tmp, f"export-pp{pp}-vp{vp}-b{bucket}")
            flags = ["--target-pipeline-parallel-size", str(pp)]
            if bucket:
                flags += ["--target-ddp-bucket-size", str(bucket)]
            if vp > 1:
                flags += ["--target-num-layers-per-virtual-pipeline-stage", str(LAYERS // (pp * vp))]
            subprocess.run([convert, "--loader", "ptk", "--saver", "megatron", "--load-dir", ptk, "--save-dir", export,
                            "--target-use-distributed-optimizer", "--saver-transformer-impl", "local",
                            "--make-vocab-size-divisible-by", str(DIVISIBLE), *flags], check=True, capture_output=True)
            store = os.path.join(tmp, f"store{pp}{vp}{bucket}")
            results = [os.path.join(tmp, f"r{pp}{vp}{bucket}.{p}") for p in range(pp)]
            procs = [subprocess.Popen([sys.executable, __file__, "rank", str(p), str(pp), str(vp), export, ptk, pyref,
                                       store, results[p]]) for p in range(pp)]
            if any(x.wait() != 0 for x in procs):
                print(f"FAIL: pipeline {pp} x {vp} chunks, bucket size {bucket or 'none'}: a rank failed (above)")
                failures += 1
                continue
            for p, r in enumerate(results):
                res = json.load(open(r))
                for b in res["bad"]:
                    print("FAIL:", b)
                failures += len(res["bad"])
                print(f"pipeline {pp} x {vp} chunks, bucket size {bucket or 'none'}, rank {p}: {res['checked']} "
                      f"parameters in {res['buffers']} grad "
                      f"buffer(s) loaded by megatron-core's DistributedOptimizer.load_parameter_state, "
                      f"{'bit for bit' if not res['bad'] else 'MISMATCHED'}")
    if failures:
        print(f"{failures} failure(s)")
        sys.exit(1)
    print("megatron-core 0.16.1 loads ptk-convert's distrib_optim.pt: params, moments and step bit for bit")


if __name__ == "__main__":
    main()
