#!/usr/bin/env python3
"""Generates tests/data/gpt_dataset/validation_sets.json: the validation datasets megatron-core's
BlendedMegatronDatasetBuilder builds for --multiple-validation-sets and --full-validation (its config's
multiple_validation_sets and full_validation; Megatron-LM's get_train_valid_test_num_samples gives the
validation split no size, None, with --full-validation), over the committed gpt_data/{A,B,C}: each
set's class, length and the tokens (sequence_length + 1) of its samples by index (the order Megatron's
pretraining sampler reads them): every sample for multiple_full, a few for the others.

  PYTHONPATH=/opt/ptk-pyref /opt/ptk-torch26/bin/python tests/support/gen_validation_sets_golden.py

(or Debian's python3 with megatron-core 0.16.1 on PYTHONPATH, as gen_gpt_dataset_goldens.py).
"""
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_shim  # noqa: E402
import ref_env  # noqa: E402

DATA = os.path.join(ref_env.ROOT, "tests", "data", "gpt_dataset")
OUT = os.path.join(DATA, "validation_sets.json")
SEQ = 8
SEED = 1234

# name -> (per-split blends, sizes, multiple_validation_sets, full_validation)
CONFIGS = {
    # --full-validation --multiple-validation-sets: one epoch of each prefix, apart
    "multiple_full": ([["gpt_data/A"], ["gpt_data/B", "gpt_data/C"], None], [40, None, None], True, True),
    # --skip-train --multiple-validation-sets: --eval-iters x global batch (here 12) of each prefix
    "multiple_sized": ([["gpt_data/A"], ["gpt_data/B", "gpt_data/C"], None], [40, 12, None], True, False),
    # --full-validation alone: the prefixes' exhaustive blend
    "full_blend": ([["gpt_data/A"], ["gpt_data/B", "gpt_data/C"], None], [40, None, None], False, True),
}


def main():
    megatron_shim.install(training_args=True)
    work = tempfile.mkdtemp(prefix="ptk-validsets-")
    megatron_shim.offline_gpt2_workdir(work, ref_env.VOCAB, ref_env.MERGES)
    shutil.copytree(os.path.join(DATA, "gpt_data"), os.path.join(work, "gpt_data"))
    os.chdir(work)
    megatron_shim.one_process_gloo_group()
    tok = megatron_shim.gpt2_bpe_tokenizer()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    out = {"sequence_length": SEQ, "random_seed": SEED, "configs": {}}
    for name, (per_split, sizes, multiple, full) in CONFIGS.items():
        cfg = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, tokenizer=tok,
                               blend_per_split=[get_blend_from_list(x) for x in per_split],
                               multiple_validation_sets=multiple, full_validation=full,
                               reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        valid = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()[1]
        sets = valid if isinstance(valid, list) else [valid]
        rec = []
        for ds in sets:
            n = len(ds)
            picks = range(n) if name == "multiple_full" else sorted({0, 1, n // 2, n - 1})
            rec.append({"class": type(ds).__name__, "length": n,
                        "samples": {str(i): ds[i]["tokens"].tolist() + ds[i]["labels"].tolist()[-1:] for i in picks}})
        out["configs"][name] = {"sizes": sizes, "multiple_validation_sets": multiple, "full_validation": full,
                                "sets": rec}
        print(f"{name}: " + ", ".join(f"{r['class']}[{r['length']}]" for r in rec), file=sys.stderr)
    with open(OUT, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
