"""SGLang's SRTPlatform for the tpu device (PyTorch's PrivateUse1).

Imported while SGLang resolves its platform, early in its own imports
(sglang.srt.utils.common): SGLang modules beyond the platform interface are
imported inside the methods that need them.
"""
from __future__ import annotations

import logging
import os

import torch

from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import SRTPlatform

import torch_tpu  # noqa: F401  (registers the device, torch.tpu and tpu_dist)

logger = logging.getLogger(__name__)

ATTENTION_BACKEND = "tpu"


class TpuSRTPlatform(SRTPlatform):
    """Out of tree (OOT): SGLang asks this platform for its attention
    backend, KV pool, token allocator and decode graph runner; its layers
    take their native (torch) paths, which run on tpu."""

    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"

    def __init__(self) -> None:
        super().__init__()
        # SGLang's eager runner copies each batch into fixed buffers first, a sliced
        # write (one small program per batch size on tpu); with this (SGLang's own
        # switch) it runs the batch's tensors as they are.
        os.environ.setdefault("SGLANG_EAGER_INPUT_NO_COPY", "1")

    # -- device -----------------------------------------------------------------

    def get_device(self, device_id: int | None = None) -> str:
        return "tpu" if device_id is None else f"tpu:{device_id}"

    def set_device(self, device) -> None:
        torch.tpu.set_device(device)

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.tpu.get_device_name(device_id)

    def get_device_uuid(self, device_id: int = 0) -> str:
        return f"tpu:{device_id}"

    def get_device_capability(self, device_id: int = 0):
        return None

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return int(torch.tpu.mem_get_info(device_id)[1])

    def get_current_memory_usage(self, device=None) -> float:
        return float(torch.tpu.memory_allocated(device))

    def get_available_memory(self, device_id: int = 0) -> tuple[int, int]:
        free, total = torch.tpu.mem_get_info(device_id)
        return int(free), int(total)

    def empty_cache(self) -> None:
        torch.tpu.empty_cache()

    def synchronize(self) -> None:
        torch.tpu.synchronize()

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def seed_everything(cls, seed: int | None = None) -> None:
        super().seed_everything(seed)
        if seed is not None:
            torch.tpu.manual_seed_all(seed)

    def get_torch_distributed_backend_str(self) -> str:
        # torch_tpu's c10d backend for tpu tensors (one process per device).
        return "tpu_dist"

    # -- SGLang's subsystems ----------------------------------------------------

    def init_backend(self) -> None:
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        from torch_tpu.sglang import adaptations
        from torch_tpu.sglang.attention import create_tpu_backend

        ATTENTION_BACKENDS.setdefault(ATTENTION_BACKEND, create_tpu_backend)
        adaptations.apply()

    def apply_server_args_defaults(self, server_args) -> None:
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

        if ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
            ATTENTION_BACKEND_CHOICES.append(ATTENTION_BACKEND)
        if server_args.attention_backend is None:
            server_args.attention_backend = ATTENTION_BACKEND
        server_args.sampling_backend = "pytorch"

    def get_default_attention_backend(self) -> str:
        return ATTENTION_BACKEND

    def get_mha_kv_pool_cls(self) -> type:
        from torch_tpu.sglang.attention import TpuMHATokenToKVPool

        return TpuMHATokenToKVPool

    def get_paged_allocator_cls(self) -> type:
        from torch_tpu.sglang.attention import TpuTokenToKVPoolAllocator

        return TpuTokenToKVPoolAllocator

    def get_graph_runner_cls(self) -> type:
        from torch_tpu.sglang.graph_runner import TpuGraphRunner

        return TpuGraphRunner

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "tpu"

    def support_cuda_graph(self) -> bool:
        return True

    def get_dispatch_key_name(self) -> str:
        return "native"
