"""Checks gen_megatron_checkpoint.py's two models of megatron-core against megatron-core itself: the
parameter order (megatron_names: a local-spec GPTModel's named_parameters, linear_proj before
linear_qkv) and the distributed optimizer's grad-buffer layout (dist_opt_offsets: where each
parameter lies in distrib_optim.pt's world tensors), against _ParamAndGradBuffer's param_index_map and
buckets for one bucket, 1000-element buckets and a shared embedding with 700-element buckets.
ptk-convert's reader (interop/megatron_optim.cpp) is checked bit for bit against the generator by
megatron_checkpoint_test. Needs PyTorch >= 2.1 (a private venv) and megatron-core (0.16.1 under
/opt/ptk-pyref); CPU only (gloo, world size 1). Not run by CTest (Debian's PyTorch is 1.13).

Usage: V/bin/python tests/support/check_distrib_layout_with_megatron_core.py [/opt/ptk-pyref]
"""
import os
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/opt/ptk-pyref")
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    torch.cuda.current_device = lambda: "cpu"  # the buffers' device: CPU here
    import gen_megatron_checkpoint as gen
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
        parallel_state.initialize_model_parallel(1, 1)
        cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=64,
                                use_cpu_initialization=True)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=56,
                         max_sequence_length=16, position_embedding_type="learned_absolute",
                         share_embeddings_and_output_weights=False)
        named = list(model.named_parameters())
        order = [n for n, _ in gen.megatron_names(2, True, "local")]
        print("named_parameters order:", "ok" if order == [n for n, _ in named] else f"MISMATCH {order}")
        bad += order != [n for n, _ in named]
        groups = types.SimpleNamespace(tp=parallel_state.get_tensor_model_parallel_group(),
                                       dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True))
        for bucket, shared in ((None, False), (1000, False), (700, True)):
            params = [p for _, p in named]
            if shared:
                params[0].shared_embedding = True
            ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=bucket)
            buf = _ParamAndGradBuffer(ddp, torch.float32, torch.float32, params,
                                      parallel_state.get_data_parallel_group(), bucket, {p: n for n, p in named},
                                      1.0, list(range(len(params))), False, groups)
            starts = [s for s, _ in buf.bucket_indices]
            unpadded = [b.numel_unpadded for b in buf.buckets]
            mine, total = gen.dist_opt_offsets([(n, p.numel()) for n, p in named],
                                               {named[0][0]} if shared else set(), bucket)
            ok = total == buf.numel_unpadded
            for n, p in named:  # get_parameter_state_dp_zero: the buckets' unpadded spans concatenated
                s, _, b = buf.param_index_map[p]
                ok &= s - starts[b] + sum(unpadded[:b]) == mine[n]
            print(f"bucket size {bucket}, shared embedding {shared}: {len(buf.buckets)} buckets, "
                  f"numel_unpadded {buf.numel_unpadded}: {'ok' if ok else 'MISMATCH'}")
            bad += not ok
            if shared:
                del params[0].shared_embedding
        dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
