"""Lets transformers 4.51.3 (the first release with Qwen3ForCausalLM) run on Debian bookworm's python3-torch 1.13.

transformers 4.51 is written for torch >= 2.1; PyPI's x86-64 torch 2 wheels are CUDA builds (hundreds of MB, and
they load NVIDIA's CUDA library wheels at import), too large for CI. What it needs of torch 2 on one CPU process is little, and install()
adds exactly that, nothing of the model's arithmetic:
  * modules and names that are only imported (torch.distributed.tensor for tensor parallelism, the float8 and
    uint16/32/64 dtypes in safetensors' dtype table, torch.compiler.disable as a decorator): placeholders;
  * Module.named_parameters(remove_duplicate=False) (torch 2.0), which transformers uses to find tied
    weights: every (name, parameter) pair, shared ones under each of their names;
  * Module.load_state_dict(assign=True) (torch 2.1), with which from_pretrained puts each loaded tensor in
    place of its meta-device parameter: the tensor becomes the parameter.
Each is added only when torch lacks it, so on torch 2 install() changes nothing.
"""
import importlib
import inspect
import sys
import types

import torch


def _named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
    seen = set()
    modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, self)]
    for module_prefix, module in modules:
        for name, p in module._parameters.items():
            if p is None or (remove_duplicate and p in seen):
                continue
            if remove_duplicate:
                seen.add(p)
            yield (module_prefix + ("." if module_prefix else "") + name, p)


def _assigning_load_state_dict(original):
    def load_state_dict(self, state_dict, strict=True, assign=False):
        if not assign:
            return original(self, state_dict, strict)
        # transformers assigns one direct parameter or buffer at a time (strict=False).
        unexpected = []
        for name, tensor in state_dict.items():
            if name in self._parameters:
                old = self._parameters[name]
                grad = old.requires_grad if old is not None else tensor.requires_grad
                self._parameters[name] = torch.nn.Parameter(tensor, requires_grad=grad)
            elif name in self._buffers:
                self._buffers[name] = tensor
            else:
                unexpected.append(name)
        if strict and unexpected:
            raise RuntimeError("load_state_dict(assign=True): {} has no parameter or buffer {}".format(
                type(self).__name__, unexpected))
        return torch.nn.modules.module._IncompatibleKeys([], unexpected)

    return load_state_dict


def install():
    try:
        importlib.import_module("torch.distributed.tensor")
    except ModuleNotFoundError:
        placeholder = types.ModuleType("torch.distributed.tensor")
        sys.modules["torch.distributed.tensor"] = placeholder
        torch.distributed.tensor = placeholder
    if not hasattr(torch, "compiler"):
        compiler = types.ModuleType("torch.compiler")
        compiler.disable = lambda fn=None, recursive=True: fn if fn is not None else (lambda f: f)
        compiler.is_compiling = lambda: False
        sys.modules["torch.compiler"] = compiler
        torch.compiler = compiler
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        if not hasattr(torch, name):
            setattr(torch, name, object())  # a dtype no tensor here has
    module = torch.nn.Module
    if "remove_duplicate" not in inspect.signature(module.named_parameters).parameters:
        module.named_parameters = _named_parameters
    if "assign" not in inspect.signature(module.load_state_dict).parameters:
        module.load_state_dict = _assigning_load_state_dict(module.load_state_dict)
