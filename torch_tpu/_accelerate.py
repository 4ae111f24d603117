"""Lets Hugging Face Accelerate (and so the transformers ``Trainer``) pick the
tpu device.

Accelerate chooses its default device from a fixed list of backends (mps,
mlu, sdaa, musa, npu, hpu, cuda, xpu, neuron), each recognised by its own
package or ``torch`` submodule; it never asks ``torch.accelerator`` or the
PrivateUse1 backend, so on a machine whose accelerator is ``tpu`` it falls
back to the CPU. The transformers ``Trainer`` then places the model on
``args.device`` (which transformers resolves to ``tpu:0``) while
``Accelerator.prepare`` moves it back to Accelerate's device (the CPU).

The only setting Accelerate reads is ``ACCELERATE_TORCH_DEVICE``, which also
overrides ``cpu=True`` (``TrainingArguments(use_cpu=True)``), so setting it for
the user would break CPU runs. Instead, when ``accelerate.state`` is imported,
``PartialState.default_device`` is wrapped: where Accelerate's own choice is
the CPU and a tpu device is available, it returns ``tpu``. An explicit
``cpu=True``, ``ACCELERATE_TORCH_DEVICE`` and every built-in accelerator keep
their meaning. ``TORCH_TPU_ACCELERATE=0`` turns this off.

Under torchrun, Accelerate finds no distributed backend for ``tpu`` in its table and each
rank would train alone; the same hook makes it use ``tpu_dist`` (its process group, DDP) with
each process on its own tpu device (see ``_patch_distributed``).

``device_map="auto"`` asks ``accelerate.utils.get_max_memory`` which devices there are; for
an accelerator named ``tpu`` it lists only the current device (it assumes a runtime where a
process drives one chip). torch_tpu drives every device of the process, so the same hook makes
it list each tpu device with its free memory, then the CPU, and take ``max_memory`` for any of
them: big models are split over the tpu devices and spill to the CPU and disk as on CUDA.

Accelerate also checks ``torch.compile`` backend names against a fixed enum
(``DynamoBackend``), so ``TrainingArguments(torch_compile=True,
torch_compile_backend="tpu")`` would be refused; the same hook adds ``TPU`` to it.
"""

from __future__ import annotations

import sys

import torch

_TARGET = "accelerate.state"
_MODELING = "accelerate.utils.modeling"  # imported by accelerate.utils, after or before accelerate.state


def _tpu_available() -> bool:
    try:
        return torch.tpu.is_available() and torch.tpu.device_count() > 0
    except Exception:  # a broken plugin must not break Accelerate's import
        return False


def _register_dynamo_backend() -> None:
    """Adds TPU to accelerate's DynamoBackend enum (accelerate lower-cases the member's value
    into ``torch.compile(backend=...)``)."""
    dataclasses = sys.modules.get("accelerate.utils.dataclasses")
    enum_cls = getattr(dataclasses, "DynamoBackend", None)
    if enum_cls is None or "TPU" in enum_cls.__members__:
        return
    member = str.__new__(enum_cls, "TPU")
    member._name_ = "TPU"
    member._value_ = "TPU"
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_["TPU"] = member
    enum_cls._value2member_map_["TPU"] = member
    enum_cls._member_names_.append("TPU")
    type.__setattr__(enum_cls, "TPU", member)


def _patch_max_memory() -> None:
    """accelerate's get_max_memory, listing every tpu device (see the module's doc)."""
    modeling = sys.modules.get("accelerate.utils.modeling")
    original = getattr(modeling, "get_max_memory", None)
    if original is None or getattr(original, "_torch_tpu", False):
        return

    def get_max_memory(max_memory=None):
        accelerator = torch.accelerator.current_accelerator() if _tpu_available() else None
        if accelerator is None or accelerator.type != "tpu":
            return original(max_memory)
        devices = list(range(torch.tpu.device_count()))
        if max_memory is None:
            import psutil

            found = {i: torch.accelerator.get_memory_info(i)[0] for i in devices}
            found["cpu"] = psutil.virtual_memory().available
            return found
        from accelerate.utils import convert_file_size_to_int

        # Converted in the caller's dict, as accelerate does (transformers reads it back).
        for k, v in max_memory.items():
            if isinstance(v, str):
                max_memory[k] = convert_file_size_to_int(v)
        given = max_memory
        for k in given:
            if not (k in devices or k in ("cpu", "disk")):
                raise ValueError(f"Device {k!r} is not recognized: tpu devices are {devices}; also 'cpu' and 'disk'")
        order = sorted(k for k in given if isinstance(k, int)) + [k for k in ("cpu", "disk") if k in given]
        return {k: given[k] for k in order}

    get_max_memory._torch_tpu = True
    get_max_memory.__doc__ = original.__doc__
    modeling.get_max_memory = get_max_memory
    utils = sys.modules.get("accelerate.utils")
    if getattr(utils, "get_max_memory", None) is original:
        utils.get_max_memory = get_max_memory


def _patch_state_module(module) -> None:
    try:
        _register_dynamo_backend()
    except Exception:  # a changed Enum layout must not break Accelerate's import
        pass
    try:
        _patch_max_memory()
    except Exception:  # a changed accelerate must not break its import
        pass
    cls = getattr(module, "PartialState", None)
    prop = getattr(cls, "default_device", None) if cls is not None else None
    if not isinstance(prop, property) or getattr(prop.fget, "_torch_tpu", False):
        return
    original = prop.fget

    def default_device(self):
        device = original(self)
        if device.type == "cpu" and _tpu_available():
            return torch.device("tpu")
        return device

    default_device._torch_tpu = True
    default_device.__doc__ = original.__doc__
    cls.default_device = property(default_device)
    try:
        _patch_distributed(cls)
    except Exception:  # a changed accelerate must not break its import
        pass


# Accelerate's distributed type for tpu processes. Accelerate has none for tpu, and every
# multi-device path tests the type against fixed lists; MULTI_HPU's paths are device-generic
# and take the device a process was given (not tpu:LOCAL_RANK, which a process that sees one
# device does not have). The device, backend and process group are tpu's.
_DISTRIBUTED_TYPE = "MULTI_HPU"


def _patch_distributed(cls) -> None:
    """Under torchrun (LOCAL_RANK set), Accelerate looks the accelerator's distributed backend
    up in a table without tpu and stays single-process: each rank would train alone. With
    this, it initialises the process group over tpu_dist and wraps the model in DDP, through
    its own state classes."""
    from accelerate.utils import DistributedType

    from . import _env

    prepare, set_device = cls._prepare_backend, cls.set_device
    if getattr(prepare, "_torch_tpu", False):
        return
    multi = DistributedType(_DISTRIBUTED_TYPE)

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        got, kind = prepare(self, cpu, sagemaker_dp, backend)
        under_torchrun = int(_env.get("LOCAL_RANK", "-1") or -1) != -1
        on_tpu = getattr(torch.accelerator.current_accelerator(), "type", None) == "tpu"
        if kind == DistributedType.NO and under_torchrun and not cpu and on_tpu and _tpu_available():
            return backend or "tpu_dist", multi
        return got, kind

    def _set_device(self):
        if self.device is None and self.distributed_type == multi and self.backend in ("tpu_dist", "tpu"):
            self.device = torch.device("tpu", torch.tpu.current_device())
            return None
        return set_device(self)

    _prepare_backend._torch_tpu = True
    cls._prepare_backend, cls.set_device = _prepare_backend, _set_device


def _patch_prepare_model(module) -> None:
    """Accelerate wraps DDP with ``device_ids=[local_process_index]`` (CUDA's one process per
    device of the host); a tpu process may have been given one device only (TPU_VISIBLE_CHIPS,
    Ray), its tpu:0. DDP gets the device the process trains on, as Accelerate does for hpu."""
    cls = getattr(module, "Accelerator", None)
    prepare = getattr(cls, "prepare_model", None)
    if prepare is None or getattr(prepare, "_torch_tpu", False):
        return

    def prepare_model(self, model, *args, **kwargs):
        state = self.state
        device = state.device
        if device is None or device.type != "tpu" or device.index in (None, state.local_process_index):
            return prepare(self, model, *args, **kwargs)
        local = state.local_process_index
        state.local_process_index = device.index  # shared state: restored below
        try:
            return prepare(self, model, *args, **kwargs)
        finally:
            state.local_process_index = local

    prepare_model._torch_tpu = True
    prepare_model.__doc__ = prepare.__doc__
    cls.prepare_model = prepare_model


def _patched_modeling(module) -> None:
    try:
        _patch_max_memory()
    except Exception:  # a changed accelerate must not break its import
        pass


def install() -> None:
    from . import _env, _import_hooks

    if _env.get("TORCH_TPU_ACCELERATE", "1") == "0":
        return
    _import_hooks.when_imported(_MODELING, _patched_modeling)
    _import_hooks.when_imported(_TARGET, _patch_state_module)
    _import_hooks.when_imported("accelerate.accelerator", _patch_prepare_model)
