"""Loads the committed torch_dist fixtures (tests/data/torch_dist/, make_torch_dist_fixture.py) with
megatron-core's own dist_checkpointing.load into a local-spec GPTModel at tensor-parallel size 1 (the
fixtures hold TP=2 chunks: megatron-core reshards) and compares every parameter with expected.json:
the fixtures' keys, stacking, shapes and splits are megatron-core's. The fp32 checkpoint must match bit
for bit; the --bf16 one holds bf16 model weights (expected.json has their fp32 masters), so it must
load and round-trip through bf16. Needs PyTorch >= 2.1 (a private venv) and megatron-core (0.16.1
under /opt/ptk-pyref); CPU only (gloo, world size 1). Not run by CTest (Debian's PyTorch is 1.13).

Usage: V/bin/python tests/support/check_torch_dist_with_megatron_core.py [/opt/ptk-pyref]
"""
import hashlib
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "torch_dist")


def main():
    sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/opt/ptk-pyref")
    import torch
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
        parallel_state.initialize_model_parallel(1, 1)
        bad = 0
        for name, hidden, untie, bf16, it in (("te_untied_fp32", 64, True, False, 30),
                                               ("local_tied_bf16", 16, False, True, 12)):
            cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=64,
                                    use_cpu_initialization=True, bf16=bf16,
                                    params_dtype=torch.bfloat16 if bf16 else torch.float32)
            model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                             max_sequence_length=16, position_embedding_type="learned_absolute",
                             share_embeddings_and_output_weights=not untie)
            # The tensors (the fixtures' extra-state objects are stand-ins megatron-core does not restore).
            sd = {k: v for k, v in model.sharded_state_dict().items() if isinstance(v, ShardedTensor)}
            loaded = dist_checkpointing.load(sd, os.path.join(DATA, name, f"iter_{it:07d}"),
                                             strict="assume_ok_unexpected")
            model.load_state_dict(loaded, strict=False)
            exp = json.load(open(os.path.join(DATA, name, "expected.json")))
            for pname, p in model.named_parameters():
                want = exp["tensors"][pname]["weight"]
                v = p.detach().float()[:want["shape"][0]]
                if bf16:  # the first values recorded, rounded to bf16 as the model holds them
                    ok = torch.equal(v.flatten()[:3], torch.tensor(want["first"]).to(torch.bfloat16).float())
                else:
                    ok = hashlib.sha256(v.contiguous().numpy().astype("<f4").tobytes()).hexdigest() == want["sha256"]
                print(f"{name}: {pname}: {'ok' if ok else 'MISMATCH'}")
                bad += not ok
        dist.destroy_process_group()
    print("all match" if not bad else f"{bad} mismatches")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
