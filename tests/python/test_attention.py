"""F.scaled_dot_product_attention against PyTorch on the CPU: one fused op (and
one backward op) where the device's lowering covers the call, PyTorch's math
path otherwise; both with the CPU fallback forbidden, in every mode."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torch_tpu
from tools import opinfo_tolerances


def qkv(shape_q, shape_kv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g).to(dtype)
    k = torch.randn(shape_kv[:3] + shape_q[3:], generator=g).to(dtype)
    v = torch.randn(shape_kv, generator=g).to(dtype)
    return q, k, v


def grads_both(q, k, v, **kw):
    """Output and input gradients on the CPU and on tpu."""
    res = []
    for dev in ("cpu", "tpu"):
        args = [t.detach().to(dev).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*args, **kw)
        g = torch.Generator().manual_seed(1)
        out.backward(torch.randn(out.shape, generator=g).to(out.dtype).to(dev))
        res.append((out, [a.grad for a in args]))
    return res


@pytest.mark.parametrize("causal", [True, False])
# On the CPU plugin both directions are host kernels up to width 64; at 128
# the backward is StableHLO.
@pytest.mark.parametrize("shape_q,shape_kv",
                         [((2, 3, 16, 8), (2, 3, 16, 8)), ((1, 2, 5, 4), (1, 2, 9, 4)), ((1, 2, 12, 64), (1, 2, 12, 64)),
                          ((1, 1, 10, 128), (1, 1, 10, 128))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_attention_matches_cpu(fallback_error, causal, shape_q, shape_kv, dtype):
    q, k, v = qkv(shape_q, shape_kv, dtype)
    (ref, ref_g), (out, out_g) = grads_both(q, k, v, is_causal=causal, scale=0.3)
    # One op forward and one backward: not PyTorch's math decomposition.
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.cpu(), ref, **tol)
    # The gradients at the OpInfo sweep's measured tolerance for this op's
    # gradients (tools/opinfo_tolerances.py), the one table of such overrides.
    # At width 128 the backward is XLA's code: on an AMD EPYC dK was 1.45e-5
    # from the CPU's, over the default atol (1.25e-5 from float64, the CPU 3.0e-6).
    if dtype == torch.float32:
        over = opinfo_tolerances.lookup("nn.functional.scaled_dot_product_attention", "grad")
        grad_tol = {"atol": over["atol"], "rtol": over["rtol"]}
    else:
        grad_tol = tol
    for a, b in zip(out_g, ref_g):
        torch.testing.assert_close(a.cpu(), b, **grad_tol)


@pytest.mark.parametrize(
    "case",
    ["bool_mask", "float_mask", "grouped_query", "value_width"],
)
def test_other_attention_calls_take_the_math_path(fallback_error, case):
    kw, shape_q, shape_kv = {}, (2, 4, 6, 8), (2, 4, 6, 8)
    if case == "bool_mask":
        kw["attn_mask"] = torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) > 0.3
        kw["attn_mask"][:, 0] = True  # no row without a visible key
    elif case == "float_mask":
        kw["attn_mask"] = torch.randn(6, 6, generator=torch.Generator().manual_seed(3))
    elif case == "grouped_query":
        shape_kv, kw["enable_gqa"] = (2, 2, 6, 8), True
    else:
        shape_kv = (2, 4, 6, 5)
    q, k, v = qkv(shape_q, shape_kv)
    res = []
    for dev in ("cpu", "tpu"):
        args = [t.detach().to(dev).requires_grad_() for t in (q, k, v)]
        extra = {n: (t.to(dev) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        out = F.scaled_dot_product_attention(*args, **extra)
        out.sum().backward()
        res.append((out, [a.grad for a in args]))
    (ref, ref_g), (out, out_g) = res
    assert type(out.grad_fn).__name__ != "ScaledDotProductFlashAttentionForCpuBackward0"
    torch.testing.assert_close(out.cpu(), ref)
    for a, b in zip(out_g, ref_g):
        torch.testing.assert_close(a.cpu(), b)


def test_direct_call_with_dropout_runs_on_the_cpu_when_fallback_is_allowed():
    # The fused op's lowering covers dropout_p == 0 only; a direct call with
    # dropout is an op without a lowering: the CPU kernel, or an error.
    q, k, v = (t.to("tpu") for t in qkv((1, 1, 4, 4), (1, 1, 4, 4)))
    torch_tpu.set_fallback("error")
    try:
        with pytest.raises(RuntimeError, match="attention with dropout"):
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.5, False)
    finally:
        torch_tpu.set_fallback("warn")


def test_compiled_attention_is_one_node_and_matches_eager(fallback_error):
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = qkv((2, 2, 8, 4), (2, 2, 8, 4))
    eager = [t.to("tpu").requires_grad_() for t in (q, k, v)]
    f(*eager).sum().backward()
    comp = [t.to("tpu").requires_grad_() for t in (q, k, v)]
    n = len(torch_tpu.compiled_graphs())
    torch.compile(f, backend="tpu")(*comp).sum().backward()
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a.grad.cpu(), b.grad.cpu())
    graphs = torch_tpu.compiled_graphs()[n:]
    # Forward: the attention op, its two results and the output saved for the
    # backward; backward: one op and its three results (the math path: 10+ each).
    assert [g["ops"] for g in graphs] == [4, 5], graphs


def test_cpu_plugin_runs_float32_attention_as_host_kernels_and_the_portable_form_still_matches():
    # On the CPU plugin float32 attention is the runtime's FFI kernel; the
    # StableHLO form (what TPU and GPU plugins compile) is checked here with
    # the kernels turned off, in a process of its own.
    if torch_tpu._C._platform() == "cpu":
        assert torch_tpu._C._host_kernels()
    script = textwrap.dedent("""
        import torch, torch_tpu
        import torch.nn.functional as F
        torch_tpu.set_fallback("error")
        assert not torch_tpu._C._host_kernels()
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
        for causal in (True, False):
            res = []
            for dev in ("cpu", "tpu"):
                a = [t.detach().to(dev).requires_grad_() for t in (q, k, v)]
                out = F.scaled_dot_product_attention(*a, is_causal=causal)
                out.backward(torch.ones_like(out))
                res.append([out.detach().cpu()] + [t.grad.cpu() for t in a])
            for x, y in zip(*res):
                torch.testing.assert_close(y, x)
        print("ok")
    """)
    env = dict(os.environ, TORCH_TPU_HOST_KERNELS="0")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_compiled_attention_with_dynamic_shapes_takes_the_math_path(fallback_error):
    # Symbolic sizes cannot be checked against the fused op's conditions at trace
    # time: PyTorch's math decomposition is traced instead (found by a Hugging
    # Face Llama compiled with dynamic shapes).
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(f, backend="tpu", dynamic=True)
    for L in (6, 9):
        q, k, v = qkv((1, 2, L, 8), (1, 2, L, 8), seed=L)
        ref = f(q, k, v)
        out = compiled(*(t.to("tpu") for t in (q, k, v)))
        torch.testing.assert_close(out.cpu(), ref)


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("causal", [True, False])
def test_heads_of_a_packed_projection_match_cpu_and_are_read_in_place(fallback_error, mode, causal):
    # GPT-style heads: q, k and v are views of one packed projection (rows of
    # 3*H*E), and cross attention reads k and v from a second packed
    # projection of another length. Fused eager and compiled graphs pass each
    # projection's storage to the kernel, which reads the heads in place.
    B, L, S, H, E = 2, 12, 7, 3, 8
    g = torch.Generator().manual_seed(0)
    data = {"x": torch.randn(B, L, 16, generator=g), "w": torch.randn(3 * H * E, 16, generator=g) * 0.3,
            "y": torch.randn(B, S, 16, generator=g), "wkv": torch.randn(2 * H * E, 16, generator=g) * 0.3}

    def heads(t):
        return t.view(B, -1, H, E).transpose(1, 2)

    def f(x, w, y, wkv):
        q, k, v = (x @ w.t()).split(H * E, dim=-1)
        self_att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=causal)
        kc, vc = (y @ wkv.t()).split(H * E, dim=-1)
        cross = F.scaled_dot_product_attention(heads(q), heads(kc), heads(vc), scale=0.2)
        return (self_att + cross).transpose(1, 2).reshape(B, L, H * E)

    results = []
    for dev in ("cpu", "tpu"):
        args = {n: t.to(dev).detach().requires_grad_() for n, t in data.items()}
        fn = torch.compile(f, backend="tpu") if dev == "tpu" and mode == "compiled" else f
        with torch_tpu.mode("fused" if dev == "tpu" and mode == "fused" else "strict"):
            out = fn(**args)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dev))
            results.append([out.detach().cpu()] + [args[n].grad.cpu() for n in data])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)
    # Strict eager runs each op on its own arrays; the other modes read q, k
    # and v (forward and backward, both attentions) from the projections,
    # each projection's storage passed once per call (self: 1, cross: 2).
    in_place = torch_tpu.metrics()["operands_in_place"]
    assert in_place == (0 if mode == "strict" else 6), in_place


def test_packed_qkv_gradients_come_out_in_one_buffer_only_in_multi_op_programs(tmp_path):
    # q, k and v split from one projection: in a compiled graph (and a fused
    # one) the attention backward writes their gradients into one buffer laid
    # out as the projection, and XLA folds the projection backward's
    # concatenation into it. Strict eager's one-op program keeps three
    # results, since slices of one would each be copied out. Read from the
    # programs XLA compiled, in a process of its own with a fresh cache.
    if torch_tpu._C._platform() != "cpu" or not torch_tpu._C._host_kernels():
        pytest.skip("the packed gradients are the CPU plugin's attention kernel")
    script = textwrap.dedent("""
        import torch, torch_tpu
        import torch.nn.functional as F
        torch_tpu.set_fallback("error")
        B, L, H, E = 2, 16, 2, 8
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(B, L, 32, generator=g), torch.randn(3 * H * E, 32, generator=g) * 0.2

        def f(x, w):
            q, k, v = (x @ w.t()).split(H * E, dim=-1)
            q, k, v = (t.view(B, L, H, E).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

        res = []
        for dev, fn in (("cpu", f), ("tpu", torch.compile(f, backend="tpu")), ("tpu", f)):
            a = [t.detach().clone().to(dev).requires_grad_() for t in (x, w)]
            with torch_tpu.mode("strict"):
                fn(*a).backward()
            res.append([t.grad.cpu() for t in a])
        for got in res[1:]:
            for y, want in zip(got, res[0]):
                torch.testing.assert_close(y, want)
        print("ok")
    """)
    dump = tmp_path / "dump"
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(tmp_path / "cache"),
               XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
    calls = []  # (result type, program has a concatenate) per backward kernel call
    for p in dump.glob("*after_optimizations.txt"):
        text = p.read_text()
        for line in text.splitlines():
            if 'custom_call_target="torch_tpu_attention_bwd"' in line:
                calls.append((line.split(" = ", 1)[1].split(" custom-call(")[0], "concatenate(" in text))
    packed = [c for c in calls if not c[0].startswith("(")]
    separate = [c for c in calls if c[0].startswith("(")]
    assert packed and not any(concat for _, concat in packed), calls  # the compiled graph
    assert separate, calls  # strict eager


def _varlen_reference(q, k, v, cu, window):
    """Per packed sequence, PyTorch's own attention on the CPU (causal when window is (-1, 0))."""
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=window == (-1, 0), enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1)])
def test_varlen_attention_matches_cpu(fallback_error, dtype, window):
    """torch.nn.attention.varlen.varlen_attn (TorchTitan's attention) calls the CUDA kernel
    aten::_flash_attention_forward / _backward directly; tpu has both."""
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, h, 8, generator=g).to(dtype) for h in (4, 2, 2))  # grouped-query: 4 q heads, 2 kv
    go = torch.randn(16, 4, 8, generator=g).to(dtype)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = _varlen_reference(*ref_in, cu, window)
    ref.backward(go.float())
    got_in = [t.detach().to("tpu").requires_grad_() for t in (q, k, v)]
    got = varlen_attn(*got_in, cu.to("tpu"), cu.to("tpu"), 8, 8, window_size=window, enable_gqa=True)
    got.backward(go.to("tpu"))
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.cpu().float(), ref, **tol)
    for a, b in zip(got_in, ref_in):
        torch.testing.assert_close(a.grad.cpu().float(), b.grad, **tol)


def test_flash_attention_refuses_what_it_does_not_implement(fallback_error):
    q = torch.randn(1, 4, 2, 8, device="tpu")
    with pytest.raises(NotImplementedError, match="dropout"):
        torch.ops.aten._flash_attention_forward(q, q, q, None, None, 4, 4, 0.1, False, False)
    seqused = torch.tensor([4], dtype=torch.int32, device="tpu")
    with pytest.raises(NotImplementedError, match="seqused_k"):
        torch.ops.aten._flash_attention_forward(q, q, q, None, None, 4, 4, 0.0, False, False, seqused_k=seqused)
    with pytest.raises(NotImplementedError, match="dropout"):
        torch.ops.aten._flash_attention_backward(q, q, q, q, q, q.new_zeros(1, 2, 4), None, None, 4, 4, 0.5, False,
                                                 q.new_zeros(2), q.new_zeros(0))


def test_assert_async(fallback_error):
    torch._assert_async(torch.tensor(1, device="tpu"))
    torch._assert_async(torch.tensor(True, device="tpu"), "fine")
    with pytest.raises(RuntimeError, match="positions out of order"):
        torch._assert_async(torch.tensor(0, device="tpu"), "positions out of order")
    with pytest.raises(RuntimeError, match="more than one value"):
        torch._assert_async(torch.ones(2, device="tpu"))
