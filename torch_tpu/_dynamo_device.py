"""torch.compile on tpu, as the rest of PyTorch reaches it.

- Dynamo's device interface for ``tpu``: PyTorch ships a placeholder (``device()`` and
  ``current_stream()`` raise, ``current_device()`` is always 0) that it registers when its
  registry first loads; torch_tpu's, built on ``torch.tpu``, takes its place.
- Inductor on tpu tensors (``torch.compile(model)`` with no backend, ``backend="inductor"``,
  the Trainer's ``torch_compile=True``): Inductor's code generation for ``tpu`` is Pallas
  through Google's package. Graphs whose inputs are tpu tensors are compiled by torch_tpu's
  own backend instead (one log line says so); graphs on other devices stay Inductor's.

Both take effect when PyTorch loads those modules (``_import_hooks``): importing Dynamo or
Inductor costs seconds that a program which never compiles should not pay.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("torch_tpu")


def _interface_class(base):
    import torch.tpu as tpu

    class TpuInterface(base):
        """Dynamo's runtime calls for the tpu device, answered by ``torch.tpu``."""

        device = tpu.device
        Event = tpu.Event
        Stream = tpu.Stream

        class Worker:
            @staticmethod
            def set_device(device: int) -> None:
                tpu.set_device(device)

            @staticmethod
            def current_device() -> int:
                return tpu.current_device()

            @staticmethod
            def get_device_properties(device=None):
                return tpu.get_device_properties(device)

        current_device = staticmethod(tpu.current_device)
        set_device = staticmethod(tpu.set_device)
        maybe_exchange_device = staticmethod(tpu._maybe_exchange_device)
        exchange_device = staticmethod(tpu._exchange_device)
        device_count = staticmethod(tpu.device_count)
        is_available = staticmethod(tpu.is_available)
        stream = staticmethod(tpu.stream)
        current_stream = staticmethod(tpu.current_stream)
        set_stream = staticmethod(tpu.set_stream)
        synchronize = staticmethod(tpu.synchronize)
        memory_allocated = staticmethod(tpu.memory_allocated)

        @staticmethod
        def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
            tpu.set_stream(torch.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type))

        @staticmethod
        def get_raw_stream(device_idx: int) -> int:
            return tpu.current_stream(device_idx).stream_id

        @staticmethod
        def get_compute_capability(device=None) -> str:
            return ""

        @staticmethod
        def is_bf16_supported(including_emulation: bool = False) -> bool:
            return True

        @classmethod
        def is_dtype_supported(cls, dtype: torch.dtype, including_emulation: bool = False) -> bool:
            return _holds(dtype)

    return TpuInterface


@functools.cache
def _holds(dtype: torch.dtype) -> bool:
    """Whether the running plugin computes this dtype (float64 on the CPU and GPU plugins, not
    on a TPU): a tpu tensor of it is made or refused."""
    try:
        torch.empty(0, dtype=dtype, device="tpu")
        return True
    except (TypeError, RuntimeError):
        return False


def _install_interface(module) -> None:
    ours = _interface_class(module.DeviceInterface)
    # init_device_reg() registers the module's TpuInterface by name when the registry first
    # loads: that name is ours from now on, and so is the entry if it already loaded.
    module.TpuInterface = ours
    if module._device_initialized:
        module.register_interface_for_device("tpu", ours)


_said = False


def _redirect_inductor(module) -> None:
    inductor = module.compile_fx
    if getattr(inductor, "_torch_tpu", False):
        return

    @functools.wraps(inductor)
    def compile_fx(model, example_inputs, *args, **kwargs):
        if not any(isinstance(t, torch.Tensor) and t.device.type == "tpu" for t in example_inputs):
            return inductor(model, example_inputs, *args, **kwargs)
        global _said
        if not _said:
            _said = True
            log.warning("torch_tpu: torch.compile with Inductor on tpu tensors compiles with torch_tpu's backend "
                        '(as backend="tpu"); Inductor\'s options do not apply')
        from ._compile import tpu_backend

        return tpu_backend(model, example_inputs)

    compile_fx._torch_tpu = True
    module.compile_fx = compile_fx


def install() -> None:
    from . import _import_hooks

    _import_hooks.when_imported("torch._dynamo.device_interface", _install_interface)
    _import_hooks.when_imported("torch._inductor.compile_fx", _redirect_inductor)
