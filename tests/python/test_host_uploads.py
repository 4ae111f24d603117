"""Values the host knows are uploaded, not computed (csrc/dispatch/dispatcher.cpp, KeptUploads):
strict eager writes a small whole fill (test_dispatch_cost.py) or arange from host bytes instead of
compiling a program per shape, dtype and value, and keeps those buffers for the next request of the
same values. These check the aranges and that kept bytes are found by what they hold, never by
chance (issue 59, item 6: the GPT's cold warm-up, benchmarks/warmup.py).
"""

import pytest
import torch

import torch_tpu


def test_kept_fills_are_found_by_value_and_its_type():
    # 1 and the double whose bits are 1 (5e-324) are different values: a kept buffer of ones must not
    # be handed to a fill with 5e-324.
    a = torch.empty(5, dtype=torch.float64, device="tpu").fill_(1)
    torch.testing.assert_close(a.cpu(), torch.ones(5, dtype=torch.float64))
    del a
    b = torch.empty(5, dtype=torch.float64, device="tpu").fill_(5e-324)
    torch.testing.assert_close(b.cpu(), torch.full((5,), 5e-324, dtype=torch.float64), rtol=0, atol=0)


def test_small_aranges_compile_nothing_and_kept_buffers_do_not_leak():
    # Strict eager computes a small arange on the host (PyTorch's CPU kernel) and uploads it, kept
    # like a fill's bytes, instead of compiling a program per start, end, step and dtype (the GPT's
    # position ids). Fused eager records aranges into its graph.
    fused = torch_tpu._C._fused()
    cases = [(0, 37, 1, torch.int64), (3, 50, 4, torch.int32), (0.5, 9.25, 0.75, torch.float32),
             (-2, 2, 0.5, torch.float64), (5, -7, -2, torch.int64), (0, 20, 3, torch.bfloat16),
             (1, 9, 1, torch.int16), (2, 2, 1, torch.float32)]
    signatures = torch_tpu.metrics()["kernel_signatures"]
    got = [torch.arange(s, e, st, dtype=dt, device="tpu") for s, e, st, dt in cases]
    got.append(torch.arange(11, device="tpu"))
    got.append(torch.arange(6.0, device="tpu"))
    if not fused:
        assert torch_tpu.metrics()["kernel_signatures"] == signatures, "small aranges built strict programs"
    want = [torch.arange(s, e, st, dtype=dt) for s, e, st, dt in cases] + [torch.arange(11), torch.arange(6.0)]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
        torch.testing.assert_close(g.cpu(), w)
    # The same values with another start or step type never share kept bytes: 1 and the double
    # whose bits are 1 (5e-324) are different starts.
    torch.testing.assert_close(torch.arange(1, 4, dtype=torch.float64, device="tpu").cpu(),
                               torch.arange(1, 4, dtype=torch.float64))
    torch.testing.assert_close(torch.arange(5e-324, 3, dtype=torch.float64, device="tpu").cpu(),
                               torch.arange(5e-324, 3, dtype=torch.float64), rtol=0, atol=0)
    # A holder's writes never reach the kept buffer, nor the next holder.
    a = torch.arange(29, device="tpu")
    del a
    a = torch.arange(29, device="tpu")
    b = torch.arange(29, device="tpu")
    a.add_(100)
    b[3] = -1
    c = torch.arange(29, device="tpu")
    want_b = torch.arange(29)
    want_b[3] = -1
    assert torch.equal(a.cpu(), torch.arange(29) + 100) and torch.equal(b.cpu(), want_b)
    assert torch.equal(c.cpu(), torch.arange(29))
    # out= a fresh tensor is written whole, out= a view of a bigger one through the view; big aranges
    # take the program's path; all agree with the CPU.
    out = torch.empty(0, dtype=torch.int64, device="tpu")
    torch.arange(4, 12, 2, out=out)
    assert torch.equal(out.cpu(), torch.arange(4, 12, 2))
    buf = torch.zeros(10, dtype=torch.int64, device="tpu")
    torch.arange(4, 12, 2, out=buf[2:6])
    want_buf = torch.zeros(10, dtype=torch.int64)
    want_buf[2:6] = torch.arange(4, 12, 2)
    assert torch.equal(buf.cpu(), want_buf)
    big = torch.arange(100000, dtype=torch.float32, device="tpu")
    torch.testing.assert_close(big.cpu(), torch.arange(100000, dtype=torch.float32))
    with pytest.raises(RuntimeError):
        torch.arange(0, 5, 0, device="tpu")  # step 0 raises, as on the CPU
