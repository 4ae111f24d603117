"""Layer norm, forward and backward, against PyTorch on the CPU: in strict and fused eager and
compiled, through the CPU plugin's kernels (float32, rows of 8 or more) and through the portable
StableHLO form (shorter rows, and every row with the kernels turned off)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torch_tpu

pytestmark = pytest.mark.mode_dependent  # the gate runs it in strict and fused eager

# (input shape, normalized shape, affine): rows that fill whole vectors, rows with a tail,
# two normalized dims, no weight and bias, and a row too short for the kernel.
CASES = [
    ((4, 16, 64), (64,), True),
    ((3, 5, 13), (5, 13), True),
    ((6, 40), (40,), False),
    ((7, 5), (5,), True),
]


def run(x, normalized, affine, device, grad_out):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(normalized, generator=g) if affine else None
    b = torch.randn(normalized, generator=g) if affine else None
    leaves = [t.detach().to(device).requires_grad_() for t in (x, w, b) if t is not None]
    xs = leaves[0]
    ws, bs = (leaves[1], leaves[2]) if affine else (None, None)
    y = F.layer_norm(xs, normalized, ws, bs, eps=1e-5)
    y.backward(grad_out.to(device))
    return [y.detach().cpu()] + [t.grad.cpu() for t in leaves]


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("shape,normalized,affine", CASES)
def test_layer_norm_forward_and_backward_match_the_cpu(fallback_error, mode, shape, normalized, affine):
    g = torch.Generator().manual_seed(0)
    # Rows away from zero: a one-pass variance would lose digits here.
    x = 3.0 + 2.0 * torch.randn(shape, generator=g)
    grad_out = torch.randn(shape, generator=g)
    want = run(x, normalized, affine, "cpu", grad_out)
    with torch_tpu.mode(mode):
        got = run(x, normalized, affine, "tpu", grad_out)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_compiled_layer_norm_is_one_node_each_way_and_matches_eager(fallback_error):
    ln = torch.nn.LayerNorm(64).to("tpu")
    x = torch.randn(8, 16, 64)
    eager_x = x.to("tpu").requires_grad_()
    ln(eager_x).square().sum().backward()
    eager_grads = [eager_x.grad.cpu()] + [p.grad.cpu() for p in ln.parameters()]
    ln.zero_grad(set_to_none=True)
    comp_x = x.to("tpu").requires_grad_()
    n = len(torch_tpu.compiled_graphs())
    torch.compile(ln, backend="tpu")(comp_x).square().sum().backward()
    for a, e in zip([comp_x.grad.cpu()] + [p.grad.cpu() for p in ln.parameters()], eager_grads):
        torch.testing.assert_close(a, e)
    graphs = torch_tpu.compiled_graphs()[n:]
    # Kept whole, layer norm is one op with its results each way (with the core
    # decompositions the backward graph had 15 ops).
    assert [g["ops"] for g in graphs] == [4, 4], graphs


def test_layer_norm_portable_form_matches_with_the_host_kernels_off():
    script = textwrap.dedent("""
        import torch, torch_tpu
        import torch.nn.functional as F
        torch_tpu.set_fallback("error")
        assert not torch_tpu._C._host_kernels()
        g = torch.Generator().manual_seed(0)
        x = 3.0 + 2.0 * torch.randn(4, 16, 64, generator=g)
        w, b, dy = torch.randn(64, generator=g), torch.randn(64, generator=g), torch.randn(4, 16, 64, generator=g)
        res = []
        for dev in ("cpu", "tpu"):
            a = [t.detach().to(dev).requires_grad_() for t in (x, w, b)]
            y = F.layer_norm(a[0], (64,), a[1], a[2])
            y.backward(dy.to(dev))
            res.append([y.detach().cpu()] + [t.grad.cpu() for t in a])
        for u, v in zip(*res):
            torch.testing.assert_close(v, u, rtol=1e-4, atol=1e-4)
        print("ok")
    """)
    env = dict(os.environ, TORCH_TPU_HOST_KERNELS="0")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
