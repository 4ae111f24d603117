"""The TPU this process runs on, as Google's TorchTPU reports it (vLLM's TorchTPU platform
asks). Without a TPU (the CPU and CUDA plugins) there is none: ``None``, and 0 devices."""

from __future__ import annotations

from typing import Optional

import torch


def _on_tpu() -> bool:
    from torch_tpu import _C

    return torch.tpu.is_available() and _C._platform() == "tpu"


def get_tpu_device_name() -> Optional[str]:
    """"TPU v6e", ... (``torch.tpu.get_device_name()`` on a TPU); None without one."""
    return torch.tpu.get_device_name() if _on_tpu() else None


def get_tpu_version() -> Optional[str]:
    """"v6e", ...; None without a TPU."""
    name = get_tpu_device_name()
    return name.removeprefix("TPU ").strip() if name else None


def get_tpu_device_count() -> int:
    return torch.tpu.device_count() if _on_tpu() else 0


def get_tpu_topology(world_size: Optional[int] = None) -> Optional[str]:
    """The chips' arrangement as "x,y,z" for `world_size` devices (default: this host's); None
    without a TPU. torch_tpu does not read the slice's physical topology: a line of chips."""
    if not _on_tpu():
        return None
    n = world_size or get_tpu_device_count()
    return f"{n},1,1"
