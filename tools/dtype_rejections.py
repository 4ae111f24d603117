#!/usr/bin/env python
"""The dtypes PyTorch's CPU kernels reject, and whether tpu rejects them too.

An ATen kernel that has no code for a dtype raises ("\"addmm_impl_cpu_\" not implemented for
'Bool'"). A tpu lowering usually computes something for any dtype instead, so without a
table of these refusals tpu would return a value where PyTorch raises. This tool walks
every OpInfo variant over every tpu dtype its CPU OpInfo does not declare:

    python tools/dtype_rejections.py --write torch_tpu/_dtype_rejections.json
        runs the samples on the CPU under a dispatch mode that notes the innermost ATen op
        at each refusal, and writes the table torch_tpu loads at import: the op, the dtypes
        of its tensor arguments, the exception type and the CPU's message. A refusal holds
        for every overload of the op (fmod.Tensor, fmod.Scalar, fmod_, out=) with the same
        set of dtypes, unless some overload with that set succeeds in a sample: then only
        the refused overload with those dtypes in that order. Where the CPU refuses inside a
        CompositeImplicitAutograd op's own code (no ATen op raised: max_pool1d of integers),
        the row names that op, and tpu guards it at its autograd and backend keys; where the
        CPU's path through a composite differs from every other device's (DEVICE_PATHS), the
        refusal is written for the op tpu receives as well. It is left out where CUDA's
        OpInfo declares the dtype (tpu computes it, as CUDA does: "beyond" in the file lists
        them), or where the overload with the same dtypes succeeds in another sample (the
        refusal depends on other arguments).

    python tools/dtype_rejections.py --check [--workers N] [--out report.json]
        runs each refused sample on tpu as well, in worker subprocesses (a crash costs one
        unit), and counts units where tpu raised the CPU's exception type, raised another,
        returned a value (silent), or crashed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from opinfo_sweep import _first_line, _samples, _to_device, load_op_db, variant_name  # noqa: E402
from worker_pool import _git, machine_info, run_units  # noqa: E402

# The dtypes tpu holds where the plugin computes them (the CPU plugin: all of these).
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "complex64", "complex128", "uint16", "uint32", "uint64")
# CPU messages that mean "this kernel takes no tensors of this dtype" (an exception raised
# inside an ATen op; what Python raises before any op, tpu raises as well).
REFUSALS = ("not implemented for", "not supported for complex", "is not supported for complex",
            "does not support complex", "only support floating point", "only supports floating",
            "only support floating", "must be either float or double", "Expected a floating point",
            "is only supported for", "is only applicable to", "supports only floating",
            "expected a floating", "not implemented for complex", "requires a floating",
            "must be a floating", "dtype is not supported", "is not supported", "only supports",
            "does not support", "not intended to support", "not yet implemented", "inputs not supported",
            "to be non-complex", "handles only")
MAX_SAMPLES = 4
# CompositeImplicitAutograd ops whose CPU code path calls other ops than every other device's:
# the CPU refuses inside ops that tpu never receives, so the refusal is also written for the op
# tpu (like CUDA) receives. dropout: the CPU multiplies by a bernoulli_ mask; CUDA, XPU and
# PrivateUse1 call native_dropout (ATen's is_fused_kernel_acceptable).
DEVICE_PATHS = {"dropout": "aten::native_dropout"}


def is_refusal(exc: BaseException) -> bool:
    return isinstance(exc, (RuntimeError, NotImplementedError)) and any(r in str(exc) for r in REFUSALS)


def _tensor_dtypes(func, args, kwargs):
    """The dtypes of the op's tensor arguments in schema order, as the tpu dispatcher sees
    them (inside lists too; undefined ones skipped)."""
    import torch

    out = []

    def add(v):
        if isinstance(v, torch.Tensor):
            out.append(str(v.dtype).replace("torch.", ""))
        elif isinstance(v, (list, tuple)):
            for e in v:
                if isinstance(e, torch.Tensor):
                    out.append(str(e.dtype).replace("torch.", ""))

    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.dtype):  # a dtype argument (factories, sum(dtype=)), told apart from tensors
            out.append("dtype=" + str(v).replace("torch.", ""))
        else:
            add(v)
    return out


def base_name(op_name: str) -> str:
    """The op's name without namespace, overload and in-place underscore ("fmod" for
    aten::fmod_.Scalar), as the tpu dispatcher computes it."""
    base = op_name.split("::", 1)[-1].split(".", 1)[0]
    if len(base) > 1 and base.endswith("_") and not base.startswith("__"):
        base = base[:-1]
    return base


def general(key):
    """The key of a refusal for every overload: the base name and the dtypes as a set."""
    return base_name(key[0]), tuple(sorted(set(key[1])))


def _flat(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, (list, tuple)):
            yield from v
        else:
            yield v


def _recorder():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        """Notes every ATen op that ran and, at a refusal, the innermost op that raised."""

        def __init__(self):
            super().__init__()
            self.ok = set()
            self.refused = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            try:
                out = func(*args, **kwargs)
            except Exception as e:
                if self.refused is None and is_refusal(e):
                    self.refused = (func.name(), tuple(_tensor_dtypes(func, args, kwargs)), type(e).__name__,
                                    str(e).strip().splitlines()[0])
                raise
            # A kernel given an empty tensor often returns before it looks at the dtype:
            # that success says nothing about the dtype.
            if not any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in _flat(args, kwargs)):
                self.ok.add((func.name(), tuple(_tensor_dtypes(func, args, kwargs))))
            return out

    return Recorder()


def _outermost():
    """A torch-function mode that notes the outermost function called (F.max_pool1d) and
    its tensors' dtypes: where the CPU refuses inside a CompositeImplicitAutograd op's own
    C++ (max_pool1d's CPU-only max_pool1d_impl), no ATen op raised and this names the op."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Outermost(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.call = None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if self.call is None:
                dts = [str(v.dtype).replace("torch.", "") for v in _flat(args, kwargs) if isinstance(v, torch.Tensor)]
                self.call = (getattr(func, "__name__", ""), tuple(dts))
            return func(*args, **kwargs)

    return Outermost()


def composite_op(name: str):
    """aten::name when that op decomposes above the backends (CompositeImplicitAutograd): the
    tpu dispatcher guards such an op at its autograd key to see it at all."""
    import torch

    qualified = "aten::" + name
    try:
        return qualified if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd") else None
    except RuntimeError:  # no such op
        return None


def _run(op, sample):
    return op(sample.input, *sample.args, **sample.kwargs)


def probe(op, dtype):
    """(refusals, successes) of the op's CPU samples for dtype: refusals as (key, type,
    message, sample index), successes as keys."""
    refusals, ok = [], set()
    try:
        samples = _samples(op, dtype, False, MAX_SAMPLES)
    except Exception:  # noqa: BLE001 - the OpInfo cannot make samples of this dtype
        return refusals, ok
    for i, s in enumerate(samples):
        rec, outer = _recorder(), _outermost()
        composite = None
        try:
            with outer, rec:
                _run(op, s)
            # A dispatch mode can change a composite's path (max_pool1d takes its
            # with-indices path for tensor-subclass-like inputs): run a composite bare as well.
            composite = composite_op(outer.call[0]) if outer.call else None
            if composite:
                rec.refused = None  # what the bare run raises is the composite's own
                _run(op, s)
        except Exception as e:  # noqa: BLE001
            if rec.refused is not None and is_refusal(e):
                name, dts, etype, msg = rec.refused
                refusals.append(((name, dts), etype, msg, i))
                routed = DEVICE_PATHS.get(base_name(outer.call[0])) if outer.call else None
                if routed:
                    refusals.append(((routed, dts), etype, msg, i))
            elif rec.refused is None and is_refusal(e):
                composite = composite or (composite_op(outer.call[0]) if outer.call else None)
                if composite:
                    refusals.append(((composite, outer.call[1]), type(e).__name__, str(e).strip().splitlines()[0], i))
        ok |= rec.ok
    return refusals, ok


def _units(ops=None):
    """(variant, OpInfo, dtype name, dtype, CPU dtypes, CUDA dtypes) for every OpInfo
    variant (or those named in ops) and every tpu dtype."""
    import torch

    for op in load_op_db():
        v = variant_name(op)
        if ops and v not in ops and op.name not in ops:
            continue
        cpu, cuda = op.supported_dtypes("cpu"), op.supported_dtypes("cuda")
        for d in DTYPES:
            yield v, op, d, getattr(torch, d), cpu, cuda


def write_table(path, ops=None):
    import torch

    candidates, beyond, ok_keys = {}, {}, set()
    n_units = 0
    for v, op, _, dtype, cpu, cuda in _units(ops):
        refusals, ok = probe(op, dtype)
        # Evidence that an op computes a dtype comes from dtypes an OpInfo declares; where
        # neither the CPU nor CUDA declares it, CUDA refuses every sample, so a sample the CPU
        # happens to compute (a non-dilated int16 convolution) does not clear the refusal.
        if dtype in cpu or dtype in cuda:
            ok_keys |= ok
        if dtype in cpu:
            continue
        n_units += 1
        for key, etype, msg, _ in refusals:
            target = beyond if dtype in cuda else candidates
            target.setdefault(key, {"type": etype, "message": msg, "variants": set()})["variants"].add(v)
    ok_general = {general(k) for k in ok_keys}
    beyond_general = {general(k) for k in beyond}
    rows, seen_general = [], set()
    for k, e in sorted(candidates.items()):
        if k in ok_keys or k in beyond:
            continue
        g = general(k)
        row = {"type": e["type"], "message": e["message"], "variants": sorted(e["variants"])}
        if g not in ok_general and g not in beyond_general:
            if g in seen_general:
                continue
            seen_general.add(g)
            rows.append({"base": g[0], "dtypes": list(g[1]), **row})
        else:
            rows.append({"op": k[0], "dtypes": list(k[1]), **row})
    kept = [{"op": k[0], "dtypes": list(k[1]), "cpu_message": e["message"], "variants": sorted(e["variants"])}
            for k, e in sorted(beyond.items()) if k not in ok_keys]
    doc = {
        "about": "Ops with the tensor dtypes PyTorch's CPU kernels refuse and CUDA's OpInfo does not declare: "
                 "tpu raises the same exception. A row with 'base' holds for every overload of the op whose "
                 "tensors have exactly that set of dtypes; a row with 'op' for that overload with the dtypes in "
                 "that order. Written by tools/dtype_rejections.py --write; 'beyond': refusals of the CPU that "
                 "tpu does not copy, because CUDA computes them.",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "units_probed": n_units,
        "rejections": rows,
        "beyond": kept,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    n_base = sum(1 for r in rows if "base" in r)
    print(f"{len(rows)} refusals written to {path} ({n_base} for every overload, {len(rows) - n_base} for one; "
          f"{len(kept)} kept as CUDA computes them; {n_units} units probed)")


# ---- --check: the same samples on tpu, crash-isolated


def worker_main(fd_out):
    import warnings

    warnings.filterwarnings("ignore")
    out = os.fdopen(fd_out, "w", buffering=1)

    def send(msg):
        out.write(json.dumps(msg) + "\n")

    import torch

    import torch_tpu
    from torch_tpu import _C

    torch_tpu.set_fallback("warn")
    ops = {variant_name(op): op for op in load_op_db()}
    send({"type": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        unit = json.loads(line)
        if unit.get("without_table"):
            _C._set_dtype_refusals([])
        op, dtype = ops[unit["variant"]], getattr(torch, unit["dtype"])
        result = {"status": "cpu_computes", "samples": 0}
        try:
            samples = _samples(op, dtype, False, MAX_SAMPLES)
        except Exception as e:  # noqa: BLE001 - the OpInfo cannot make samples of this dtype
            samples = []
            result = {"status": "no_samples", "message": "harness: " + _first_line(e), "samples": 0}
        statuses = []
        for i, s in enumerate(samples):
            try:
                _run(op, s)
                continue
            except Exception as e:  # noqa: BLE001
                cpu_error = e
            if "with arguments from the 'CPU' backend" in str(cpu_error):
                continue  # no CPU kernel at all (CUDA-only ops): nothing said about the dtype
            send({"type": "progress", "sample": i})
            moved = _to_device((s.input, s.args, s.kwargs), {})
            try:
                out_t = op(moved[0], *moved[1], **moved[2])
                torch.tpu.synchronize()
                del out_t
                statuses.append(("silent", "CPU: " + _first_line(cpu_error)))
            except Exception as e:  # noqa: BLE001
                same = type(e) is type(cpu_error) or isinstance(e, type(cpu_error))
                statuses.append(("raised" if same else "raised_other",
                                 _first_line(e) + " | CPU: " + _first_line(cpu_error)))
        if statuses:
            order = ("silent", "raised_other", "raised")
            worst = min(statuses, key=lambda st: order.index(st[0]))
            result = {"status": worst[0], "message": worst[1], "samples": len(statuses)}
        send({"type": "result", "result": result})


def check(out_path, workers, ops=None, timeout=120.0, without_table=False):
    units = [{"variant": v, "dtype": d, "without_table": without_table}
             for v, _, d, dtype, cpu, cuda in _units(ops) if dtype not in cpu and dtype not in cuda]
    t0 = time.time()
    results, digest = run_units(
        units, os.path.abspath(__file__),
        key_of=lambda u: f"{u['variant']}|{u['dtype']}",
        record_of=lambda u, r: dict(r, key=f"{u['variant']}|{u['dtype']}"),
        extra_files=[os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                     for f in ("opinfo_sweep.py", "opinfo_tolerances.py", "worker_pool.py")],
        workers=workers, timeout=timeout)
    counts = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": _git("rev-parse", "HEAD"),
              "machine": machine_info(), "seconds": round(time.time() - t0, 1), "units": len(units),
              "counts": counts, "results": results}
    if out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(counts, sort_keys=True))
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", metavar="PATH", help="probe the CPU and write the table")
    p.add_argument("--check", action="store_true", help="run the refused samples on tpu too")
    p.add_argument("--ops", help="comma-separated OpInfo names or variants (default: all)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--out", help="--check: the report's JSON path")
    p.add_argument("--without-table", action="store_true", help="--check: tpu without the table (the before)")
    p.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker_fd is not None:
        return worker_main(a.worker_fd)
    ops = set(a.ops.split(",")) if a.ops else None
    if a.write:
        write_table(a.write, ops)
    if a.check:
        report = check(a.out, a.workers, ops, without_table=a.without_table)
        return 1 if any(k in report["counts"] for k in ("silent", "crash", "raised_other")) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
