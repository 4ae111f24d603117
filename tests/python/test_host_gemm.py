"""Float32 matrix products on the CPU plugin run as the runtime's GEMM kernel on
MKL (runtime/host_kernels.h); a transposed operand (a linear layer's weight, the
activations of its weight gradient) reaches the kernel untransposed, with a flag.
Checked against PyTorch on the CPU with the fallback forbidden, in every mode,
and with the kernel turned off."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torch_tpu


def operand(rows, cols, transposed, seed):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # a [rows, cols] view of a [cols, rows] matrix
        return torch.randn(cols, rows, generator=g).t()
    return torch.randn(rows, cols, generator=g)


def test_cpu_plugin_uses_the_host_gemm():
    if torch_tpu._C._platform() != "cpu":
        pytest.skip("the host GEMM is the CPU plugin's")
    assert torch_tpu._C._host_gemm()


def test_strict_linear_reads_the_stored_weight_without_a_transpose_program(fallback_error):
    # The weight's transposed view reaches the product as the stored matrix (the kernel
    # transposes it with a flag): one program per linear, not a transposing read first.
    if torch_tpu._C._platform() != "cpu":
        pytest.skip("the host GEMM is the CPU plugin's")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 32, generator=g), torch.randn(18, 32, generator=g), torch.randn(16, generator=g)
    xt, wt, bt = x.to("tpu"), w.to("tpu"), b.to("tpu")
    whole = wt[:16].clone()
    with torch_tpu.mode("strict"):
        F.linear(xt, whole, bt)
        torch.tpu.synchronize()
        before = torch_tpu.metrics()["executions"]
        y = F.linear(xt, whole, bt)
        torch.tpu.synchronize()
        assert torch_tpu.metrics()["executions"] - before == 1
        # Weights that are part of their storage read as that part.
        z = F.linear(xt, wt[2:], bt)
        u = F.linear(xt, wt[:16], bt)
    torch.testing.assert_close(y.cpu(), F.linear(x, w[:16], b))
    torch.testing.assert_close(z.cpu(), F.linear(x, w[2:], b))
    torch.testing.assert_close(u.cpu(), F.linear(x, w[:16], b))


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
# Above and below the kernel's size threshold, row and column splits.
@pytest.mark.parametrize("m,k,n", [(300, 70, 130), (37, 64, 300), (8, 8, 8), (1024, 64, 192)])
def test_products_with_transposed_operands_match_cpu(fallback_error, mode, ta, tb, m, k, n):
    a, b = operand(m, k, ta, 0), operand(k, n, tb, 1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    with torch_tpu.mode(mode):
        da, db, dbias = a.to("tpu"), b.to("tpu"), bias.to("tpu")
        assert da.stride() == a.stride()
        mm = (da @ db).cpu()
        addmm = torch.addmm(dbias, da, db, beta=0.5, alpha=2.0).cpu()
    torch.testing.assert_close(mm, a @ b)
    torch.testing.assert_close(addmm, torch.addmm(bias, a, b, beta=0.5, alpha=2.0))


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_addmm_adds_the_bias_in_the_kernel_as_the_cpu_does(fallback_error, mode):
    # A bias row ([N] or [1, N]) is added by the GEMM kernel: alpha and beta
    # apply, and beta=0 ignores a NaN bias, as PyTorch's CPU addmm does.
    a, b = operand(300, 70, False, 0), operand(70, 130, True, 1)
    bias = torch.randn(130, generator=torch.Generator().manual_seed(2))
    nan_bias = torch.full((1, 130), float("nan"))
    with torch_tpu.mode(mode):
        da, db = a.to("tpu"), b.to("tpu")
        got = [torch.addmm(bias.to("tpu"), da, db).cpu(),
               torch.addmm(bias.view(1, -1).to("tpu"), da, db, alpha=-1.5, beta=3.0).cpu(),
               torch.addmm(nan_bias.to("tpu"), da, db, beta=0).cpu()]
    want = [torch.addmm(bias, a, b), torch.addmm(bias.view(1, -1), a, b, alpha=-1.5, beta=3.0),
            torch.addmm(nan_bias, a, b, beta=0)]
    # alpha * (a @ b) + beta * bias rounds once per term wherever it is
    # computed: where the terms (up to about 60 here) cancel, the default
    # relative tolerance of the small result is below one rounding of them.
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=3e-5, rtol=1.3e-6)
    assert not torch.isnan(got[2]).any()


@pytest.mark.parametrize("backend", [None, "tpu"])
def test_linear_layers_train_like_the_cpu(fallback_error, backend):
    # The backward's weight gradients multiply transposed activations.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 96))
    x = torch.randn(512, 64)
    results = []
    for dev in ("cpu", "tpu"):
        m = copy.deepcopy(model).to(dev)
        run = torch.compile(m, backend=backend) if (backend and dev == "tpu") else m
        out = run(x.to(dev))
        loss = (out * out).mean()
        m.zero_grad()
        loss.backward()
        results.append([out.detach().cpu()] + [p.grad.cpu() for p in m.parameters()])
    for want, got in zip(*results):
        torch.testing.assert_close(got, want)


def test_with_the_host_gemm_off_products_are_xla_dots_and_still_match():
    script = textwrap.dedent("""
        import torch, torch_tpu
        torch_tpu.set_fallback("error")
        assert not torch_tpu._C._host_gemm()
        g = torch.Generator().manual_seed(0)
        a = torch.randn(64, 300, generator=g).t()
        b = torch.randn(64, 128, generator=g)
        torch.testing.assert_close((a.to("tpu") @ b.to("tpu")).cpu(), a @ b)
        print("ok")
    """)
    env = dict(os.environ, TORCH_TPU_HOST_GEMM="0")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
