#!/usr/bin/env python
"""Which in-place and out= ops PyTorch refuses to write through overlapping memory.

PyTorch's TensorIterator kernels raise when the written-to tensor has elements that share
memory ("x.expand(2, 3).add_(1)": internal overlap) or partly overlaps an input
("x[1:].copy_(x[:-1])": partial overlap); other kernels (fill_, index_put_, mm(out=)) do
not check. tpu writes through views with other machinery, so it must be told which ops
refuse. This tool asks the CPU, over every OpInfo op with an in-place variant:

  - internal: the sample's input is replaced by a view that repeats its first slice along
    a dimension (stride 0) and the in-place variant runs;
  - partial: where an argument has the input's shape and dtype, input and argument become
    two views of one storage, one element apart, and the in-place variant runs.

The innermost ATen op that raised PyTorch's overlap message (or ran without raising) is
noted; an op counts as checking when it raised and never ran through the same overlap.

    python tools/overlap_checks.py --write torch_tpu/_overlap_checks.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dtype_rejections import base_name  # noqa: E402
from opinfo_sweep import _samples, load_op_db, variant_name  # noqa: E402

INTERNAL = "more than one element of the written-to tensor refers to a single memory location"
PARTIAL = "some elements of the input tensor and the written-to tensor refer to a single memory location"


def _partly_shared(a, b) -> bool:
    """Whether a and b are different views whose memory ranges intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if (a.storage_offset(), a.stride(), a.shape) == (b.storage_offset(), b.stride(), b.shape):
        return False

    def span(t):
        last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _recorder():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        """The in-place ATen ops that ran and the one that raised."""

        def __init__(self):
            super().__init__()
            self.ran_internal, self.ran_partial, self.raised = set(), set(), None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            written, read = [], []
            for i, a in enumerate(func._schema.arguments):
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(v, torch.Tensor):
                    (written if a.alias_info is not None and a.alias_info.is_write else read).append(v)
            try:
                out = func(*args, **kwargs)
            except Exception as e:
                if self.raised is None and written:
                    self.raised = (base_name(func.name()), str(e))
                raise
            # Ran through an overlap without raising: the op does not check it.
            if any(torch._debug_has_internal_overlap(w) == 1 for w in written):
                self.ran_internal.add(base_name(func.name()))
            if any(_partly_shared(w, r) for w in written for r in read):
                self.ran_partial.add(base_name(func.name()))
            return out

    return Recorder()


def _attempt(fn, *args, **kwargs):
    rec = _recorder()
    try:
        with rec:
            fn(*args, **kwargs)
    except Exception:  # noqa: BLE001
        pass
    return rec


def overlap_cases(ops=None):
    """(name, kind, fn, make) for each probe: make(device) builds (written, args, kwargs) on
    that device, with the overlap of `kind` ("internal" or "partial")."""
    import torch

    from opinfo_sweep import _to_device

    for op in load_op_db():
        v = variant_name(op)
        if ops and v not in ops and op.name not in ops:
            continue
        fn = op.get_inplace() or getattr(torch.Tensor, op.name.split(".")[-1] + "_", None)
        if fn is None or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = _samples(op, torch.float32, False, 6)
        except Exception:  # noqa: BLE001
            continue
        for k, s in enumerate(samples):
            x = s.input
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                continue
            dims = [d for d in range(x.dim()) if x.size(d) > 1]
            if dims:
                def make_internal(device, x=x, s=s, d=dims[0]):
                    args, kwargs = _to_device((s.args, s.kwargs), {}) if device != "cpu" else (s.args, s.kwargs)
                    return x.detach().clone().to(device).narrow(d, 0, 1).expand_as(x), list(args), kwargs

                yield f"{v}#{k}", "internal", fn, make_internal
            for i, a in enumerate(s.args):
                if isinstance(a, torch.Tensor) and a.shape == x.shape and a.dtype == x.dtype and x.numel() > 1:
                    def make_partial(device, x=x, s=s, i=i):
                        args, kwargs = _to_device((s.args, s.kwargs), {}) if device != "cpu" else (s.args, s.kwargs)
                        torch.manual_seed(0)
                        base = torch.randn(x.numel() + 1, dtype=x.dtype).to(device)
                        args = list(args)
                        args[i] = base[:-1].view(x.shape)
                        return base[1:].view(x.shape), args, kwargs

                    yield f"{v}#{k}", "partial", fn, make_partial
                    break


def probe(ops=None):
    checks = {"internal": set(), "partial": set()}
    lets = {"internal": set(), "partial": set()}
    for _, kind, fn, make in overlap_cases(ops):
        written, args, kwargs = make("cpu")
        rec = _attempt(fn, written, *args, **kwargs)
        if rec.raised and (INTERNAL if kind == "internal" else PARTIAL) in rec.raised[1]:
            checks[kind].add(rec.raised[0])
        lets[kind] |= rec.ran_internal if kind == "internal" else rec.ran_partial
    return {k: sorted(checks[k] - lets[k]) for k in checks}


def main(argv=None):
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", metavar="PATH", required=True)
    p.add_argument("--ops", help="comma-separated OpInfo names (default: all)")
    a = p.parse_args(argv)
    found = probe(set(a.ops.split(",")) if a.ops else None)
    doc = {"about": "ATen ops (base names) whose CPU kernels refuse to write through internally overlapping "
                    "memory, or through memory partly shared with an input (tools/overlap_checks.py)",
           "torch": torch.__version__, "date": datetime.date.today().isoformat(), **found}
    with open(a.write, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"internal: {len(found['internal'])} ops, partial: {len(found['partial'])} ops -> {a.write}")


if __name__ == "__main__":
    sys.exit(main())
