"""embedding_bag on tpu, natively: every mode (sum, mean, max), per-sample weights, padding_idx,
include_last_offset, int32 and int64 indices, 2-d input, empty bags; forward and backward equal
the CPU's (PyTorch's tolerances); bad input raises what the CPU raises. TorchRec's embedding
collections pool through this op (tests/python/test_torchrec.py). Also the jagged/padded
conversions lowered beside it (csrc/ops/segments.cpp)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.mode_dependent

V, D = 20, 5
IDX = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 3]
# Bag 1 is empty; with include_last_offset the last offset closes the last bag.
OFFSETS = [0, 2, 2, 7, 10]

CASES = [
    (mode, psw, last, pad, itype)
    for mode, psw, last, pad, itype in itertools.product(
        ["sum", "mean", "max"], [False, True], [False, True], [None, 3], [torch.int64, torch.int32]
    )
    if not (psw and mode != "sum")
]


def _run(dev, w, idx, off, psw, grad, **kw):
    """Output and the gradients of weight and per-sample weights of one embedding_bag call."""
    ww = w.detach().to(dev).requires_grad_()
    p = psw.detach().to(dev).requires_grad_() if psw is not None else None
    out = F.embedding_bag(idx.to(dev), ww, off.to(dev) if off is not None else None, per_sample_weights=p, **kw)
    out.backward(grad.to(dev))
    return out.detach().cpu(), ww.grad.cpu(), p.grad.cpu() if p is not None else None


# The gate runs a covering sample (each mode, per-sample weights, include_last_offset, padding_idx
# and index dtype at least once); the full tier every combination.
GATE = {("sum", True, True, 3, torch.int32), ("sum", False, False, None, torch.int64),
        ("mean", False, True, 3, torch.int64), ("mean", False, False, None, torch.int32),
        ("max", False, True, None, torch.int32), ("max", False, False, 3, torch.int64)}


@pytest.mark.parametrize("mode,psw,last,pad,itype",
                         [c if c in GATE else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_forward_and_backward_match_cpu(mode, psw, last, pad, itype, fallback_error):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, D, generator=g)
    idx = torch.tensor(IDX, dtype=itype)
    off = torch.tensor(OFFSETS + ([len(IDX)] if last else []), dtype=itype)
    weights = torch.randn(len(IDX), generator=g) if psw else None
    grad = torch.randn(len(OFFSETS), D, generator=g)
    kw = dict(mode=mode, include_last_offset=last, padding_idx=pad)
    ref = _run("cpu", w, idx, off, weights, grad, **kw)
    out = _run("tpu", w, idx, off, weights, grad, **kw)
    for o, r in zip(out, ref):
        if r is not None:
            torch.testing.assert_close(o, r)


def test_module_with_2d_input_and_low_precision(fallback_error):
    # A 2-d input is bags of equal length (no offsets); bfloat16 tables pool in float32 as the CPU does.
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        bag = torch.nn.EmbeddingBag(V, D, mode="mean", dtype=dtype)
        x = torch.randint(0, V, (6, 4))
        ref = bag(x)
        ref.float().sum().backward()
        tbag = torch.nn.EmbeddingBag(V, D, mode="mean", dtype=dtype).to("tpu")
        tbag.load_state_dict(bag.state_dict())
        out = tbag(x.to("tpu"))
        out.float().sum().backward()
        torch.testing.assert_close(out.cpu(), ref)
        torch.testing.assert_close(tbag.weight.grad.cpu(), bag.weight.grad)


def _pooled_by_embedding(w, idx, off, mode):
    """embedding_bag built from F.embedding (scale_grad_by_freq there) and a segment sum: the
    reference for scale_grad_by_freq. The CPU's own embedding_bag kernel scales by the wrong
    counts (torch 2.13: with indices [3, 1, 4, 1, ...] in sum mode it gives row 2 a gradient of
    0.5 and row 3 one of 3.0 where each row's should be 1)."""
    rows = F.embedding(idx, w, scale_grad_by_freq=True)
    bag = torch.searchsorted(off, torch.arange(len(idx)), right=True) - 1
    out = torch.zeros(len(off), w.shape[1]).index_add(0, bag, rows)
    if mode == "mean":
        out = out / torch.bincount(bag, minlength=len(off)).clamp(min=1)[:, None]
    return out


def test_scale_grad_by_freq_and_no_grad(fallback_error):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(V, D, generator=g)
    idx, off = torch.tensor(IDX), torch.tensor(OFFSETS)
    grad = torch.randn(len(OFFSETS), D, generator=g)
    for mode in ("sum", "mean"):
        ref_w = w.clone().requires_grad_()
        _pooled_by_embedding(ref_w, idx, off, mode).backward(grad)
        out = _run("tpu", w, idx, off, None, grad, mode=mode, scale_grad_by_freq=True)
        torch.testing.assert_close(out[1], ref_w.grad)
    with torch.no_grad():  # _embedding_bag_forward_only
        out = F.embedding_bag(idx.to("tpu"), w.to("tpu"), off.to("tpu"), mode="max")
    torch.testing.assert_close(out.cpu(), F.embedding_bag(idx, w, off, mode="max"))


def test_compiled_matches_eager(fallback_error):
    bag = torch.nn.EmbeddingBag(V, D, mode="sum").to("tpu")
    idx, off = torch.tensor(IDX, device="tpu"), torch.tensor(OFFSETS, device="tpu")
    psw = torch.rand(len(IDX), device="tpu")
    want = bag(idx, off, per_sample_weights=psw)
    got = torch.compile(bag, backend="tpu")(idx, off, per_sample_weights=psw)
    torch.testing.assert_close(got.cpu(), want.cpu())


def test_bad_input_raises_like_cpu():
    w = torch.randn(V, D)
    off = torch.tensor(OFFSETS)
    # An index past the table: the CPU's RuntimeError (not IndexError, unlike indexing).
    with pytest.raises(RuntimeError):
        F.embedding_bag(torch.tensor([0, V]), w, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="index out of range"):
        F.embedding_bag(torch.tensor([0, V], device="tpu"), w.to("tpu"), torch.tensor([0], device="tpu")).cpu()
    # Per-sample weights outside sum mode, and of the wrong length: the CPU's errors.
    for kw in (dict(mode="mean", per_sample_weights=torch.rand(len(IDX))), dict(per_sample_weights=torch.rand(3))):
        with pytest.raises((ValueError, NotImplementedError, RuntimeError)) as cpu:
            F.embedding_bag(torch.tensor(IDX), w, off, **kw)
        tkw = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        with pytest.raises(cpu.type):
            F.embedding_bag(torch.tensor(IDX, device="tpu"), w.to("tpu"), off.to("tpu"), **tkw)
    # Offsets that do not start at 0, or run past the indices: the CPU's RuntimeError, not a result.
    for bad in ([1, 3], [0, len(IDX) + 1]):
        with pytest.raises(RuntimeError):
            F.embedding_bag(torch.tensor(IDX), w, torch.tensor(bad))
        with pytest.raises(RuntimeError, match="out of range"):
            F.embedding_bag(torch.tensor(IDX, device="tpu"), w.to("tpu"), torch.tensor(bad, device="tpu")).cpu()
    # Float indices.
    with pytest.raises(RuntimeError):
        F.embedding_bag(torch.tensor([0.0, 1.0], device="tpu"), w.to("tpu"), torch.tensor([0], device="tpu"))


def test_jagged_padded_conversions(fallback_error):
    # Nested (jagged) tensors' conversions, lowered with embedding_bag's segment machinery; VeRL's
    # FSDP engine pads its micro-batches with the first.
    vals, off = torch.randn(7, 3), torch.tensor([0, 2, 2, 7])
    for width in (5, 6):
        want = torch.ops.aten._jagged_to_padded_dense_forward(vals, [off], [width], 1.5)
        got = torch.ops.aten._jagged_to_padded_dense_forward(vals.to("tpu"), [off.to("tpu")], [width], 1.5)
        torch.testing.assert_close(got.cpu(), want)
        dense = torch.randn(3, width, 3)
        want = torch.ops.aten._padded_dense_to_jagged_forward(dense, [off], 7)
        got = torch.ops.aten._padded_dense_to_jagged_forward(dense.to("tpu"), [off.to("tpu")], 7)
        torch.testing.assert_close(got.cpu(), want)
    # A segment longer than the padded width: refused, as on the CPU.
    with pytest.raises(RuntimeError):
        torch.ops.aten._padded_dense_to_jagged_forward(torch.randn(3, 4, 3), [off], 7)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.aten._padded_dense_to_jagged_forward(torch.randn(3, 4, 3, device="tpu"), [off.to("tpu")], 7).cpu()
