#!/usr/bin/env python
"""OpInfo sweep: tpu op coverage against the CPU over PyTorch's own OpInfo database.

For every OpInfo variant (``op.name`` + ``op.variant_test_name``) and each of float32,
bfloat16, int64 and bool that the OpInfo supports on the CPU, the op runs on its sample
inputs (at most ``--max-samples`` of them) on the CPU and on tpu, and the results are
compared with ``torch.testing.assert_close`` at PyTorch's default tolerances for the dtype.
Each (variant, dtype) unit ends in one status:

    native_pass    every sample matches and no op fell back to the CPU
    fallback_pass  every sample matches, but torch_tpu.metrics()["fallbacks"] grew
    mismatch       a result differs (or tpu returned a value where the CPU raised)
    error          tpu raised a Python exception where the CPU succeeded
    crash          the worker process died or hung (per-sample timeout)
    skip           the CPU itself fails on every sample (``tpu_raised`` tells whether tpu
                   raised as well, as PyTorch's semantics require)

Float32 variants that support autograd also get a grad unit (gradients of the sum of all
float outputs, complex ones through view_as_real, w.r.t. every input that requires grad):
grad_native_pass, grad_fallback_pass, grad_mismatch, grad_error, grad_crash, grad_skip
(the CPU backward fails on every sample).

Walks (one kind of unit each, forward only): ``--special`` plants NaN and infinities in float32
inputs; ``--empty`` makes the inputs empty along their first dimension; ``--global-state`` runs
each float32, int64 and bool sample once on tpu under the default state (so that its programs are
cached), then on the CPU and on tpu again under other global state (``torch.set_default_dtype
(torch.float64)`` and deterministic algorithms): a program cached under the first state must not
serve the second.

Units run in worker subprocesses (``--workers``, default 1), one unit at a time, so that a
segfault or a hang loses that unit only; the worker is then restarted. The worker imports a
snapshot of the torch_tpu package (copied when the sweep starts), so that a rebuild of the
extension during a long sweep does not mix two builds. The tpu side runs with
``torch_tpu.set_fallback("warn")``; units that pass only through the CPU fallback are run
once more with ``set_fallback("error")`` and the first exception is recorded (``strict``).

    python tools/opinfo_sweep.py --shard 0/2 --out /tmp/sweep0.json
    python tools/opinfo_sweep.py --ops add,nn.functional.gelu --dtypes float32 --out r.json
    python tools/opinfo_sweep.py --ops-file tools/opinfo_sample.txt \\
        --write-baseline tests/python/opinfo_baseline.json
    python tools/op_coverage_report.py /tmp/sweep0.json /tmp/sweep1.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opinfo_tolerances  # noqa: E402
from worker_pool import _git, machine_info, read_list, run_units  # noqa: E402

DTYPE_NAMES = ("float32", "bfloat16", "int64", "bool")
# More that --dtypes takes (not swept by default): the wider and unsigned types.
MORE_DTYPE_NAMES = ("float64", "float16", "complex64", "complex128", "int32", "int16", "int8", "uint8", "uint16")
FWD_STATUSES = ("native_pass", "fallback_pass", "mismatch", "error", "crash", "skip")
GRAD_STATUSES = ("grad_native_pass", "grad_fallback_pass", "grad_mismatch", "grad_error",
                 "grad_crash", "grad_skip")

# Variants whose values are random or uninitialised: only shapes and dtypes are compared.
NONDETERMINISTIC = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "normal.in_place", "normal.number_mean", "uniform", "rand_like", "randint", "randint_like",
    "randn", "randn_like", "empty", "empty_like", "empty_permuted", "empty_strided",
    "new_empty", "new_empty_strided", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
}

MSG_LIMIT = 400


def _random_sample(variant, sample) -> bool:
    """Samples of otherwise deterministic ops that use dropout: values are random, so
    only shapes and dtypes are compared."""
    if variant == "nn.functional.scaled_dot_product_attention":
        return bool(sample.kwargs.get("dropout_p", 0.0))
    if variant == "nn.functional.multi_head_attention_forward":
        p = sample.args[9] if len(sample.args) > 9 else sample.kwargs.get("dropout_p", 0.0)
        return bool(p) and sample.kwargs.get("training", True)
    return False


def variant_name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def unit_key(variant: str, dtype: str, kind: str) -> str:
    if kind == "state":
        return f"{variant}|state:{dtype}"
    return f"{variant}|{kind if kind in ('grad', 'special', 'empty') else dtype}"


# --------------------------------------------------------------------------------------
# Worker side: runs one unit in this process.
# --------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else ""
    return f"{type(exc).__name__}: {line}"[:MSG_LIMIT]


def _short(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return "; ".join(lines)[:MSG_LIMIT]


class Mismatch(Exception):
    pass


def _map(obj, fn):
    """Applies fn to every tensor in obj, recursively through lists, tuples and dicts."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple (torch.return_types)
        return type(obj)(*[_map(o, fn) for o in obj])
    if isinstance(obj, tuple):
        mapped = [_map(o, fn) for o in obj]
        try:
            return type(obj)(mapped)
        except TypeError:
            return tuple(mapped)
    if isinstance(obj, list):
        return [_map(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj, acc=None):
    import torch

    acc = [] if acc is None else acc
    if isinstance(obj, torch.Tensor):
        acc.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, acc)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, acc)
    return acc


def _move_tensor(t):
    """A tpu copy of t. A view into a larger storage (an offset, strides that skip
    elements, a broadcast) keeps its storage, offset and strides: as_strided samples
    reach outside the view's own elements, and strided inputs are worth testing."""
    import torch

    t = t.detach()
    if (t.layout != torch.strided or t.device.type != "cpu" or t.is_conj() or t.is_neg()
            or t.element_size() == 0):
        return t.to("tpu")
    storage_numel = t.untyped_storage().nbytes() // t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and storage_numel == t.numel():
        return t.to("tpu")
    base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (storage_numel,), (1,))
    return base.to("tpu").as_strided(t.size(), t.stride(), t.storage_offset())


def _to_device(obj, memo, grad=False, keep=()):
    """Moves every tensor to tpu (tensors shared within a sample stay shared; tensors
    whose flat position is in keep stay on the CPU, as in PyTorch's device tests) and
    turns device arguments that say "cpu" into "tpu"."""
    import torch

    if isinstance(obj, torch.Tensor):
        pos = memo["position"] = memo.get("position", -1) + 1
        if pos in keep:
            return obj
        key = id(obj)
        if key not in memo:
            if grad and obj.requires_grad:
                memo[key] = _move_tensor(obj).requires_grad_(True)
            else:
                memo[key] = _move_tensor(obj)
        return memo[key]
    if isinstance(obj, torch.device) and obj.type == "cpu":
        memo["device_arg"] = True
        return torch.device("tpu")
    if isinstance(obj, str) and obj == "cpu":
        memo["device_arg"] = True
        return "tpu"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[_to_device(o, memo, grad, keep) for o in obj])
    if isinstance(obj, tuple):
        return tuple(_to_device(o, memo, grad, keep) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, memo, grad, keep) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, memo, grad, keep) for k, v in obj.items()}
    return obj


def _cpu_positions(op, dtype, requires_grad, samples):
    """For each sample, the flat positions of the tensors that the OpInfo keeps on the
    CPU when it makes samples for another device (e.g. tensor_split's indices): found by
    making the samples on the meta device. None where that does not line up."""
    import itertools

    try:
        _seed(0)
        metas = list(itertools.islice(
            op.sample_inputs("meta", dtype, requires_grad=requires_grad), len(samples)))
    except Exception:  # noqa: BLE001
        return [()] * len(samples)
    if len(metas) != len(samples):
        return [()] * len(samples)
    out = []
    for m, s in zip(metas, samples):
        tm = _tensors((m.input, m.args, m.kwargs))
        ts = _tensors((s.input, s.args, s.kwargs))
        if len(tm) != len(ts):
            out.append(())
        else:
            out.append({i for i, t in enumerate(tm) if t.device.type == "cpu"})
    return out


def _fetch(obj, devices):
    """Copies a tpu result to the CPU (this is where deferred device errors surface),
    recording the device types of the result tensors."""
    import torch

    def one(t):
        devices.add(t.device.type)
        if t.layout != torch.strided:
            return t.to("cpu")
        return t.detach().cpu()

    return _map(obj, one)


def _compare(ref, out, meta_only, path="out", tol=None):
    import math

    import torch

    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            raise Mismatch(f"{path}: expected a Tensor, got {type(out).__name__}")
        if meta_only:
            if out.shape != ref.shape or out.dtype != ref.dtype:
                raise Mismatch(f"{path}: expected {tuple(ref.shape)} {ref.dtype}, "
                               f"got {tuple(out.shape)} {out.dtype}")
            return
        kw = {"atol": tol["atol"], "rtol": tol["rtol"]} if tol and ref.is_floating_point() else {}
        try:
            torch.testing.assert_close(out, ref, equal_nan=True, **kw)
        except AssertionError as e:
            raise Mismatch(f"{path}: {_short(e)}") from None
        return
    if isinstance(ref, (list, tuple)):
        if not isinstance(out, (list, tuple)) or len(out) != len(ref):
            raise Mismatch(f"{path}: expected {type(ref).__name__} of {len(ref)}, got "
                           f"{type(out).__name__}"
                           + (f" of {len(out)}" if isinstance(out, (list, tuple)) else ""))
        for i, (r, o) in enumerate(zip(ref, out)):
            _compare(r, o, meta_only, f"{path}[{i}]", tol)
        return
    if isinstance(ref, dict):
        if not isinstance(out, dict) or set(out) != set(ref):
            raise Mismatch(f"{path}: dict keys differ")
        for k in ref:
            _compare(ref[k], out[k], meta_only, f"{path}[{k!r}]", tol)
        return
    if isinstance(ref, float) and isinstance(out, float) and math.isnan(ref) and math.isnan(out):
        return
    if meta_only:
        return
    try:
        same = bool(ref == out)
    except Exception as e:  # noqa: BLE001
        raise Mismatch(f"{path}: cannot compare {type(ref).__name__}: {_first_line(e)}") from None
    if not same:
        raise Mismatch(f"{path}: expected {ref!r:.80}, got {out!r:.80}")


def _loose_close(ref, out, dtype_name):
    """Whether a mismatching result is close at a loose tolerance (a precision issue
    rather than a wrong result)."""
    import torch

    tol = {"float32": 1e-3, "bfloat16": 5e-2}.get(dtype_name)
    if tol is None:
        return False
    try:
        rs, os_ = _tensors(ref), _tensors(out)
        if len(rs) != len(os_):
            return False
        for r, o in zip(rs, os_):
            if r.dtype != o.dtype or r.shape != o.shape:
                return False
            if r.is_floating_point() and o.is_floating_point():
                torch.testing.assert_close(o, r, rtol=tol, atol=tol, equal_nan=True)
            else:
                torch.testing.assert_close(o, r, equal_nan=True)
        return True
    except Exception:  # noqa: BLE001
        return False


def _note_override(result, variant, unit):
    tol = opinfo_tolerances.lookup(variant, unit)
    if tol:
        result["tolerance_override"] = f"atol={tol['atol']}, rtol={tol['rtol']}: {tol['reason']}"


def _fallbacks():
    import torch_tpu

    return {k: int(v) for k, v in torch_tpu.metrics().get("fallbacks", {}).items() if v}


def _seed(seed=0):
    import random

    import torch

    random.seed(seed)
    torch.default_generator.manual_seed(seed)  # torch.manual_seed also formats a stack (slow)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def _samples(op, dtype, requires_grad, max_samples, special=False):
    """The OpInfo's first samples; `special`: "special" plants NaN and infinities, "empty" makes
    the input (and the arguments shaped like it) empty along their first dimension."""
    import itertools

    _seed(0)
    samples = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=requires_grad),
                                    max_samples))
    if special == "empty":
        return [s for s in (_emptied(s) for s in samples) if s is not None]
    if special == "special":
        for sample in samples:
            for t in _tensors((sample.input, sample.args, sample.kwargs)):
                _plant_special_values(t)
    return samples


def _emptied(sample):
    """The sample with its input, and every argument of the input's shape, narrowed to 0 along
    dim 0 (the zero-size walk); None where the input has no dimension to narrow."""
    import torch

    x = sample.input
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.size(0) == 0:
        return None
    shape = x.shape

    def narrow(v):
        if isinstance(v, torch.Tensor) and v.shape == shape:
            return v.narrow(0, 0, 0)
        if isinstance(v, (list, tuple)):
            return type(v)(narrow(e) for e in v)
        return v

    sample.input = narrow(x)
    sample.args = narrow(sample.args)
    sample.kwargs = {k: narrow(v) for k, v in sample.kwargs.items()}
    return sample


SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"))


def _plant_special_values(t) -> None:
    """NaN, +inf and -inf at every 7th element of a floating tensor, in place (the NaN/inf walk:
    ``--special``): clamps, min/max, compares, selects and reductions must treat them as the CPU
    does."""
    import torch

    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0 or t.requires_grad:
        return
    flat = t.view(-1) if t.is_contiguous() else None
    if flat is None:
        return
    with torch.no_grad():
        for k, i in enumerate(range(0, flat.numel(), 7)):
            flat[i] = SPECIAL_VALUES[k % 3]


def _aggregate(outcomes, status_prefix, fallbacks):
    """outcomes: list of (kind, message); kind in pass, mismatch, error, cpu_fail_raised,
    cpu_fail_returned (a mismatch), cpu_fail (grad: sample skipped)."""
    counts = {}
    for kind, _ in outcomes:
        counts[kind] = counts.get(kind, 0) + 1
    msg = ""

    def first(*kinds):
        for kind, m in outcomes:
            if kind in kinds:
                return m
        return ""

    if counts.get("error"):
        status, msg = "error", first("error")
    elif counts.get("mismatch") or counts.get("cpu_fail_returned"):
        status, msg = "mismatch", first("mismatch", "cpu_fail_returned")
    elif not counts.get("pass"):
        status, msg = "skip", first("cpu_fail_raised", "cpu_fail_returned", "cpu_fail")
    else:
        status = "fallback_pass" if fallbacks else "native_pass"
        if fallbacks:
            msg = "fallback: " + ", ".join(sorted(fallbacks))
    return status_prefix + status, msg, counts


TIE_OPS = ("sort", "argsort", "topk", "mode", "kthvalue")


def _tie_equivalent(variant, sample, ref, out):
    """sort/argsort (stable=False) and topk may order the indices of equal values
    differently, and mode/kthvalue may return any index of the selected value (PyTorch
    leaves it unspecified; the CPU's depends on its unstable sort): the result is right if
    the values match and the tpu indices pick the same values from the input as the CPU's."""
    import torch

    name = variant.split(".")[0]
    args, kwargs, inp = sample.args, sample.kwargs, sample.input
    try:
        if name in ("sort", "argsort"):
            if kwargs.get("stable", False):
                return False
            dim = kwargs.get("dim", args[0] if args else -1)
        elif name == "topk":
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
        elif name in ("mode", "kthvalue"):
            at = 0 if name == "mode" else 1
            dim = kwargs.get("dim", args[at] if len(args) > at else -1)
            keep = kwargs.get("keepdim", args[at + 1] if len(args) > at + 1 else False)
            if not isinstance(inp, torch.Tensor) or inp.dim() == 0:
                return False
            torch.testing.assert_close(out[0], ref[0], equal_nan=True)
            ri, oi = (ref[1], out[1]) if keep else (ref[1].unsqueeze(dim), out[1].unsqueeze(dim))
            torch.testing.assert_close(inp.gather(dim, oi), inp.gather(dim, ri), equal_nan=True)
            return True
        else:
            return False
        if not isinstance(inp, torch.Tensor) or inp.dim() == 0:
            return False
        if name == "argsort":
            ri, oi = ref, out
        else:
            torch.testing.assert_close(out[0], ref[0], equal_nan=True)
            ri, oi = ref[1], out[1]
        torch.testing.assert_close(inp.gather(dim, oi), inp.gather(dim, ri), equal_nan=True)
        return True
    except Exception:  # noqa: BLE001
        return False


@contextlib.contextmanager
def _other_global_state(active):
    """The global-state walk's other state: float64 as the default dtype, deterministic
    algorithms (warn_only: the walk compares values, not CUDA's refusals)."""
    import torch

    if not active:
        yield
        return
    dtype, det, warn = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                        torch.is_deterministic_algorithms_warn_only_enabled())
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(det, warn_only=warn)


def run_forward(op, dtype_name, max_samples, meta_only, strict_check, send_progress, special=False):
    import torch
    import torch_tpu

    dtype = getattr(torch, dtype_name)
    variant = variant_name(op)
    samples = _samples(op, dtype, False, max_samples, special)
    if not samples:
        return {"status": "skip", "message": "no sample inputs", "samples": {}}
    keeps = _cpu_positions(op, dtype, False, samples)
    torch_tpu.set_fallback("warn")
    torch_tpu.reset_metrics()
    outcomes, loose, notes = [], [], set()
    tpu_raised_all = True
    for i, sample in enumerate(samples):
        _seed(i)
        memo = {}
        try:
            dev_sample = _to_device((sample.input, sample.args, sample.kwargs), memo,
                                    keep=keeps[i])
        except Exception as e:  # noqa: BLE001
            outcomes.append(("error", f"moving the inputs to tpu: {_first_line(e)}"))
            send_progress(i)
            continue
        if special == "state":  # the programs of the default state, cached first
            try:
                _seed(i)
                _fetch(op(dev_sample[0], *dev_sample[1], **dev_sample[2]), set())
            except Exception:  # noqa: BLE001  (compared below, under the other state)
                pass
        cpu_exc = None
        with _other_global_state(special == "state"):
            try:
                _seed(i)
                ref = op(sample.input, *sample.args, **sample.kwargs)
                ref = sample.output_process_fn_grad(ref)
            except Exception as e:  # noqa: BLE001
                cpu_exc = e
            devices = set()
            try:
                _seed(i)
                x, args, kwargs = dev_sample
                out = op(x, *args, **kwargs)
                out = sample.output_process_fn_grad(out)
                out = _fetch(out, devices)
                torch_tpu.sync()
                tpu_exc = None
            except Exception as e:  # noqa: BLE001
                tpu_exc = e
        moved = len(_tensors(dev_sample)) > len(keeps[i]) or "device_arg" in memo
        if cpu_exc is not None:
            if tpu_exc is None:
                tpu_raised_all = False
                outcomes.append(("cpu_fail_returned",
                                 f"CPU raised {_first_line(cpu_exc)} but tpu returned a value"))
            else:
                outcomes.append(("cpu_fail_raised", f"CPU raised {_first_line(cpu_exc)}"))
        elif tpu_exc is not None:
            outcomes.append(("error", _first_line(tpu_exc)))
        elif "cpu" in devices and moved:
            outcomes.append(("mismatch", "result tensor is on the cpu, not on tpu"))
        else:
            try:
                _compare(ref, out, meta_only or _random_sample(variant, sample),
                         tol=opinfo_tolerances.lookup(variant, dtype_name))
                outcomes.append(("pass", ""))
            except Mismatch as e:
                if variant in TIE_OPS and _tie_equivalent(variant, sample, ref, out):
                    notes.add("indices of equal values ordered differently from the CPU "
                              "(allowed: not a stable sort)")
                    outcomes.append(("pass", ""))
                else:
                    outcomes.append(("mismatch", str(e)))
                    loose.append(_loose_close(ref, out, dtype_name))
        send_progress(i)
    fallbacks = _fallbacks()
    status, msg, counts = _aggregate(outcomes, "", fallbacks)
    result = {"status": status, "message": msg, "samples": counts, "fallbacks": fallbacks}
    _note_override(result, variant, dtype_name)
    if notes:
        result["notes"] = sorted(notes)
    if status == "skip":
        result["tpu_raised"] = tpu_raised_all
    if status == "mismatch" and loose:
        result["loose_close"] = all(loose)
    if status == "fallback_pass" and strict_check is not None:
        strict_check(result)
        result["strict"] = _strict(op, samples, keeps)
    return result


def _strict(op, samples, keeps):
    """Reruns the samples with the fallback forbidden: the first exception (naming the op
    without a lowering), or "no_raise"."""
    import torch_tpu

    torch_tpu.set_fallback("error")
    try:
        for i, sample in enumerate(samples):
            _seed(i)
            try:
                x, args, kwargs = _to_device((sample.input, sample.args, sample.kwargs), {},
                                             keep=keeps[i])
                out = op(x, *args, **kwargs)
                out = sample.output_process_fn_grad(out)
                _fetch(out, set())
                torch_tpu.sync()
            except Exception as e:  # noqa: BLE001
                return "raised " + _first_line(e)
        return "no_raise"
    finally:
        torch_tpu.set_fallback("warn")


def _grad_one(op, sample, on_tpu, keep=()):
    import torch

    if on_tpu:
        x, args, kwargs = _to_device((sample.input, sample.args, sample.kwargs), {},
                                     grad=True, keep=keep)
    else:
        x, args, kwargs = sample.input, sample.args, sample.kwargs
    inputs = [t for t in _tensors((x, args, kwargs)) if t.requires_grad]
    out = op(x, *args, **kwargs)
    out = sample.output_process_fn_grad(out)
    outs = [t for t in _tensors(out)
            if (t.is_floating_point() or t.is_complex()) and t.requires_grad]
    if not inputs or not outs:
        return None, len(outs)
    loss = sum(torch.view_as_real(t.resolve_conj()).sum() if t.is_complex() else t.sum()
               for t in outs)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return list(grads), len(outs)


def run_grad(op, max_samples, meta_only, send_progress):
    import torch
    import torch_tpu

    samples = _samples(op, torch.float32, True, max_samples)
    if not samples:
        return {"status": "grad_skip", "message": "no sample inputs", "samples": {}}
    keeps = _cpu_positions(op, torch.float32, True, samples)
    torch_tpu.set_fallback("warn")
    torch_tpu.reset_metrics()
    outcomes, loose = [], []
    variant = variant_name(op)
    for i, sample in enumerate(samples):
        try:
            _seed(i)
            ref, n_ref = _grad_one(op, sample, on_tpu=False)
        except Exception as e:  # noqa: BLE001
            outcomes.append(("cpu_fail", f"CPU backward raised {_first_line(e)}"))
            send_progress(i)
            continue
        if ref is None:
            outcomes.append(("cpu_fail", "no differentiable output or input"))
            send_progress(i)
            continue
        devices = set()
        try:
            _seed(i)
            out, n_out = _grad_one(op, sample, on_tpu=True, keep=keeps[i])
            if n_out != n_ref or out is None:
                raise RuntimeError(f"{n_out} differentiable outputs on tpu, {n_ref} on the CPU")
            out = _fetch(out, devices)
            torch_tpu.sync()
        except Exception as e:  # noqa: BLE001
            outcomes.append(("error", _first_line(e)))
            send_progress(i)
            continue
        if "cpu" in devices and not keeps[i]:
            outcomes.append(("mismatch", "gradient is on the cpu, not on tpu"))
        else:
            try:
                _compare(ref, out, meta_only or _random_sample(variant, sample), "grad",
                         tol=opinfo_tolerances.lookup(variant, "grad"))
                outcomes.append(("pass", ""))
            except Mismatch as e:
                outcomes.append(("mismatch", str(e)))
                loose.append(_loose_close(ref, out, "float32"))
        send_progress(i)
    fallbacks = _fallbacks()
    status, msg, counts = _aggregate(outcomes, "grad_", fallbacks)
    result = {"status": status, "message": msg, "samples": counts, "fallbacks": fallbacks}
    _note_override(result, variant, "grad")
    if status == "grad_mismatch" and loose:
        result["loose_close"] = all(loose)
    return result


def _ensure_torch_tpu():
    try:
        import torch_tpu  # noqa: F401
    except ImportError:
        sys.path.insert(0, REPO_ROOT)
        import torch_tpu  # noqa: F401


def worker_main(fd_out: int) -> None:
    """Reads units (JSON lines) on stdin, writes messages (JSON lines) to fd_out."""
    import faulthandler
    import warnings

    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTORCH_TEST_WITH_SLOW", "0")
    out = os.fdopen(fd_out, "w", buffering=1)

    def send(msg):
        out.write(json.dumps(msg) + "\n")
        out.flush()

    import torch

    _ensure_torch_tpu()
    import torch_tpu

    torch.set_num_threads(1)
    torch_tpu.set_fallback("warn")
    from torch.testing._internal.common_methods_invocations import op_db

    ops = {variant_name(op): op for op in op_db}
    send({"type": "ready", "pid": os.getpid(), "torch_tpu": torch_tpu.__file__})
    for line in sys.stdin:
        if not line.strip():
            continue
        unit = json.loads(line)
        print(f"=== unit {unit['variant']} {unit['dtype']} {unit['kind']}", file=sys.stderr,
              flush=True)
        op = ops[unit["variant"]]
        meta_only = unit["variant"] in NONDETERMINISTIC
        t0 = time.time()

        def progress(i):
            send({"type": "progress", "sample": i})

        def partial(result):
            send({"type": "partial", "result": dict(result, seconds=round(time.time() - t0, 3))})

        try:
            if unit["kind"] == "grad":
                result = run_grad(op, unit["max_samples"], meta_only, progress)
            else:
                result = run_forward(op, unit["dtype"], unit["max_samples"], meta_only,
                                     partial, progress,
                                     special=unit["kind"] if unit["kind"] in ("special", "empty", "state") else False)
        except Exception as e:  # noqa: BLE001  (e.g. sample_inputs itself failed)
            prefix = "grad_" if unit["kind"] == "grad" else ""
            result = {"status": prefix + "skip", "message": "harness: " + _first_line(e),
                      "samples": {}}
        if meta_only:
            result["meta_only"] = True
        result["seconds"] = round(time.time() - t0, 3)
        send({"type": "result", "result": result})


# --------------------------------------------------------------------------------------
# Parent side: enumerates units, drives workers, records results.
# --------------------------------------------------------------------------------------


def load_op_db():
    import warnings

    warnings.filterwarnings("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def enumerate_units(op_db, ops=None, dtypes=DTYPE_NAMES, shard=(0, 1), grad=True,
                    max_samples=8, special=False):
    """Units in op_db order: dicts with variant, dtype, kind ("fwd" or "grad"; with `special`
    ("special" or "empty"), units of that kind alone, float32: NaN and infinities planted, or the
    inputs made empty)."""
    import torch

    variants = []
    for op in op_db:
        v = variant_name(op)
        if ops is not None and v not in ops and op.name not in ops:
            continue
        variants.append((v, op))
    i, n = shard
    units = []
    for idx, (v, op) in enumerate(variants):
        if idx % n != i:
            continue
        supported = op.supported_dtypes("cpu")
        if special == "state":
            for d in ("float32", "int64", "bool"):
                if getattr(torch, d) in supported:
                    units.append({"variant": v, "dtype": d, "kind": special, "max_samples": max_samples})
            continue
        if special:
            if torch.float32 in supported:
                units.append({"variant": v, "dtype": "float32", "kind": special, "max_samples": max_samples})
            continue
        for d in dtypes:
            if getattr(torch, d) in supported:
                units.append({"variant": v, "dtype": d, "kind": "fwd", "max_samples": max_samples})
        if (grad and "float32" in dtypes and op.supports_autograd
                and torch.float32 in op.supported_backward_dtypes("cpu")):
            units.append({"variant": v, "dtype": "float32", "kind": "grad",
                          "max_samples": max_samples})
    return units


def sweep(units, workers=1, timeout=60.0, recycle=150, log_dir=None, partial_path=None,
          snapshot=True, progress=None):
    """Runs units in worker subprocesses; returns ({key: record}, extension digest). record:
    variant, dtype, kind, status, message, samples, fallbacks, seconds, ... ."""

    def key_of(u):
        return unit_key(u["variant"], u["dtype"], u["kind"])

    def record_of(u, res):
        return dict(variant=u["variant"], dtype=u["dtype"], kind=u["kind"], key=key_of(u), **res)

    return run_units(units, os.path.abspath(__file__), key_of, record_of,
                     extra_files=(opinfo_tolerances.__file__,), workers=workers,
                     timeout=timeout, recycle=recycle, log_dir=log_dir,
                     partial_path=partial_path, snapshot=snapshot, progress=progress)


def baseline_from(results):
    """The (variant, dtype) pairs that pass natively; grads as (variant, "grad")."""
    keys = []
    for rec in results.values():
        if rec["status"] in ("native_pass", "grad_native_pass"):
            keys.append(rec["key"])
    return sorted(keys)


read_ops_file = read_list  # one name a line, "#" comments


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shard", default="0/1", help="i/n: every n-th variant starting at i")
    p.add_argument("--ops", default=None, help="comma-separated op names or variants")
    p.add_argument("--ops-file", default=None, help="file with one op name or variant a line")
    p.add_argument("--dtypes", default=",".join(DTYPE_NAMES))
    p.add_argument("--no-grad", action="store_true", help="skip the gradient units")
    p.add_argument("--special", action="store_const", const="special", default=False,
                   help="the NaN/inf walk: float32 forward units only, NaN, inf and -inf planted in the inputs")
    p.add_argument("--empty", dest="special", action="store_const", const="empty",
                   help="the zero-size walk: float32 forward units only, inputs empty along their first dim")
    p.add_argument("--global-state", dest="special", action="store_const", const="state",
                   help="the global-state walk: float32, int64 and bool forward units, each sample cached "
                        "under the default state, then compared under float64 as the default dtype and "
                        "deterministic algorithms")
    p.add_argument("--max-samples", type=int, default=8)
    p.add_argument("--out", default=None, help="results JSON (default: none)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds without progress (per sample) before a unit counts as hung")
    p.add_argument("--recycle", type=int, default=150, help="restart a worker after N units")
    p.add_argument("--resume", action="store_true",
                   help="keep the units already recorded in OUT.partial.jsonl")
    p.add_argument("--no-snapshot", action="store_true",
                   help="workers import torch_tpu from the checkout instead of a snapshot")
    p.add_argument("--write-baseline", default=None,
                   help="write the native_pass pairs of this run to this JSON file")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--worker-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker_fd is not None:
        worker_main(args.worker_fd)
        return 0

    i, n = (int(x) for x in args.shard.split("/"))
    ops = None
    if args.ops:
        ops = {s.strip() for s in args.ops.split(",") if s.strip()}
    if args.ops_file:
        ops = (ops or set()) | set(read_ops_file(args.ops_file))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPE_NAMES + MORE_DTYPE_NAMES:
            p.error(f"unknown dtype {d}; choose from {DTYPE_NAMES + MORE_DTYPE_NAMES}")

    t0 = time.time()
    op_db = load_op_db()
    if ops is not None:
        known = {variant_name(op) for op in op_db} | {op.name for op in op_db}
        unknown = sorted(ops - known)
        if unknown:
            p.error(f"not in op_db: {', '.join(unknown)}")
    units = enumerate_units(op_db, ops, dtypes, (i, n), not args.no_grad, args.max_samples, args.special)
    partial_path = None
    if args.out:
        partial_path = args.out + ".partial.jsonl"
        if not args.resume and os.path.exists(partial_path):
            os.remove(partial_path)
    log_dir = (args.out + ".logs") if args.out else None
    print(f"opinfo_sweep: {len(units)} units (shard {i}/{n}), {args.workers} worker(s)",
          flush=True)

    def progress(rec, done, total):
        if args.quiet:
            return
        passed = rec["status"] in ("native_pass", "grad_native_pass")
        msg = "" if passed else f" {rec['message'][:100]}"
        print(f"[{done}/{total} {time.time() - t0:7.0f}s] {rec['variant']} "
              f"{'grad' if rec['kind'] == 'grad' else rec['dtype']}: {rec['status']}{msg}",
              flush=True)

    results, digest = sweep(units, args.workers, args.timeout, args.recycle, log_dir,
                              partial_path, not args.no_snapshot, progress)
    elapsed = time.time() - t0
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "extension_sha256": digest,
        "machine": machine_info(),
        "shard": f"{i}/{n}",
        "dtypes": dtypes,
        "max_samples": args.max_samples,
        "timeout_s": args.timeout,
        "elapsed_s": round(elapsed, 1),
        "units": len(units),
    }
    order = {unit_key(u["variant"], u["dtype"], u["kind"]): k for k, u in enumerate(units)}
    recs = sorted((r for r in results.values() if r["key"] in order), key=lambda r: order[r["key"]])
    counts = {}
    for r in recs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"opinfo_sweep: {len(recs)} units in {elapsed:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": recs}, f, indent=1)
    if args.write_baseline:
        with open(args.write_baseline, "w") as f:
            json.dump({"meta": {k: meta[k] for k in ("date", "commit", "dtypes", "max_samples")},
                       "ops": sorted(ops) if ops else None,
                       "native_pass": baseline_from({r["key"]: r for r in recs})}, f, indent=1)
            f.write("\n")
        print(f"opinfo_sweep: baseline written to {args.write_baseline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
