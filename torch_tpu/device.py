"""The ``torch.tpu`` device module (the counterpart of ``torch.cuda``)."""

from __future__ import annotations

import datetime
import enum
import importlib
import sys
import types
from typing import Any, NamedTuple, Optional, Union

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


def _exchange_device(device: int) -> int:
    """Makes ``device`` current and returns the device that was (torch.cuda's contract: -1
    changes nothing and returns -1)."""
    if device < 0:
        return -1
    prev = _C._current_device()
    if device != prev:
        _C._set_device(device)
    return prev


def _maybe_exchange_device(device: int) -> int:
    """As _exchange_device, where the runtime has started; before, nothing changes."""
    if device < 0 or not _C._initialized():
        return -1
    return _exchange_device(device)


class device:
    """Context manager that changes the current tpu device (-1: leaves it)."""

    def __init__(self, device: _DeviceLike):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self):
        self.prev = _exchange_device(self.idx)
        return self

    def __exit__(self, *exc):
        if self.prev >= 0 and self.prev != self.idx:
            _C._set_device(self.prev)
        return False


class device_of(device):
    def __init__(self, obj):
        super().__init__(obj.device.index if obj.device.type == "tpu" else -1)


def synchronize(device: _DeviceLike = None) -> None:
    _C._synchronize(_index(device))


# PJRT's TPU device kinds, by the names Google's TorchTPU gives them (TorchTitan finds a
# TPU's peak FLOP/s by them: a name starting with "TPU").
_TPU_NAMES = {"TPU v4": "TPU v4", "TPU v5": "TPU v5p", "TPU v5p": "TPU v5p", "TPU v5 lite": "TPU v5e",
              "TPU v5e": "TPU v5e", "TPU v6 lite": "TPU v6e", "TPU v6e": "TPU v6e", "TPU7x": "TPU v7",
              "TPU v7": "TPU v7", "TPU v7x": "TPU v7"}


def get_device_name(device: _DeviceLike = None) -> str:
    """The device's name as its vendor gives it: "TPU v6e" on a TPU (Google's TorchTPU names),
    "NVIDIA H100 80GB HBM3" on the CUDA plugin, "cpu" on the CPU plugin."""
    kind = _C._device_kind(_index(device))
    if _C._platform() == "tpu":
        return _TPU_NAMES.get(kind, kind if kind.startswith("TPU") else f"TPU {kind}")
    return kind


class _DeviceProperties:
    def __init__(self, idx: int):
        self.name = get_device_name(idx)
        self.platform = _C._platform()
        self.platform_version = _C._platform_version()
        self.kind = _C._device_kind(idx)
        self.total_memory = _C._memory_limit(idx)
        self.index = idx
        # Inductor and Dynamo read it (CUDA's SM count); a device is one core to them here,
        # as in Google's TorchTPU.
        self.multi_processor_count = 1

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


def _get_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (the current device where it has no index), as
    ``torch.cuda._get_generator``: AOTAutograd's RNG functionalization asks for it."""
    return _default_generators()[_index(device)]


_generators: tuple = ()


def _default_generators() -> tuple:
    """One Python generator object per device, made once (the same objects every time, as
    torch.cuda.default_generators)."""
    global _generators
    if not _generators:
        _generators = tuple(_C._default_generator(i) for i in range(device_count()))
    return _generators




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


# --- execution modes, by Google's TorchTPU names


class EagerMode(enum.Enum):
    """How eager ops run (torch_tpu's modes, by Google's TorchTPU names)."""

    DEFER_NEVER = "strict"  # each op its own program, launched without waiting
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"  # ... and waited for: errors at their op
    DEFER_AND_FUSE = "fused"  # ops deferred into graphs that run as one program


def _eager_mode() -> EagerMode:
    import torch_tpu

    return EagerMode(torch_tpu.get_mode())


class set_eager_mode:
    """Sets the eager mode; as a context manager, restores the one before on exit."""

    def __init__(self, mode: EagerMode):
        import torch_tpu

        self._before = _eager_mode()
        torch_tpu.set_mode(EagerMode(mode).value)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        import torch_tpu

        torch_tpu.set_mode(self._before.value)
        return False


# --- the compilation cache, as Google's TorchTPU reports it


class _EntryStats(NamedTuple):
    what: str  # the op or graph the program runs
    compilation_duration: datetime.timedelta  # compile (or load from the disk cache) time
    last_read: Optional[datetime.datetime]  # the last launch; None: never launched
    read_count: int  # launches


class _CacheStats(NamedTuple):
    num_cache_reqs: int  # programs strict eager looked up by signature (fused graphs are not counted)
    num_cache_hits: int  # ... and found in memory
    peak_compilation_host_memory_bytes: Optional[int]  # not measured: None
    per_entry_stats: list  # one _EntryStats per program held


def _get_cache_stats() -> _CacheStats:
    """The program cache: lookups and hits, and each program held (its compile time, launches
    and last launch). vLLM's TorchTPU runner reads it to find recompiles."""
    import torch_tpu

    m = torch_tpu.metrics()
    entries = [
        _EntryStats(what, datetime.timedelta(seconds=secs),
                    datetime.datetime.fromtimestamp(ns / 1e9) if ns else None, int(runs))
        for what, secs, runs, ns in _C._program_stats()
    ]
    return _CacheStats(int(m["cache_hits"]) + int(m["cache_misses"]), int(m["cache_hits"]), None, entries)


def _get_cache_requests() -> int:
    return _get_cache_stats().num_cache_reqs


def _get_cache_hits() -> int:
    return _get_cache_stats().num_cache_hits


def _get_cache_misses() -> int:
    s = _get_cache_stats()
    return s.num_cache_reqs - s.num_cache_hits


class _EagerModeModule(types.ModuleType):
    """A module with an ``eager_mode`` attribute that reads and sets torch_tpu's mode
    (``torch.tpu`` and ``torch_tpu._internal.execution_mode``)."""

    @property
    def eager_mode(self) -> EagerMode:
        return _eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        set_eager_mode(mode)

    def __reduce__(self):
        # Pickled by name, as pickle cannot pickle a module subclass otherwise: cloudpickle (Ray,
        # Spark, Dask) sends a function that reads torch.tpu.* with the submodules it names, so a
        # Ray Train loop defined in a script failed to send ("cannot pickle '_TpuModule' object").
        return importlib.import_module, (self.__name__,)


class _TpuModule(_EagerModeModule):
    """``torch.tpu``'s module type: attributes computed when read (or set)."""

    @property
    def default_generators(self) -> tuple:
        """One generator per device, as ``torch.cuda.default_generators`` (it starts the runtime)."""
        return _default_generators()


sys.modules[__name__].__class__ = _TpuModule

from . import comm  # noqa: E402  (torch.tpu.comm, as torch.cuda.comm)
from . import ops  # noqa: E402,F401  (torch.tpu.ops: the sparse embedding ops TorchRec calls)
