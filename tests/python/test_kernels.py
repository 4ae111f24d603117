"""Custom kernels (torch_tpu.kernels): JAX and Pallas functions, StableHLO text and C++ FFI
handlers as PyTorch ops, against PyTorch on the CPU, in strict eager, fused eager and compiled
graphs, with the CPU fallback an error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torch_tpu

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from torch_tpu import kernels  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples", "kernels"))
sys.path.insert(0, os.path.join(REPO, "examples", "kernels", "ffi_adamw"))
import pallas_kernels as pk  # noqa: E402

pytestmark = pytest.mark.usefixtures("fallback_error")

MODES = ["strict", "fused", "compile"]


# ----------------------------------------------------------------------------- the kernels


@pytest.fixture(scope="module")
def rms_norm():
    return kernels.jax_op(pk.rms_norm, name="test_rms_norm",
                          backward=lambda x, w, dy, eps=1e-6: pk.rms_norm_bwd(x, w, dy, eps))


@pytest.fixture(scope="module")
def cross_entropy():
    return kernels.jax_op(pk.softmax_cross_entropy, name="test_softmax_ce",
                          backward=lambda logits, labels, dloss: (pk.softmax_cross_entropy_bwd(logits, labels, dloss),))


@pytest.fixture(scope="module")
def flash():
    return kernels.jax_op(
        lambda q, k, v, causal=False: pk.flash_attention(q, k, v, causal=causal, block_q=16, block_k=16),
        name="test_flash_attention",
        backward=lambda q, k, v, do, causal=False: pk.flash_attention_bwd(q, k, v, do, causal=causal))


def run(mode, fn, *args):
    """fn(*args) in `mode`; inputs that require grad get their .grad from sum(outputs)."""
    if mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="tpu", fullgraph=True)
    ctx = torch_tpu.mode("fused") if mode == "fused" else torch_tpu.mode("strict")
    with ctx:
        out = fn(*args)
        out.sum().backward() if out.requires_grad else None
        return out.cpu()


def leaves(*ts, device):
    return [t.detach().clone().to(device).requires_grad_(t.is_floating_point()) for t in ts]


def check(mode, fn, *inputs, rtol=1.3e-6, atol=1e-5):
    """fn on tpu in `mode` equals fn on the CPU, forward and gradients."""
    cpu = leaves(*inputs, device="cpu")
    want = fn(*cpu)
    want.sum().backward()
    tpu = leaves(*inputs, device="tpu")
    got = run(mode, fn, *tpu)
    torch.testing.assert_close(got, want.detach(), rtol=rtol, atol=atol)
    for a, b in zip(tpu, cpu):
        if b.grad is not None:
            torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=rtol, atol=atol)


def rms_reference(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# ----------------------------------------------------------------------------- examples


@pytest.mark.parametrize("mode", MODES)
def test_pallas_rms_norm_matches_pytorch(mode, rms_norm):
    x, w = torch.randn(32, 128), torch.randn(128)
    check(mode, lambda x, w: (rms_norm(x * 2, w) + 1).relu() if x.device.type == "tpu"
          else (rms_reference(x * 2, w) + 1).relu(), x, w)


@pytest.mark.parametrize("mode", MODES)
def test_pallas_softmax_cross_entropy_matches_pytorch(mode, cross_entropy):
    logits, labels = torch.randn(16, 256), torch.randint(0, 256, (16,), dtype=torch.int32)

    def loss(logits, labels):
        if logits.device.type == "tpu":
            return cross_entropy(logits * 0.5, labels).mean()
        return F.cross_entropy(logits * 0.5, labels.long())

    check(mode, loss, logits, labels)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_pallas_flash_attention_matches_sdpa(mode, causal, flash):
    q, k, v = (torch.randn(1, 2, 32, 64) for _ in range(3))

    def attn(q, k, v):
        if q.device.type == "tpu":
            return flash(q, k, v, causal=causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    check(mode, attn, q, k, v, atol=2e-5)


def test_fused_eager_puts_the_kernel_in_one_program_with_its_neighbours(rms_norm):
    x, w = torch.randn(32, 128, device="tpu"), torch.randn(128, device="tpu")
    rms_norm(x, w)  # lowered and compiled alone once
    # Under TORCH_TPU_DEFER_AND_FUSE=1 the lines above are pending: they run here, not as the
    # head of the chain's first graph (which then differed from its second and compiled again).
    torch.tpu.synchronize()
    with torch_tpu.mode("fused"):
        (rms_norm(x * 2, w) + 1).relu().sum().item()  # this chain's program compiled
        torch_tpu.reset_metrics()
        y = (rms_norm(x * 2, w) + 1).relu().sum()
        y.item()
    m = torch_tpu.metrics()
    assert m["executions"] == 1 and m["compiles"] == 0
    assert m["kernels"] == {"test_rms_norm": {"jax": 1}}


def test_compiled_model_with_a_kernel_has_no_graph_break(rms_norm):
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU()).to("tpu")
    w = torch.ones(128, device="tpu")

    def f(x):
        return rms_norm(model(x), w).sum()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(torch.randn(32, 128, device="tpu"))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    graph_ops = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert "torch_tpu_kernels.test_rms_norm.default" in graph_ops
    compiled = torch.compile(f, backend="tpu", fullgraph=True)
    x = torch.randn(32, 128, device="tpu")
    compiled(x).item()
    torch_tpu.reset_metrics()
    y = compiled(x).cpu()
    assert torch_tpu.metrics()["executions"] == 1  # the whole graph, the kernel inside, one program
    torch.testing.assert_close(y, f(x).cpu(), rtol=1.3e-6, atol=1e-4)


def test_jax_vjp_gives_the_gradient():
    @kernels.jax_op(name="test_tanh_scale")
    def tanh_scale(x, w, *, power=1):
        return jnp.tanh(x) ** power * w, jnp.sum(x)

    for mode in MODES:
        check(mode, lambda x, w: tanh_scale(x, w, power=2)[0] + tanh_scale(x, w)[1] if x.device.type == "tpu"
              else torch.tanh(x) ** 2 * w + x.sum(), torch.randn(8, 16), torch.randn(16))


def test_a_kernel_on_cpu_tensors_runs_on_the_host(rms_norm):
    x, w = torch.randn(32, 128), torch.randn(128)
    torch.testing.assert_close(rms_norm(x, w), rms_reference(x, w), rtol=1.3e-6, atol=1e-5)


# ----------------------------------------------------------------------------- StableHLO text

ADD_MUL = """
module @user_module {
  func.func public @main(%a: tensor<4x8xf32>, %b: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = stablehlo.multiply %a, %b : tensor<4x8xf32>
    %1 = func.call @plus_one(%0) : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %1 : tensor<4x8xf32>
  }
  func.func private @plus_one(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %c = stablehlo.constant dense<1.0> : tensor<4x8xf32>
    %0 = stablehlo.add %x, %c : tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }
}
"""


def test_stablehlo_text_is_an_op_in_every_mode():
    op = kernels.stablehlo_op("test_mul_add_one", ADD_MUL, out_shape=lambda a, b: (a.shape, a.dtype),
                              backward=lambda a, b, g: (g * b, g * a))
    for mode in MODES:
        check(mode, lambda a, b: op(a, b).exp() if a.device.type == "tpu" else (a * b + 1).exp(),
              torch.randn(4, 8), torch.randn(4, 8))


def test_stablehlo_the_plugin_rejects_names_the_kernel_and_the_device_goes_on():
    bad = ADD_MUL.replace("stablehlo.multiply", "stablehlo.multiply_newer_than_the_plugin")
    op = kernels.stablehlo_op("test_rejected", bad, out_shape=lambda a, b: (a.shape, a.dtype))
    a = torch.ones(4, 8, device="tpu")
    with pytest.raises(RuntimeError, match="kernel 'test_rejected': the plugin rejected its StableHLO"):
        op(a, a)
    assert (a + 1).sum().item() == 64
    with torch_tpu.mode("fused"):
        with pytest.raises(RuntimeError, match="test_rejected"):
            op(a, a)
        assert (a * 3).sum().item() == 96


# ----------------------------------------------------------------------------- C++ FFI


def adamw_reference(p, g, m, v, h):
    lr, b1, b2, eps, wd, step = h.tolist()
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return p - lr / (1 - b1**step) * m / (v.sqrt() / (1 - b2**step) ** 0.5 + eps), m, v


@pytest.fixture(scope="module")
def adamw_library(tmp_path_factory):
    import build  # examples/kernels/ffi_adamw/build.py

    return build.build(str(tmp_path_factory.mktemp("adamw")), include_dir=kernels.ffi_include_dir())


@pytest.fixture(scope="module")
def adamw(adamw_library):
    return kernels.ffi_op("test_adamw", "torch_tpu_test_adamw", library=adamw_library, symbol="TorchTpuExampleAdamW",
                          out_shape=lambda p, *rest: [(p.shape, p.dtype)] * 3, reference=adamw_reference)


@pytest.mark.parametrize("mode", MODES)
def test_ffi_adamw_equals_torch_optim_adamw(mode, adamw):
    torch.manual_seed(0)
    p0 = torch.randn(37, 129)
    param = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
    p, m, v = p0.to("tpu"), torch.zeros(37, 129, device="tpu"), torch.zeros(37, 129, device="tpu")

    def update(p, g, m, v, h):
        return adamw(p, g * 1.0, m, v, h)  # with a neighbour for fused eager and the graph

    if mode == "compile":
        torch._dynamo.reset()
        update = torch.compile(update, backend="tpu", fullgraph=True)
    with torch_tpu.mode("fused" if mode == "fused" else "strict"):
        for step in range(1, 4):
            g = torch.randn(37, 129)
            param.grad = g
            opt.step()
            h = torch.tensor([1e-2, 0.9, 0.999, 1e-8, 0.1, float(step)], device="tpu")
            p, m, v = update(p, g.to("tpu"), m, v, h)
        got = p.cpu()
    torch.testing.assert_close(got, param.detach(), rtol=1.3e-6, atol=1e-5)
    calls = torch_tpu.metrics()["kernels"]["test_adamw"]["ffi"]
    assert calls == (1 if mode == "compile" else 3)  # compiled replays do not dispatch


def test_ffi_handler_built_against_newer_headers_is_refused_clearly(tmp_path):
    import build

    so = build.build(str(tmp_path), include_dir=jax.ffi.include_dir())  # jaxlib's own: API 0.3
    with pytest.raises(RuntimeError, match=r"built against XLA FFI API 0\.3 headers; this plugin runs handlers of"):
        kernels.ffi_op("test_adamw_new_headers", "torch_tpu_test_adamw_03", library=so,
                       symbol="TorchTpuExampleAdamW", out_shape=lambda p, *rest: [(p.shape, p.dtype)] * 3)


def test_ffi_missing_library_or_symbol(tmp_path, adamw_library):
    with pytest.raises(RuntimeError, match="cannot load the FFI kernel library"):
        kernels.ffi_op("test_no_lib", "t_no_lib", library=str(tmp_path / "missing.so"),
                       out_shape=lambda p: (p.shape, p.dtype))
    with pytest.raises(RuntimeError, match="has no symbol NoSuchHandler"):
        kernels.ffi_op("test_no_sym", "t_no_sym", library=adamw_library, symbol="NoSuchHandler",
                       out_shape=lambda p: (p.shape, p.dtype))


# ----------------------------------------------------------------------------- per platform


def test_the_reference_runs_where_the_plugin_has_no_implementation():
    op = kernels.Kernel("test_gpu_only", out_shape=lambda x: (x.shape, x.dtype), reference=lambda x: x.sin() * 2)
    op.add_ffi("some_cuda_target", platform="cuda")
    x = torch.randn(5, 3)
    torch.testing.assert_close(op(x.to("tpu")).cpu(), x.sin() * 2)
    assert torch_tpu.metrics()["kernels"]["test_gpu_only"] == {"reference": 1}
    no_ref = kernels.Kernel("test_gpu_only_no_ref", out_shape=lambda x: (x.shape, x.dtype))
    no_ref.add_ffi("some_cuda_target", platform="cuda")
    with pytest.raises(NotImplementedError, match="'test_gpu_only_no_ref' has no implementation for the 'cpu'"):
        no_ref(x.to("tpu"))


def test_per_platform_choice_picks_the_running_plugins():
    op = kernels.Kernel("test_two_impls", reference=lambda x: x + 100)
    op.add_jax(lambda x: x * 10, platforms=["cuda"]).add_jax(lambda x: x * 3, platforms=["cpu"])
    x = torch.arange(4.0)
    torch.testing.assert_close(op(x.to("tpu")).cpu(), x * 3)
    assert torch_tpu.metrics()["kernels"]["test_two_impls"] == {"jax": 1}


# ----------------------------------------------------------------------------- bad input


def test_a_jax_function_returning_the_wrong_shape_for_its_rule():
    op = kernels.jax_op(lambda x: x[:, :-1], name="test_wrong_rule", out_shape=lambda x: (x.shape, x.dtype))
    x = torch.ones(3, 4, device="tpu")
    with pytest.raises(ValueError, match=r"'test_wrong_rule': the JAX function returns float32\[3, 3\], its "
                                         r"out_shape rule says float32\[3, 4\]"):
        op(x)
    assert (x * 2).sum().item() == 24


def test_a_kernel_that_fails_to_lower():
    op = kernels.jax_op(lambda x: jnp.reshape(x, (7,)), name="test_unlowerable")
    with pytest.raises(RuntimeError, match="'test_unlowerable': JAX could not"):
        op(torch.ones(3, 4, device="tpu"))


def test_kernel_names_and_attributes():
    # A name of its own: with the suite spread over worker processes, another test's kernel may
    # not have been registered in this one.
    kernels.jax_op(lambda x: x + 1, name="test_taken")
    with pytest.raises(ValueError, match="exists already"):
        kernels.Kernel("test_taken")
    with pytest.raises(ValueError, match="not a valid op name"):
        kernels.Kernel("has space")
    op = kernels.jax_op(lambda x, scale=1.0: x * scale, name="test_attrs")
    with pytest.raises(TypeError, match="attribute values must be"):
        op(torch.ones(2, device="tpu"), scale=[1.0])
    torch.testing.assert_close(op(torch.ones(2, device="tpu"), scale=2.5).cpu(), torch.full((2,), 2.5))


def test_a_jax_kernel_without_jax_installed():
    code = textwrap.dedent("""
        import sys
        sys.modules["jax"] = None  # as if JAX were not installed
        import torch, torch_tpu
        from torch_tpu import kernels
        try:
            kernels.jax_op(lambda x: x, name="needs_jax")
        except ModuleNotFoundError as e:
            print("raised:", e)
        print("device:", (torch.ones(3, device="tpu") * 2).sum().item())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "raised: torch_tpu kernel 'needs_jax' is a JAX kernel, and JAX is not installed" in out.stdout, out.stderr
    assert "device: 6.0" in out.stdout


def test_pallas_lowers_for_the_plugins_platform(monkeypatch):
    """On a TPU plugin the same Pallas source becomes a Mosaic custom call (lowered here, not run)."""
    from jax.experimental import pallas as pl

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def kernel(x):
        return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    monkeypatch.setattr(kernels, "_platform", lambda: "tpu")
    text, results = kernels._lower_jax("test_mosaic", kernel, [torch.ones(8, 128)], {})
    assert "tpu_custom_call" in text and results == [("float32", [8, 128])]
