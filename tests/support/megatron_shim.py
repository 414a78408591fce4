"""Runs megatron-core's own Python code (PyPI megatron-core, installed without its dependencies) on
Debian bookworm's python3-numpy 1.24 and python3-torch 1.13.

Importing any megatron.core module normally executes megatron/core/__init__.py, which pulls in
model-parallel code that needs torch >= 2 and numpy >= 1.25. install() registers megatron and
megatron.core as bare packages so that only the modules actually used are imported (the data
code: indexed_dataset, gpt_dataset, blended_dataset, the builder, the compiled helpers and the
tokenizers), and stubs the two helpers they take from elsewhere (megatron.core.utils.log_single_rank,
megatron.core.safe_globals). Nothing of Megatron's own logic is replaced. See
shared/reference/megatron-formats.md section 5 for the recipe this follows.
"""
import importlib.util
import logging
import os
import sys
import types


def _find_megatron_dir():
    for p in sys.path:
        cand = os.path.join(p or ".", "megatron", "core", "datasets", "indexed_dataset.py")
        if os.path.exists(cand):
            return os.path.join(p or ".", "megatron")
    raise SystemExit("megatron-core is not importable: pip install --no-deps --target DIR megatron-core==0.16.1 "
                     "and put DIR on PYTHONPATH (scripts/install-deps.sh --with-python-ref does this)")


def install(training_args=True):
    if "megatron.core.utils" in sys.modules and getattr(sys.modules["megatron.core.utils"], "_ptk_shim", False):
        return
    mdir = _find_megatron_dir()
    for name, path in (("megatron", mdir), ("megatron.core", os.path.join(mdir, "core"))):
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        sys.modules[name] = mod
    sys.modules["megatron"].core = sys.modules["megatron.core"]

    utils = types.ModuleType("megatron.core.utils")
    utils._ptk_shim = True

    def log_single_rank(logger, *args, rank=0, **kwargs):
        logger.log(*args, **kwargs)

    utils.log_single_rank = log_single_rank
    utils.accepts_parameter = lambda func, param: True
    sys.modules["megatron.core.utils"] = utils

    safe = types.ModuleType("megatron.core.safe_globals")
    import numpy
    safe.safe_numpy_load = numpy.load
    sys.modules["megatron.core.safe_globals"] = safe

    if training_args:
        # tools/preprocess_data.py takes its tokenizer flags from megatron.training (not on PyPI);
        # these are the flags build_tokenizer reads, with Megatron's defaults.
        training = types.ModuleType("megatron.training")
        training.__path__ = []
        arguments = types.ModuleType("megatron.training.arguments")

        def _add_tokenizer_args(parser):
            g = parser.add_argument_group(title="tokenizer")
            g.add_argument("--tokenizer-type", type=str, default=None)
            g.add_argument("--vocab-file", type=str, default=None)
            g.add_argument("--merge-file", type=str, default=None)
            g.add_argument("--tokenizer-model", type=str, default=None)
            g.add_argument("--vocab-size", type=int, default=None)
            g.add_argument("--tokenizer-special-tokens", type=str, nargs="+", default=None)
            g.add_argument("--tokenizer-metadata", type=str, default=None)
            g.add_argument("--tokenizer-hf-no-use-fast", action="store_false", dest="tokenizer_hf_use_fast")
            g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_false",
                           dest="tokenizer_hf_include_special_tokens")
            g.add_argument("--trust-remote-code", action="store_true")
            return parser

        arguments._add_tokenizer_args = _add_tokenizer_args
        sys.modules["megatron.training"] = training
        sys.modules["megatron.training.arguments"] = arguments
    logging.basicConfig(level=logging.WARNING)


def offline_gpt2_hub_cache(cache_dir, vocab, merges):
    """Megatron's GPT2BPETokenizer calls AutoTokenizer.from_pretrained("gpt2"). With no network, give
    the Hugging Face cache a "gpt2" snapshot made of the same vocab.json and merges.txt."""
    import shutil
    snap = os.path.join(cache_dir, "models--gpt2", "snapshots", "0" * 40)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(cache_dir, "models--gpt2", "refs"), exist_ok=True)
    with open(os.path.join(cache_dir, "models--gpt2", "refs", "main"), "w") as f:
        f.write("0" * 40)
    with open(os.path.join(snap, "config.json"), "w") as f:
        f.write('{"model_type": "gpt2", "vocab_size": 50257}')
    with open(os.path.join(snap, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 1024}')
    shutil.copyfile(vocab, os.path.join(snap, "vocab.json"))
    shutil.copyfile(merges, os.path.join(snap, "merges.txt"))
    os.environ["HF_HUB_CACHE"] = cache_dir
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def offline_gpt2_workdir(work, vocab, merges):
    """What Megatron's GPT2BPETokenizer needs, offline, in the directory `work`: the Hugging Face cache's
    "gpt2" (offline_gpt2_hub_cache, under work/hf) and gpt2-vocab.json / gpt2-merges.txt, the relative
    names gpt2_bpe_tokenizer() gives it (the dataset caches' descriptions record them)."""
    import shutil
    offline_gpt2_hub_cache(os.path.join(work, "hf"), vocab, merges)
    shutil.copyfile(vocab, os.path.join(work, "gpt2-vocab.json"))
    shutil.copyfile(merges, os.path.join(work, "gpt2-merges.txt"))


def one_process_gloo_group():
    """A torch.distributed gloo group of this one process: BlendedDataset asks it for the rank when it caches."""
    import socket
    import torch
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def gpt2_bpe_tokenizer():
    """Megatron's GPT2BPETokenizer from its build_tokenizer and its own tokenizer flags (install(training_args=True)
    first), over gpt2-vocab.json and gpt2-merges.txt in the working directory (offline_gpt2_workdir)."""
    import argparse
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer
    p = argparse.ArgumentParser()
    sys.modules["megatron.training.arguments"]._add_tokenizer_args(p)
    return build_tokenizer(p.parse_args(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2-vocab.json",
                                         "--merge-file", "gpt2-merges.txt"]))
