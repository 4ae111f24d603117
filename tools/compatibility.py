#!/usr/bin/env python
"""docs/compatibility.md: every call other libraries make into ``torch_tpu`` / ``torch.tpu`` /
device ``tpu`` / ``tpu_dist`` / ``TPU_*``, where it is, and whether torch_tpu answers it.

Each row names the caller's file (inside its installed package) and a line of code that
identifies the call; the tool finds the line's number in the version installed here, and runs
the row's check against torch_tpu: a Python expression that is true when the call works as the
caller expects. A caller that is not installed here (TorchRec, Helion, Google's vLLM plugin)
keeps the place it was read at, and its check still runs against torch_tpu's side.

    python tools/compatibility.py > docs/compatibility.md      # regenerate
    python tools/compatibility.py --check                      # exit 1 if a check fails

tests/python/test_compatibility.py runs every check and compares the page with this output.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import traceback
from typing import NamedTuple, Optional


class Row(NamedTuple):
    library: str  # its distribution name
    path: str  # the caller's file, relative to site-packages (or "repo@commit:path" when not installed)
    line: str  # a line of the caller's code that identifies the call
    call: str  # what it calls
    expects: str  # what the caller expects
    answer: str  # what torch_tpu does
    check: str  # a Python expression, true when it works (torch, torch_tpu, dist, importlib in scope)
    reason: Optional[str] = None  # where the check is expected to fail: why


TORCHREC = "meta-pytorch/torchrec@376cac6"
HELION = "pytorch/helion@ef091f4"
VLLM_TORCHTPU = "vllm-torchtpu@0095cdc"

ROWS = [
    # --- Ray
    Row("ray", "ray/air/_internal/device_manager/tpu.py", "torch_tpu._loader.load()",
        "`torch_tpu._loader.load()`", "registers the device and `tpu_dist` before Ray Train's process group; "
        "callable again", "`torch_tpu/_loader.py`", "_call('torch_tpu._loader.load') is None and 'tpu_dist' in "
        "dist.Backend.backend_list"),
    Row("ray", "ray/air/_internal/device_manager/tpu.py", "return [torch.device(\"tpu\")]",
        "`torch.device(\"tpu\")` per worker", "each worker bound to the chips Ray gave it (TPU_VISIBLE_CHIPS)",
        "TPU_VISIBLE_CHIPS / TPU_VISIBLE_DEVICES select the devices (libtpu applies TPU_VISIBLE_CHIPS on a TPU); "
        "the process starts on the first", "'TPU_VISIBLE_CHIPS' in _env_vars()"),
    Row("ray", "ray/train/torch/config.py", "elif backend in (\"hccl\", \"tpu_dist\"):",
        "`init_process_group(backend=\"tpu_dist\")`", "a working c10d backend", "registered at import",
        "'tpu_dist' in dist.Backend.backend_list"),
    Row("ray", "ray/train/v2/torch/torch_trainer.py", "torch_config.backend = \"tpu_dist\"",
        "`ScalingConfig(use_tpu=True)` → `tpu_dist`", "DDP over tpu_dist with one chip per worker",
        "tests/python/test_ray.py trains 2 workers, losses equal to one process", "True"),
    Row("ray", "ray/_private/accelerators/tpu.py", "def set_current_process_visible_accelerator_ids(",
        "`TPU_VISIBLE_CHIPS` per worker", "the worker uses those chips only", "applied (see above)",
        "'TPU_VISIBLE_CHIPS' in _env_vars()"),
    # --- PyTorch: Dynamo, Inductor, AOTAutograd, generic device paths
    Row("torch", "torch/_dynamo/device_interface.py", "register_interface_for_device(\"tpu\", TpuInterface)",
        "Dynamo's device interface for `tpu`", "device(), current_stream(), current_device() answer",
        "torch_tpu's interface (`torch_tpu/_dynamo_device.py`) replaces PyTorch's placeholder",
        ""
        "importlib.import_module('torch._dynamo.device_interface').get_interface_for_device('tpu').__module__ "
        "== 'torch_tpu._dynamo_device'"),
    Row("torch", "torch/_inductor/runtime/hints.py", "multi_processor_count",
        "`get_device_properties().multi_processor_count`", "an int", "1",
        "torch.tpu.get_device_properties(0).multi_processor_count == 1"),
    Row("torch", "torch/_inductor/codegen/pallas.py", "from torch_tpu._internal.pallas import tpu_torch_pallas",
        "Inductor's Pallas code for `tpu` (`torch.compile` with no backend)", "Google's `tpu_torch_pallas` runtime",
        "graphs of tpu tensors given to Inductor compile with torch_tpu's backend (one log line); its Pallas "
        "code generation is not reached", "_inductor_redirected()"),
    Row("torch", "torch/_functorch/_aot_autograd/utils.py", "Calls ``torch.<device_type>._get_generator(device)``.",
        "`torch.tpu._get_generator(device)`", "the device's default generator", "the same object each time",
        "torch.tpu._get_generator(torch.device('tpu', 0)) is torch.tpu.default_generators[0]"),
    Row("torch", "torch/_prims/rng_prims.py", "default_generators", "`torch.tpu.default_generators`",
        "a tuple, one generator per device", "built once, when first read",
        "len(torch.tpu.default_generators) == torch.tpu.device_count()"),
    Row("torch", "torch/utils/_pallas.py", "def has_torch_tpu() -> bool:", "`torch.tpu` exists",
        "the device module registered", "registered at import", "hasattr(torch, 'tpu')"),
    Row("torch", "torch/random.py", "manual_seed_all", "`torch.tpu.manual_seed_all`, `_is_in_bad_fork`",
        "seed every device", "yes", "callable(torch.tpu.manual_seed_all) and torch.tpu._is_in_bad_fork() is False"),
    Row("torch", "torch/utils/checkpoint.py", "get_rng_state", "`with torch.tpu.device(i): get_rng_state()`",
        "per-device RNG state", "yes", "isinstance(torch.tpu.get_rng_state(0), torch.Tensor)"),
    Row("torch", "torch/distributed/device_mesh.py", "set_device", "`torch.tpu.set_device(LOCAL_RANK)` ...",
        "bind the process's device", "a process that sees several devices starts on tpu:LOCAL_RANK",
        "'LOCAL_RANK' in _env_vars()"),
    Row("torch", "torch/distributed/distributed_c10d.py", "pg._set_default_backend(ProcessGroup.BackendType.GLOO)",
        "`init_process_group()` with no backend, then DDP", "as on CUDA", "tpu_dist is the group's default backend "
        "(PyTorch named gloo, which it had not built)", "_patched('torch.distributed.distributed_c10d', "
        "'_new_process_group_helper')"),
    Row("torch", "torch/amp/autocast_mode.py", "get_amp_supported_dtype", "`torch.tpu.get_amp_supported_dtype()`",
        "the dtypes autocast may cast to", "bfloat16, float16, float32",
        "torch.bfloat16 in torch.tpu.get_amp_supported_dtype()"),
    # --- transformers
    Row("transformers", "transformers/utils/import_utils.py", "def is_torch_tpu_available",
        "`is_torch_tpu_available()`", "True where tpu is the accelerator", "yes",
        "importlib.import_module('transformers.utils').is_torch_tpu_available()"),
    Row("transformers", "transformers/distributed/utils.py", "\"tpu\": \"tpu_dist\"",
        "`init_process_group(\"tpu_dist\")`", "the backend", "yes", "'tpu_dist' in dist.Backend.backend_list"),
    Row("transformers", "transformers/distributed/utils.py", "torch.accelerator.current_device_index()",
        "each process already on its own device", "the process's device", "tpu:LOCAL_RANK, or tpu:0 where the "
        "launcher gave the process its devices", "'LOCAL_RANK' in _env_vars()"),
    Row("transformers", "transformers/testing_utils.py", "BACKEND_MANUAL_SEED[\"tpu\"] = torch.tpu.manual_seed",
        "test helpers: `torch.tpu.manual_seed`, `empty_cache`, device count", "callables", "yes",
        "callable(torch.tpu.manual_seed) and callable(torch.tpu.empty_cache)"),
    Row("transformers", "transformers/testing_utils.py", "TPU_VISIBLE_DEVICES",
        "`TPU_VISIBLE_DEVICES` caps the devices", "the runtime honours it", "applied when the runtime starts",
        "'TPU_VISIBLE_DEVICES' in _env_vars()"),
    Row("transformers", "transformers/modeling_utils.py", "if self.device.type in (\"tpu\", \"neuron\"):",
        "`torch.compile(backend=\"tpu\")`", "a Dynamo backend", "yes",
        "'tpu' in importlib.import_module('torch._dynamo').list_backends(exclude_tags=())"),
    Row("transformers", "transformers/training_args.py", "torch_compile_backend",
        "`TrainingArguments(torch_compile=True)`: Inductor", "compiles on tpu",
        "Inductor on tpu tensors compiles with torch_tpu's backend", "_inductor_redirected()"),
    Row("transformers", "transformers/integrations/moe.py", "grouped_mm", "`torch._grouped_mm` on tpu",
        "grouped GEMM for MoE", "not lowered: runs through the CPU fallback",
        "'_grouped_mm' in torch_tpu.lowered_ops()", reason="a lowering is issue 6/6's work (expert parallelism)"),
    # --- accelerate
    Row("accelerate", "accelerate/state.py", "default_backend = get_distributed_backend(device_type)",
        "a distributed backend for tpu under torchrun", "multi-process training",
        "tpu_dist, DDP, each rank on its device, through Accelerate's own state classes "
        "(tests/python/test_dropin.py: the Trainer on 2 ranks equals 1)", "_accelerate_distributed()"),
    Row("accelerate", "accelerate/state.py", "def default_device", "`PartialState().default_device`", "tpu",
        "tpu (Accelerate's table has no tpu; torch_tpu's hook answers)", "_accelerate_default_device()"),
    Row("accelerate", "accelerate/utils/random.py", "get_rng_state", "`torch.get_device_module(\"tpu\").get_rng_state()`",
        "RNG state", "yes", "isinstance(torch.get_device_module('tpu').get_rng_state(), torch.Tensor)"),
    Row("accelerate", "accelerate/checkpointing.py", "states[rng_key] = device_module.get_rng_state()",
        "`torch.tpu.get_rng_state()` / `set_rng_state()`", "checkpointed RNG", "yes",
        "callable(torch.tpu.set_rng_state)"),
    Row("accelerate", "accelerate/accelerator.py", "_amp_foreach_non_finite_check_and_unscale_",
        "float16 training with a GradScaler", "the unscale kernel", "Accelerate refuses fp16 on tpu itself; "
        "bfloat16 needs no scaler", "True"),
    # --- torchtitan
    Row("torchtitan", "torchtitan/tools/utils.py", "device_module = _get_device_module(device_type)",
        "`torch.tpu` as the device module", "device_count, set_device, synchronize, memory_stats", "yes",
        "all(callable(getattr(torch.tpu, n)) for n in ('device_count', 'set_device', 'synchronize', "
        "'memory_stats', 'reset_peak_memory_stats', 'empty_cache'))"),
    Row("torchtitan", "torchtitan/tools/utils.py", "def get_peak_flops",
        "`get_device_name()` starting with \"TPU\"", "the TPU's peak FLOP/s for MFU",
        "\"TPU v6e\" etc. on a TPU (the vendor's name elsewhere: NVIDIA's on CUDA)",
        "_titan_peak('TPU v6 lite') == 918e12"),
    Row("torchtitan", "torchtitan/tools/profiler.py", "_record_memory_history", "`torch.tpu.memory._snapshot()`",
        "CUDA's memory snapshot", "missing (Google's TorchTPU has none either)", "hasattr(torch.tpu, 'memory')",
        reason="no allocator history is recorded; torch.tpu.memory_stats() has the counters"),
    # --- TorchRec (not installed: read at the commit named)
    Row("torchrec", f"{TORCHREC}:torchrec/experimental/torch_tpu/pallas/impl.py", "from torch_tpu._internal import pallas",
        "`pallas.jax_op(\"ns::op\", fn)`, called by keyword", "a PyTorch op from a JAX/Pallas function",
        "`torch_tpu._internal.pallas.jax_op` over torch_tpu.kernels", "_has('torch_tpu._internal.pallas', 'jax_op')"),
    Row("torchrec", f"{TORCHREC}:torchrec/experimental/torch_tpu/benchmarks/benchmark_single_lookup.py",
        "from torch_tpu._internal import profiler, sync", "`sync.synchronize()`, `profiler.profile(...)`",
        "flush and wait; an xprof trace", "synchronize; a PyTorch profiler trace in the folder",
        "_has('torch_tpu._internal.sync', 'synchronize') and _has('torch_tpu._internal.profiler', 'profile')"),
    Row("torchrec", f"{TORCHREC}:torchrec/distributed/utils.py", "torch.tpu.is_available()",
        "`torch.tpu.is_available()`", "True", "yes", "torch.tpu.is_available()"),
    Row("torchrec", "Google's torch_tpu 0.2.0: torch/tpu/ops", "sparse_dense_matmul", "`torch.tpu.ops.sparse_dense_matmul`",
        "SparseCore embedding lookups", "not provided: no caller in TorchRec (main or nightly) uses it",
        "hasattr(torch.tpu, 'ops')", reason="SparseCore ops need a TPU's SparseCores; no library calls them"),
    # --- Helion (not installed)
    Row("helion", f"{HELION}:helion/runtime/pallas/launcher.py", "from torch_tpu._internal.pallas import tpu_torch_pallas",
        "`tpu_torch_pallas.call_custom_kernel`, `JaxCallable`", "Google's Pallas runtime on a TPU",
        "missing: Helion falls back to its own launcher (an ImportError it catches)",
        "_has('torch_tpu._internal.pallas', 'tpu_torch_pallas')",
        reason="Google's runtime internals (serialized Mosaic kernels); Helion catches the ImportError"),
    # --- vLLM
    Row("vllm", "vllm/platforms/__init__.py", "vllm.platform_plugins",
        "out-of-tree platform plugins by entry-point name", "a name of its own",
        "`torch_tpu` (vLLM's TPU platform is `tpu`, Google's plugin `torchtpu`)", "_vllm_entry_point() == 'torch_tpu'"),
    Row("vllm-torchtpu", f"{VLLM_TORCHTPU}:src/vllm_torchtpu/runner/tpu_runner.py", "torch.tpu._get_cache_stats()",
        "`torch.tpu._get_cache_stats()`", "num_cache_reqs, num_cache_hits, per_entry_stats (compilation_duration, "
        "last_read, read_count)", "from the runtime's program cache",
        "all(hasattr(torch.tpu._get_cache_stats(), a) for a in ('num_cache_reqs', 'num_cache_hits', 'per_entry_stats'))"),
    Row("vllm-torchtpu", f"{VLLM_TORCHTPU}:src/vllm_torchtpu/platforms/tpu_platform.py", "execution_mode",
        "`execution_mode.eager_mode = EagerMode.DEFER_AND_FUSE`", "fused eager", "torch_tpu's modes by Google's names",
        "_has('torch_tpu._internal.execution_mode', 'EagerMode') and hasattr(torch.tpu, 'set_eager_mode')"),
    Row("vllm-torchtpu", f"{VLLM_TORCHTPU}:src/vllm_torchtpu/platforms/tpu_platform.py", "hardware",
        "`hardware.get_tpu_device_name()`, `get_tpu_topology()`", "the TPU's name and layout",
        "on a TPU; None without one", "_has('torch_tpu._internal.utils.hardware', 'get_tpu_topology')"),
    # --- Google's TorchTPU names with no single caller
    Row("torch-tpu", "Google's torch_tpu 0.2.0 (its public API)", "tpu", "`init_process_group(\"tpu\")`", "the c10d name `tpu`",
        "the same backend as tpu_dist", "'tpu' in dist.Backend.backend_list"),
    Row("torch-tpu", "Google's torch_tpu 0.2.0 (its public API)", "TORCH_TPU_LAUNCH_BLOCKING", "`TORCH_TPU_LAUNCH_BLOCKING=1`",
        "debug eager", "as TPU_LAUNCH_BLOCKING", "'TORCH_TPU_LAUNCH_BLOCKING' in _env_vars()"),
    Row("torch-tpu", "Google's torch_tpu 0.2.0 (its public API)", "_exchange_device", "`torch.tpu._exchange_device(i)`",
        "torch.cuda's contract (-1: nothing)", "yes", "torch.tpu._exchange_device(-1) == -1"),
]


# --- helpers the checks use


def _call(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)()


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _env_vars() -> set:
    from torch_tpu import _env

    return {v.name for v in _env.variables()}


def _patched(module: str, name: str) -> bool:
    return getattr(getattr(importlib.import_module(module), name), "_torch_tpu", False)


def _inductor_redirected() -> bool:
    import torch._inductor.compile_fx as cf

    return getattr(cf.compile_fx, "_torch_tpu", False)


def _accelerate_distributed() -> bool:
    from accelerate.state import PartialState

    return getattr(PartialState._prepare_backend, "_torch_tpu", False)


def _accelerate_default_device() -> bool:
    from accelerate.state import PartialState

    return getattr(PartialState.default_device.fget, "_torch_tpu", False)


def _titan_peak(kind: str) -> float:
    from torchtitan.tools.utils import get_peak_flops

    from torch_tpu.device import _TPU_NAMES

    return get_peak_flops(_TPU_NAMES[kind])


def _vllm_entry_point() -> Optional[str]:
    for e in importlib.metadata.entry_points(group="vllm.platform_plugins"):
        if e.value == "torch_tpu.vllm:register":
            return e.name
    return None


import importlib  # noqa: E402


def _site_packages() -> list:
    import site

    return [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]


def _version(dist_name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def locate(row: Row) -> str:
    """"file:line" in the installed package, or the place it was read at."""
    if ":" in row.path or " " in row.path or not _version(row.library):
        return row.path
    for base in _site_packages():
        full = os.path.join(base, row.path)
        if os.path.isfile(full):
            with open(full, encoding="utf-8") as f:
                for i, text in enumerate(f, 1):
                    if row.line in text:
                        return f"{row.path}:{i}"
            return f"{row.path}: (line not found: {row.line!r})"
    return f"{row.path}: (file not found)"


def run_check(row: Row) -> tuple:
    import torch
    import torch.distributed as dist

    import torch_tpu

    scope = dict(globals(), torch=torch, torch_tpu=torch_tpu, dist=dist)
    try:
        return bool(eval(row.check, scope)), ""
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}".splitlines()[0]


def results() -> list:
    return [(row, locate(row), *run_check(row)) for row in ROWS]


def markdown(rows=None) -> str:
    rows = results() if rows is None else rows
    libs = sorted({r.library for r in ROWS})
    versions = ", ".join(f"{lib} {_version(lib) or 'not installed here'}" for lib in libs if lib != "torch-tpu")
    out = [
        "# Compatibility: code written for TorchTPU, run on torch_tpu",
        "",
        "Every call other libraries make into `torch_tpu`, `torch.tpu`, the `tpu` device, `tpu_dist` and `TPU_*`",
        "variables: the caller's file and line (in the version installed here, or where it was read), what it",
        "expects, and what torch_tpu does. The status comes from running each row's check against torch_tpu.",
        "Generated by `python tools/compatibility.py > docs/compatibility.md`; `tests/python/test_compatibility.py`",
        "runs the checks and keeps this page equal to the tool's output.",
        "",
        f"Libraries: {versions}.",
        "",
        "| library | caller | call | expects | torch_tpu | status |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row, where, ok, err in rows:
        status = "works" if ok else (f"not provided: {row.reason}" if row.reason else f"**fails** ({err})")
        out.append(f"| {row.library} | `{where}` | {row.call} | {row.expects} | {row.answer} | {status} |")
    ok = sum(1 for _, _, good, _ in rows if good)
    reasoned = sum(1 for r, _, good, _ in rows if not good and r.reason)
    out += ["", f"{ok} of {len(rows)} calls work; {reasoned} are not provided, each with its reason.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if a row without a reason fails")
    args = p.parse_args(argv)
    rows = results()
    failed = [(r, e) for r, _, ok, e in rows if not ok and not r.reason]
    if args.check:
        for r, e in failed:
            print(f"FAILED {r.library} {r.call}: {e}")
        return 1 if failed else 0
    sys.stdout.write(markdown(rows))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(2)
