"""The ``torch.tpu`` device module (the counterpart of ``torch.cuda``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from . import _C

_DeviceLike = Union[torch.device, str, int, None]


def _index(device: _DeviceLike = None) -> int:
    if device is None:
        return _C._current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {device}")
        return _C._current_device() if device.index is None else device.index
    raise TypeError(f"Invalid device argument: {device!r}")


def is_available() -> bool:
    return _C._device_count() > 0


def is_initialized() -> bool:
    return _C._initialized()


def init() -> None:
    _C._init()


def device_count() -> int:
    return _C._device_count()


def current_device() -> int:
    return _C._current_device()


def set_device(device: _DeviceLike) -> None:
    _C._set_device(_index(device))


class device:
    """Context manager that changes the current tpu device."""

    def __init__(self, device: _DeviceLike):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self):
        self.prev = _C._current_device()
        if self.idx != self.prev:
            _C._set_device(self.idx)
        return self

    def __exit__(self, *exc):
        if self.prev != self.idx:
            _C._set_device(self.prev)
        return False


class device_of(device):
    def __init__(self, obj):
        super().__init__(obj.device.index if obj.device.type == "tpu" else -1)


def synchronize(device: _DeviceLike = None) -> None:
    _C._synchronize(_index(device))


def get_device_name(device: _DeviceLike = None) -> str:
    idx = _index(device)
    return f"{_C._platform()}:{_C._device_kind(idx)}"


class _DeviceProperties:
    def __init__(self, idx: int):
        self.name = get_device_name(idx)
        self.platform = _C._platform()
        self.platform_version = _C._platform_version()
        self.kind = _C._device_kind(idx)
        self.total_memory = _C._memory_limit(idx)
        self.index = idx

    def __repr__(self):
        return (f"_TpuDeviceProperties(name='{self.name}', total_memory={self.total_memory // (1 << 20)}MB, "
                f"platform='{self.platform}')")


def get_device_properties(device: _DeviceLike = None) -> _DeviceProperties:
    return _DeviceProperties(_index(device))


def get_device_capability(device: _DeviceLike = None):
    return (0, 0)


# --- random numbers


def default_generator(device: _DeviceLike = None) -> torch.Generator:
    return _C._default_generator(_index(device))


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _C._default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def seed_all() -> None:
    for i in range(device_count()):
        _C._default_generator(i).seed()


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device: _DeviceLike = None) -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: _DeviceLike = None) -> None:
    default_generator(device).set_state(new_state)


def get_rng_state_all():
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, s in enumerate(new_states):
        set_rng_state(s, i)


# --- memory


def memory_allocated(device: _DeviceLike = None) -> int:
    return _C._memory_allocated(_index(device))


def max_memory_allocated(device: _DeviceLike = None) -> int:
    return _C._max_memory_allocated(_index(device))


def reset_peak_memory_stats(device: _DeviceLike = None) -> None:
    _C._reset_peak_memory_stats(_index(device))


def memory_reserved(device: _DeviceLike = None) -> int:
    return memory_allocated(device)


def max_memory_reserved(device: _DeviceLike = None) -> int:
    return max_memory_allocated(device)


def memory_stats(device: _DeviceLike = None) -> dict:
    """As torch.cuda.memory_stats: the device allocator's counters, flattened
    (``allocated_bytes.all.current``, ``allocation.all.freed``, ...), and the
    memory limit (``limit_bytes``)."""
    idx = _index(device)
    limit = _C._memory_limit(idx)  # starts the runtime: its allocator has no stats before
    stats = dict(torch.accelerator.memory_stats(idx))
    stats["limit_bytes"] = limit
    return stats


def reset_accumulated_memory_stats(device: _DeviceLike = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index(device))


def mem_get_info(device: _DeviceLike = None):
    """(free, total) bytes; total is the memory limit (TORCH_TPU_MEMORY_LIMIT)."""
    return torch.accelerator.get_memory_info(_index(device))


def empty_cache() -> None:
    """Device buffers are freed when their last tensor dies; this gives the
    freed memory the CPU plugin's heap still holds back to the system."""
    torch.accelerator.empty_cache()


# --- streams and events (PyTorch's generic torch.Stream / torch.Event)


class Stream(torch.Stream):
    def __new__(cls, device: _DeviceLike = None, priority: int = 0, **kwargs):
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device("tpu", _index(device)), priority=priority)


class _EventType(type):
    # Every torch.Event on a tpu device counts as a torch.tpu.Event.
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.Event) and obj.device.type == "tpu"


class Event(torch.Event, metaclass=_EventType):
    """torch.cuda.Event's counterpart. It makes a plain torch.Event on the current tpu device: the
    methods of torch.Event that take another event (elapsed_time) accept exactly that type, not a
    subclass, so events made here and by torch.Event(device="tpu") mix freely."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return torch.Event(device=torch.device("tpu", current_device()), enable_timing=enable_timing,
                           blocking=blocking, interprocess=interprocess)


def current_stream(device: _DeviceLike = None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device("tpu", _index(device)))


def default_stream(device: _DeviceLike = None) -> torch.Stream:
    return current_stream(device)


class StreamContext:
    def __init__(self, stream: Optional[torch.Stream]):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


def stream(s: Optional[torch.Stream]) -> StreamContext:
    return StreamContext(s)


def set_stream(s: torch.Stream) -> None:
    pass


# --- autocast support


def get_amp_supported_dtype():
    return [torch.bfloat16, torch.float16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    _C._init()


def _get_device_index(device: Any, optional: bool = False) -> int:
    return _index(device)


from . import comm  # noqa: E402  (torch.tpu.comm, as torch.cuda.comm)
