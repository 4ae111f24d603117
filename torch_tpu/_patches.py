"""Keeps PyTorch's module semantics on the tpu device where PyTorch's own
code assumes a built-in device.

``Module.to("tpu")`` swaps ``param.data`` in place, as for cuda, since tpu
counts as a dense backend for ``_has_compatible_shallow_copy_type``
(csrc/aten/tensors.cpp). Where a conversion still makes new Parameter
objects, one per module that holds the parameter
(``torch.__future__.set_overwrite_module_params_on_conversion(True)``, or a
swap PyTorch refuses), weights tied between modules (an embedding and an LM
head) would come apart: the wrapper below restores the sharing that existed
before the conversion.
"""

from __future__ import annotations

import threading

import torch

_state = threading.local()
_original_apply = torch.nn.Module._apply


def _shared_slots(module: torch.nn.Module):
    seen: dict[int, list] = {}
    for mod in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None:
                    seen.setdefault(id(t), []).append((mod, kind, name))
    return [slots for slots in seen.values() if len(slots) > 1]


def _apply(self, fn, recurse=True):
    if getattr(_state, "depth", 0) > 0:  # inner call of the same conversion
        return _original_apply(self, fn, recurse)
    shared = _shared_slots(self)
    _state.depth = 1
    try:
        result = _original_apply(self, fn, recurse)
    finally:
        _state.depth = 0
    for slots in shared:
        mod0, kind0, name0 = slots[0]
        t = getattr(mod0, kind0)[name0]
        for mod, kind, name in slots[1:]:
            getattr(mod, kind)[name] = t
    return result


def install() -> None:
    torch.nn.Module._apply = _apply
