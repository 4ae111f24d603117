"""torch_tpu: a native PyTorch device backend ("tpu") on PJRT plugins.

``import torch_tpu`` (or PyTorch's backend autoload) registers the ``tpu``
device; tensors moved there run as StableHLO programs compiled by the XLA
compiler inside a PJRT plugin (TPU, CUDA GPU, or the host CPU).
"""

from __future__ import annotations


def _autoload():
    """Entry point for PyTorch's backend autoload: importing this package is
    enough. Defined before `import torch`, because `import torch_tpu` as the
    first import makes torch's autoload call it while this module is still
    initialising."""


import contextlib
import os
import site
import sys

import torch

__all__ = [
    "metrics",
    "metrics_report",
    "reset_metrics",
    "set_mode",
    "get_mode",
    "mode",
    "sync",
    "lowered_ops",
    "set_fallback",
]


def _search_dirs():
    dirs = []
    for d in list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path:
        if d and os.path.isdir(d) and d not in dirs:
            dirs.append(d)
    return dirs


torch.utils.rename_privateuse1_backend("tpu")

from . import _C  # noqa: E402  (registers the device's C++ kernels)

_C._set_search_dirs(_search_dirs())
_C._register_lowered_kernels()


def _load_refusal_tables():
    """What PyTorch's kernels refuse, so that tpu raises the same: dtypes an op's CPU and
    CUDA kernels have no code for (tools/dtype_rejections.py), and writes through
    overlapping memory (tools/overlap_checks.py)."""
    import json
    import warnings

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "_dtype_rejections.json")
    try:
        with open(path) as f:
            rows = json.load(f)["rejections"]
        _C._set_dtype_refusals([("base" in r, r.get("base") or r["op"], r["dtypes"], r["type"], r["message"])
                                for r in rows])
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"torch_tpu: {path} could not be read ({e}); ops will not refuse the dtypes "
                      "PyTorch's kernels refuse")
    path = os.path.join(here, "_overlap_checks.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        _C._set_overlap_checks(list(doc["internal"]), list(doc["partial"]), list(doc.get("any", [])),
                               list(doc.get("source", [])))
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"torch_tpu: {path} could not be read ({e}); in-place ops will not refuse "
                      "overlapping writes")


_load_refusal_tables()

from . import device as _device_module  # noqa: E402

torch._register_device_module("tpu", _device_module)
torch.utils.generate_methods_for_privateuse1_backend(
    for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
)

from . import _patches  # noqa: E402

_patches.install()

from . import _dlpack  # noqa: E402

_dlpack.install()  # tpu tensors report their DLPack device (kDLExtDev)

from . import _accelerate  # noqa: E402

_accelerate.install()  # Accelerate (and the transformers Trainer) picks the tpu device

from . import _shutdown  # noqa: E402

_shutdown.install()  # a backward's last release must not race interpreter exit

from . import distributed  # noqa: E402

distributed.register()  # dist.init_process_group() gives tpu tensors to tpu_dist

from . import _flash_attention  # noqa: E402

_flash_attention.register()  # varlen_attn (TorchTitan's attention) on tpu

if "torch._dynamo" in sys.modules:  # else Dynamo finds it through the entry point
    from . import _compile as _compile_backend

    _compile_backend._register()

from . import _dynamo_device  # noqa: E402

_dynamo_device.install()  # Dynamo's tpu device interface; Inductor on tpu tensors compiles with ours

from . import _torchrec  # noqa: E402

_torchrec.install()  # FBGEMM's and TorchRec's operators on tpu, once those libraries load

from . import _env  # noqa: E402

if _env.get("TORCH_TPU_METRICS_FILE"):
    import atexit

    atexit.register(lambda: _write_metrics(_env.get("TORCH_TPU_METRICS_FILE")))

if "1" in (_env.get("TPU_LAUNCH_BLOCKING", ""), _env.get("TORCH_TPU_LAUNCH_BLOCKING", "")):  # ours, Google's
    _C._set_launch_blocking(True)

_MODES = ("strict", "debug", "fused")


def set_mode(name: str) -> None:
    """Selects the execution mode: "strict" (asynchronous per-op programs, the
    default), "debug" (synchronous; an error names the op that caused it) or
    "fused" (ops are deferred into one graph, compiled once and reused, and
    run when the host needs data). Leaving "fused" runs the pending graph."""
    if name not in _MODES:
        raise ValueError(f"torch_tpu: unknown mode {name!r}; choose one of {_MODES}")
    _C._set_fused(name == "fused")
    _C._set_launch_blocking(name == "debug")


def get_mode() -> str:
    if _C._fused():
        return "fused"
    return "debug" if _C._launch_blocking() else "strict"


@contextlib.contextmanager
def mode(name: str):
    """Context manager: run the block in the given execution mode."""
    old = get_mode()
    set_mode(name)
    try:
        yield
    finally:
        set_mode(old)


def set_fallback(policy: str) -> None:
    """"warn" (run ops without a lowering on the CPU, warning once per op) or
    "error" (raise instead). TORCH_TPU_FALLBACK=error sets "error"."""
    if policy not in ("warn", "error"):
        raise ValueError("torch_tpu: fallback policy must be 'warn' or 'error'")
    _C._set_fallback_error(policy == "error")


@contextlib.contextmanager
def lowerings_disabled(*names: str):
    """Runs the named ATen ops (base names, e.g. "linalg_det") through the CPU fallback
    inside the block: to check whether a lowering is behind a wrong result, or to test
    the fallback path. TORCH_TPU_DISABLE_LOWERINGS=a,b does the same for a whole run."""
    old = _C._disabled_lowerings()
    _C._set_disabled_lowerings(sorted(set(old) | set(names)))
    try:
        yield
    finally:
        _C._set_disabled_lowerings(old)


def sync(device=None) -> None:
    """Waits until every program launched on the device has finished."""
    _device_module.synchronize(device)


class Metrics(dict):
    """Counters: compiles, cache hits/misses, executions, host<->device bytes,
    compile seconds, CPU fallbacks by op."""

    def report(self) -> str:
        return _C._metrics_report()


def metrics() -> Metrics:
    m = Metrics(_C._metrics())
    kernels = sys.modules.get(__name__ + ".kernels")
    m["kernels"] = kernels.counts() if kernels else {}  # calls per custom kernel and implementation
    return m


def _write_metrics(path: str) -> None:
    import json

    if not _C._initialized():  # never used the device (torchrun's launcher imports torch, and so torch_tpu)
        return
    with open(path.replace("{rank}", _env.get("RANK", "0")), "w") as f:
        json.dump(metrics(), f, indent=1, sort_keys=True)


def metrics_report() -> str:
    return _C._metrics_report()


def reset_metrics() -> None:
    _C._reset_metrics()
    kernels = sys.modules.get(__name__ + ".kernels")
    if kernels:
        kernels._counts.clear()


def compiled_graphs():
    """Graphs compiled by torch.compile(backend="tpu"): name, FX op count, calls, XLA
    programs compiled and compile seconds on the first call."""
    from . import _compile

    return _compile.compiled_graphs()


def lowered_ops():
    """Names of the ATen ops with a native lowering."""
    return list(_C._lowered_ops())


