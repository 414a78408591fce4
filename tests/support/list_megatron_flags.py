"""Writes every flag Megatron-LM's pretrain_gpt.py accepts (tests/data/trainer/megatron_gpt_flags.txt):
one line per option string, "--flag" and what it takes: "none", "value", or "values" (one or more), sorted.

It runs Megatron's own parser builder, megatron.training.arguments.add_megatron_arguments (what
parse_args calls for pretrain_gpt.py; its extra_args_provider, NVIDIA ModelOpt's flags, is given only
when nvidia-modelopt is installed, and is left out here), on an argparse parser, and lists the option
strings of every action it adds. Four modules that arguments.py imports but that no add_*_args
function calls are replaced by empty stand-ins when they are not installed (megatron.legacy and
megatron.rl, not in every checkout; six, regex and yaml, the tokenizers' and yaml_arguments' imports):
importing them is all the parser builder needs of them.

Usage: PYTHONPATH=MEGATRON_LM_DIR:/opt/ptk-pyref /opt/ptk-torch26/bin/python \
         tests/support/list_megatron_flags.py [OUT_FILE]
with MEGATRON_LM_DIR a checkout of Megatron-LM core_v0.16.1 (its megatron/training). OUT_FILE defaults to
tests/data/trainer/megatron_gpt_flags.txt.
"""
import argparse
import importlib.abc
import importlib.machinery
import os
import sys
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
STAND_INS = ("megatron.legacy", "megatron.rl", "six", "regex", "yaml")


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: answers only for STAND_INS modules that no other finder has."""

    def find_spec(self, name, path, target=None):
        if any(name == m or name.startswith(m + ".") for m in STAND_INS):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = lambda attr: (lambda *a, **k: None)  # yaml.add_implicit_resolver(...) at import
        return mod

    def exec_module(self, module):
        pass


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "trainer",
                                                            "megatron_gpt_flags.txt")
    sys.meta_path.append(_StandIn())
    from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    rows = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if not opt.startswith("--") or opt == "--help":
                continue
            rows[opt] = "none" if action.nargs == 0 else "values" if action.nargs in ("+", "*") else "value"
    lines = [f"{flag} {kind}\n" for flag, kind in sorted(rows.items())]
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        f.write("# Megatron-LM core_v0.16.1 pretrain_gpt.py's flags (tests/support/list_megatron_flags.py)\n")
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    print(f"{out}: {len(lines)} flags")


if __name__ == "__main__":
    main()
