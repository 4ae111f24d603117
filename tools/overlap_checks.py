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

  - any: out= is the first input (cat([a], out=a), take(x, i, out=x)): kernels that call
    assert_no_overlap refuse the same memory as well as a partly shared one; TensorIterator
    kernels (add(a, b, out=a)) allow it;
  - source: self is passed as another argument of the in-place variant
    (x.index_copy_(0, i, x)): kernels that call assert_no_overlap on their other inputs
    only (index_copy(x, 0, i, s, out=x) is allowed).

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
from opinfo_sweep import _samples, _to_device, load_op_db, variant_name  # noqa: E402

INTERNAL = "more than one element of the written-to tensor refers to a single memory location"
PARTIAL = "some elements of the input tensor and the written-to tensor refer to a single memory location"
# What kernels that refuse any overlap say (cat has words of its own).
ANY = (PARTIAL, "cannot refer to any of the output memory locations")


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


def _shared(a, b) -> bool:
    """Whether a and b (the same tensor included) have memory in common."""
    if a is b:
        return a.numel() > 0
    return _partly_shared(a, b) or (a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() ==
                                    b.untyped_storage().data_ptr() and (a.storage_offset(), a.stride(), a.shape) ==
                                    (b.storage_offset(), b.stride(), b.shape))


def _recorder():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        """The in-place ATen ops that ran and the one that raised."""

        def __init__(self):
            super().__init__()
            self.ran_internal, self.ran_partial, self.ran_any, self.raised = set(), set(), set(), None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            written, read = [], []
            for i, a in enumerate(func._schema.arguments):
                v = args[i] if i < len(args) else kwargs.get(a.name)
                is_written = a.alias_info is not None and a.alias_info.is_write
                for t in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(t, torch.Tensor):
                        (written if is_written else read).append(t)
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
            if any(_shared(w, r) for w in written for r in read):
                self.ran_any.add(base_name(func.name()))
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
    that device, with the overlap of `kind` ("internal", "partial" or "any")."""
    import torch

    for op in load_op_db():
        v = variant_name(op)
        if ops and v not in ops and op.name not in ops:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        fn = op.get_inplace() or getattr(torch.Tensor, op.name.split(".")[-1] + "_", None)
        try:
            samples = _samples(op, torch.float32, False, 6)
        except Exception:  # noqa: BLE001
            continue
        yield from _any_overlap_cases(op, v, fn, samples)
        if fn is None:
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


def _any_overlap_cases(op, v, fn, samples):
    """Cases of full overlap, which assert_no_partial_overlap allows and assert_no_overlap
    refuses: "any", out= set to the first input where the result has its shape (a list input:
    that tensor alone, cat([a], out=a)); "source", an argument of the in-place variant with
    self's dtype and rank set to self."""
    import torch

    for k, s in enumerate(samples):
        x = s.input
        first = x[0] if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor) else x
        if not isinstance(first, torch.Tensor) or first.numel() == 0:
            continue
        if op.supports_out:
            def call_out(written, *args, op=op, **kwargs):
                return op(*args, out=written, **kwargs)

            def make_out(device, s=s, op=op):
                inp, args, kwargs = (s.input, s.args, s.kwargs) if device == "cpu" else \
                    _to_device((s.input, s.args, s.kwargs), {})
                as_list = isinstance(inp, (list, tuple))
                written = (inp[0] if as_list else inp).clone()
                inp = [written] if as_list else written
                ref = op(inp, *args, **kwargs)
                if not isinstance(ref, torch.Tensor) or ref.shape != written.shape or ref.dtype != written.dtype:
                    raise ValueError("no full overlap to make")  # out= would be resized
                return written, [inp, *args], kwargs

            yield f"{v}#{k}", "any", call_out, make_out
        if fn is None or first is not x:
            continue
        # Self in place of each argument of its dtype and rank (scatter_'s src may be larger
        # than the index: self fits where the shapes allow; where not, the op's shape error
        # is no overlap message and the case counts for nothing).
        for i, a in enumerate(s.args):
            if not (isinstance(a, torch.Tensor) and a.dtype == x.dtype and a.dim() == x.dim()):
                continue

            def make_same(device, x=x, s=s, i=i):
                args, kwargs = (s.args, s.kwargs) if device == "cpu" else _to_device((s.args, s.kwargs), {})
                written = x.detach().clone().to(device)
                args = list(args)
                args[i] = written
                return written, args, kwargs

            yield f"{v}#{k}", "source", fn, make_same
        # Partial overlap through an argument of another shape (index_copy_'s source): a view of
        # the first elements of self.
        for i, a in enumerate(s.args):
            if not (isinstance(a, torch.Tensor) and a.dtype == x.dtype and 0 < a.numel() < x.numel()):
                continue

            def make_prefix(device, x=x, s=s, i=i, a=a):
                args, kwargs = (s.args, s.kwargs) if device == "cpu" else _to_device((s.args, s.kwargs), {})
                written = x.detach().clone().to(device)
                args = list(args)
                args[i] = written.view(-1)[: a.numel()].view(a.shape)
                return written, args, kwargs

            yield f"{v}#{k}", "partial", fn, make_prefix
            break


def probe(ops=None):
    checks = {"internal": set(), "partial": set(), "any": set(), "source": set()}
    lets = {"internal": set(), "partial": set(), "any": set(), "source": set()}
    for _, kind, fn, make in overlap_cases(ops):
        try:
            written, args, kwargs = make("cpu")
        except Exception:  # noqa: BLE001  (a view the sample's shapes do not allow)
            continue
        rec = _attempt(fn, written, *args, **kwargs)
        said = {"internal": (INTERNAL,), "partial": (PARTIAL,), "any": ANY, "source": ANY}[kind]
        if rec.raised and any(m in rec.raised[1] for m in said):
            checks[kind].add(rec.raised[0])
        lets[kind] |= {"internal": rec.ran_internal, "partial": rec.ran_partial, "any": rec.ran_any,
                       "source": rec.ran_any}[kind]
    found = {k: sorted(checks[k] - lets[k]) for k in checks}
    # An op in "any" refuses every overlap: it needs no "source" row.
    found["source"] = sorted(set(found["source"]) - set(found["any"]))
    # Partial overlap is a case of any overlap: an op in "any" needs no "partial" row (one in
    # "source" keeps its row, for self against out=).
    found["partial"] = sorted(set(found["partial"]) - set(found["any"]))
    return found


def main(argv=None):
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", metavar="PATH", required=True)
    p.add_argument("--ops", help="comma-separated OpInfo names (default: all)")
    a = p.parse_args(argv)
    found = probe(set(a.ops.split(",")) if a.ops else None)
    doc = {"about": "ATen ops (base names) whose CPU kernels refuse to write through internally overlapping "
                    "memory, through memory partly shared with an input, through any memory an input "
                    "shares, or through any memory an input other than self shares (tools/overlap_checks.py)",
           "torch": torch.__version__, "date": datetime.date.today().isoformat(), **found}
    with open(a.write, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"internal: {len(found['internal'])} ops, partial: {len(found['partial'])} ops, "
          f"any: {len(found['any'])} ops, source: {len(found['source'])} ops -> {a.write}")


if __name__ == "__main__":
    sys.exit(main())
