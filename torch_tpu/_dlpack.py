"""DLPack on the tpu device.

PyTorch names a renamed PrivateUse1 device's DLPack type only under the name
"privateuse1", so ``tensor.__dlpack_device__()`` of a tpu tensor raised
"Unknown device type tpu", and ``torch.from_dlpack`` with it. Here a tpu
tensor reports ``kDLExtDev`` and its index, as PyTorch reports any
PrivateUse1 device; ``__dlpack__`` and ``to_dlpack`` note the tensor they export, and
``torch.from_dlpack`` of a tpu tensor or capsule gives a view of the
exporter's storage (csrc/aten/device.cpp, adoptExported), in every mode.
NumPy and other consumers refuse a device they do not know with their own
``BufferError``, as for a CUDA tensor. A tpu capsule this process did not
export reads as a clear RuntimeError, never through its pointer.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.dlpack

from . import _C

_original_dlpack = torch.Tensor.__dlpack__
_original_dlpack_device = torch.Tensor.__dlpack_device__
_original_from_dlpack = torch.utils.dlpack.from_dlpack
_original_to_dlpack = torch.utils.dlpack.to_dlpack


def _is_tpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "tpu" and not torch.overrides.has_torch_function_unary(t)


@functools.wraps(_original_dlpack_device)
def _dlpack_device(self):
    if _is_tpu(self):
        from torch.utils.dlpack import DLDeviceType

        return DLDeviceType.kDLExtDev, self.device.index if self.device.index is not None else 0
    return _original_dlpack_device(self)


@functools.wraps(_original_dlpack)
def _dlpack(self, *args, **kwargs):
    capsule = _original_dlpack(self, *args, **kwargs)  # PyTorch's own checks and errors first
    if _is_tpu(self):
        _C._dlpack_note(self)
    return capsule


def _to_dlpack(tensor):
    capsule = _original_to_dlpack(tensor)
    if _is_tpu(tensor):
        _C._dlpack_note(tensor)
    return capsule


@functools.wraps(_original_from_dlpack)
def _from_dlpack(ext_tensor, *args, **kwargs):
    if _is_tpu(ext_tensor):
        device = kwargs.get("device", args[0] if args else None)
        if device is not None and torch.device(device) != ext_tensor.device:
            # PyTorch's cross-device path reads the capsule's tensor before it is adopted.
            if kwargs.get("copy", args[1] if len(args) > 1 else None) is False:
                raise ValueError(f"cannot move DLPack tensor from device {ext_tensor.device} to {device} without "
                                 "copying. Set copy=None or copy=True.")
            return _C._dlpack_adopt(_original_from_dlpack(ext_tensor)).to(device)
    return _C._dlpack_adopt(_original_from_dlpack(ext_tensor, *args, **kwargs))


def install() -> None:
    torch.Tensor.__dlpack_device__ = _dlpack_device
    torch.Tensor.__dlpack__ = _dlpack
    torch.utils.dlpack.to_dlpack = _to_dlpack
    torch.utils.dlpack.from_dlpack = _from_dlpack
    torch.from_dlpack = _from_dlpack
