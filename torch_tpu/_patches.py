"""Keeps PyTorch's module semantics on the tpu device where PyTorch's own
code assumes a built-in device.

``Module.to("tpu")`` cannot swap ``param.data`` in place (PyTorch allows that
only between its built-in dense backends), so it creates new Parameter
objects, one per module that holds the parameter: weights tied between
modules (an embedding and an LM head) would come apart. The wrapper below
restores the sharing that existed before the conversion.
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
