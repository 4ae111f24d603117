"""torch._grouped_mm (a mixture of experts' products) on tpu: every form PyTorch has,
forward and backward, against PyTorch's own CPU kernel; natively (TORCH_TPU_FALLBACK=error),
and inside torch.compile as one replayable program (no size read back)."""

import pytest
import torch

import torch_tpu

G, M, K, N = 3, 16, 16, 8
TOL = dict(rtol=2e-2, atol=2e-2)  # bfloat16 results


@pytest.fixture(autouse=True)
def _native():
    torch_tpu.set_fallback("error")
    yield
    torch_tpu.set_fallback("warn")


def _cases():
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.bfloat16)

    return {
        "rows grouped (2d x 3d)": (r(M, K), r(G, N, K).transpose(-2, -1), torch.tensor([3, 9, M], dtype=torch.int32)),
        "batched (3d x 3d)": (r(G, M, K), r(G, N, K).transpose(-2, -1), None),
        "contraction grouped (2d x 2d)": (r(K, M).t(), r(N, K).t(), torch.tensor([4, 12, K], dtype=torch.int32)),
        "columns grouped (3d x 2d)": (r(G, M, K), r(N, K).t(), torch.tensor([2, 5, N], dtype=torch.int32)),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_forward_and_backward_match_the_cpu(name):
    a, b, offs = _cases()[name]
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = torch._grouped_mm(a1, b1, offs=offs)
    ref.float().square().sum().backward()
    a2, b2 = a.to("tpu").requires_grad_(), b.to("tpu").requires_grad_()
    got = torch._grouped_mm(a2, b2, offs=None if offs is None else offs.to("tpu"))
    got.float().square().sum().backward()
    torch.testing.assert_close(got.float().cpu(), ref.float(), **TOL)
    torch.testing.assert_close(a2.grad.float().cpu(), a1.grad.float(), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(b2.grad.float().cpu(), b1.grad.float(), rtol=5e-2, atol=5e-2)


def test_rows_past_the_last_group_are_zero_and_a_bad_out_dtype_raises_as_in_pytorch():
    a, b, _ = _cases()["rows grouped (2d x 3d)"]
    offs = torch.tensor([3, 9, 12], dtype=torch.int32, device="tpu")
    got = torch._grouped_mm(a.to("tpu"), b.to("tpu"), offs=offs)
    assert torch.equal(got[12:].float().cpu(), torch.zeros(M - 12, N))
    ref = torch.cat([a[0:3].float() @ b[0].float(), a[3:9].float() @ b[1].float(), a[9:12].float() @ b[2].float()])
    torch.testing.assert_close(got[:12].float().cpu(), ref, **TOL)
    with pytest.raises(RuntimeError, match="output dtype must match"):
        torch._grouped_mm(a.to("tpu"), b.to("tpu"), offs=offs, out_dtype=torch.float32)


def test_compiled_moe_layer_is_one_replayable_program():
    n = len(torch_tpu.compiled_graphs())

    def experts(x, w, offs):
        return torch.nn.functional.silu(torch._grouped_mm(x, w, offs=offs))

    f = torch.compile(experts, backend="tpu")
    a, b, offs = _cases()["rows grouped (2d x 3d)"]
    for i in range(3):
        got = f((a + i).to("tpu"), b.to("tpu"), offs.to("tpu"))
        torch.testing.assert_close(got.float().cpu(), experts(a + i, b, offs).float(), **TOL)
    g = torch_tpu.compiled_graphs()[n:]
    assert g and g[0]["replays"] == 2, g
