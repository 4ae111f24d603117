"""VeRL's device layer (``verl.plugin.platform``) for the ``tpu`` device.

``PlatformTPU`` answers VeRL's questions about the accelerator through ``torch.tpu``:
the device module, the collective backend (``tpu_dist``; VeRL puts gloo beside it for CPU
tensors), Ray's resource name (``TPU``, which Ray's own TPU accelerator manager
schedules and narrows per worker through ``TPU_VISIBLE_CHIPS``).

``PlatformHostCPU`` is the same VeRL job on PyTorch's own CPU device (gloo, no
accelerator resource): the reference the benchmark compares tpu against. VeRL picks it
only when asked (``VERL_PLATFORM=torch_cpu``); auto-detection never does.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any, Optional

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

# VeRL's name for the platform (what VERL_PLATFORM selects) and the CPU reference's.
TPU_PLATFORM = "tpu"
CPU_PLATFORM = "torch_cpu"


def _tpu_module():
    importlib.import_module("torch_tpu")  # registers the device, torch.tpu and tpu_dist
    return torch.tpu


class PlatformTPU(PlatformBase):
    """The ``tpu`` device of torch_tpu, as VeRL sees an accelerator."""

    DEVICE, VENDOR = "tpu", "torch_tpu"

    @property
    def device_name(self) -> str:
        return self.DEVICE

    @property
    def vendor_name(self) -> str:
        return self.VENDOR

    @property
    def device_module(self) -> ModuleType:
        return _tpu_module()

    def is_available(self) -> bool:
        try:
            return _tpu_module().is_available()
        except Exception:
            return False

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # A CPU-only Ray actor (the trainer's driver) still belongs to a tpu job when
        # torch_tpu imports: the same relaxation VeRL's NPU platform makes.
        try:
            _tpu_module()
        except Exception:
            return False
        return True if use_smi_check else self.is_available()

    def current_device(self) -> int:
        return _tpu_module().current_device()

    def device_count(self) -> int:
        return _tpu_module().device_count()

    def set_device(self, device_index: int) -> None:
        _tpu_module().set_device(device_index)

    def synchronize(self, device_index: Optional[int] = None) -> None:
        _tpu_module().synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        _tpu_module().manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        _tpu_module().manual_seed_all(seed)

    def set_allocator_settings(self, settings: str) -> None:
        # VeRL toggles CUDA's expandable segments around weight sync; PJRT owns tpu memory.
        return None

    def empty_cache(self) -> None:
        _tpu_module().empty_cache()

    def get_device_capability(self, device_index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        # VeRL builds "cpu:gloo,<device>:<this>" from it: tpu tensors over tpu_dist.
        return "tpu_dist"

    def visible_devices_envvar(self) -> str:
        return "TPU_VISIBLE_CHIPS"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "TPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # VeRL asks for 1/max_colocate_count of a device per worker (1/3 by default); Ray
        # accepts TPU requests of 1, 2, 4 or 8 chips only. A worker takes its bundle's
        # whole chip: one worker group per bundle, as in VeRL's hybrid engine, where the
        # actor, the rollout and the reference share one worker process.
        return {"resources": {"TPU": 1}} if num_gpus > 0 else {}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


class _HostCPUModule(ModuleType):
    """``torch.cpu`` plus the memory and RNG calls VeRL makes on its device module
    (``memory_reserved``, ``mem_get_info``, ``get_rng_state`` ...), which ``torch.cpu`` lacks."""

    def __init__(self):
        super().__init__("torch_tpu.verl.platform.host_cpu")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def _zero(*args, **kwargs) -> int:
        return 0

    memory_allocated = memory_reserved = max_memory_allocated = max_memory_reserved = _zero

    @staticmethod
    def reset_peak_memory_stats(*args, **kwargs) -> None:
        return None

    empty_cache = ipc_collect = set_per_process_memory_fraction = reset_peak_memory_stats

    @staticmethod
    def mem_get_info(*args, **kwargs):
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *args, **kwargs) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(*args, **kwargs) -> str:
        return "cpu"

    @staticmethod
    def set_device(*args, **kwargs) -> None:
        return None


_HOST_CPU = _HostCPUModule()


class PlatformHostCPU(PlatformTPU):
    """PyTorch's CPU device under VeRL: FSDP2 over gloo, workers on Ray CPU bundles.

    ``current_device`` is the string ``"cpu"``: VeRL moves tensors with
    ``.to(get_device_id())``, and with torch_tpu loaded an integer there means the
    current accelerator (``tpu:N``), not the CPU.
    """

    DEVICE, VENDOR = "cpu", "torch"

    @property
    def device_module(self) -> ModuleType:
        return _HOST_CPU

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # only by name (VERL_PLATFORM), never auto-detected

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def empty_cache(self) -> None:
        return None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # no accelerator: nothing to narrow

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}

    def ray_noset_envvars(self) -> list[str]:
        return []


def register() -> None:
    PlatformRegistry.register(platform=TPU_PLATFORM)(PlatformTPU)
    PlatformRegistry.register(platform=CPU_PLATFORM)(PlatformHostCPU)
