"""Ops added for OpInfo coverage (unique, mode, distances, sampling, unpooling, random
distributions, group norm, transposed-convolution gradients) against the CPU, with the
CPU fallback forbidden; and their failure paths."""

import pytest
import torch
import torch.nn.functional as F

import torch_tpu
from conftest import assert_tpu_close

# Both modes in the gate; CPU fallback an error (conftest.py).
pytestmark = [pytest.mark.mode_dependent, pytest.mark.usefixtures("fallback_error")]


def tpu(t):
    return t.to("tpu")


def close(out, ref, **tol):
    assert_tpu_close(out, ref, equal_nan=True, **tol)


def test_unique_family_lengths_come_from_the_device():
    x = torch.tensor([3.0, 1.0, float("nan"), 3.0, 2.0, float("nan"), 1.0])
    for sorted_ in (True, False):
        close(torch._unique2(tpu(x), sorted=sorted_, return_inverse=True, return_counts=True),
              torch._unique2(x, sorted=sorted_, return_inverse=True, return_counts=True))
    close(torch.unique(tpu(x > 2)), torch.unique(x > 2))
    y = torch.tensor([1, 1, 2, 2, 3, 1, 1, 2])
    close(torch.unique_consecutive(tpu(y), return_inverse=True, return_counts=True),
          torch.unique_consecutive(y, return_inverse=True, return_counts=True))
    empty = torch.tensor([], dtype=torch.int64)
    close(torch.unique(tpu(empty), return_counts=True), torch.unique(empty, return_counts=True))


def test_nonzero_static_pads_and_truncates():
    x = torch.tensor([[0, 1, 0], [2, 0, 3]])
    for size in (2, 5):
        close(torch.nonzero_static(tpu(x), size=size, fill_value=-7),
              torch.nonzero_static(x, size=size, fill_value=-7))


def test_repeat_interleave_and_its_negative_repeats_error():
    r = torch.tensor([2, 0, 3])
    close(torch.repeat_interleave(tpu(r)), torch.repeat_interleave(r))
    x = torch.arange(6.0).reshape(3, 2)
    close(tpu(x).repeat_interleave(tpu(r), dim=0), x.repeat_interleave(r, dim=0))
    with pytest.raises(RuntimeError, match="negative"):
        torch.repeat_interleave(tpu(torch.tensor([1, -1])))


def test_mode_picks_the_smallest_most_frequent_value():
    x = torch.tensor([[1.0, 2, 2, 3], [3, 3, 1, 1], [5, 4, 4, 5]])
    close(torch.mode(tpu(x), 1), torch.mode(x, 1))
    close(torch.mode(tpu(x), 0, keepdim=True), torch.mode(x, 0, keepdim=True))


def test_equal_compares_on_the_device_and_rejects_mixed_devices():
    a = torch.tensor([1.0, 2.0])
    assert torch.equal(tpu(a), tpu(a.long()))
    assert not torch.equal(tpu(a), tpu(torch.tensor([1.0, 3.0])))
    assert not torch.equal(tpu(a), tpu(a[:1]))
    assert not torch.equal(tpu(torch.tensor([float("nan")])), tpu(torch.tensor([float("nan")])))
    with pytest.raises(RuntimeError, match="different devices"):
        torch.equal(tpu(a), a)


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 3.5, float("inf")])
def test_cdist_and_pdist_with_gradients(p):
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(2, 4, 3, generator=g)
    x2 = torch.randn(2, 5, 3, generator=g)
    close(torch.cdist(tpu(x1), tpu(x2), p=p), torch.cdist(x1, x2, p=p))
    a, b = x1.clone().requires_grad_(), tpu(x1).requires_grad_()
    torch.cdist(a, x2, p=p).sum().backward()
    torch.cdist(b, tpu(x2), p=p).sum().backward()
    close(b.grad, a.grad, atol=1e-5, rtol=1e-4)
    m = torch.randn(5, 3, generator=g)
    a, b = m.clone().requires_grad_(), tpu(m).requires_grad_()
    F.pdist(a, p=p).sum().backward()
    F.pdist(b, p=p).sum().backward()
    close(F.pdist(tpu(m), p=p), F.pdist(m, p=p))
    close(b.grad, a.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_values_and_gradients(mode, padding_mode):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 6, generator=g)
    grid = torch.rand(2, 4, 7, 2, generator=g) * 2.4 - 1.2  # some points outside
    for align in (False, True):
        a, ga = x.clone().requires_grad_(), grid.clone().requires_grad_()
        b, gb = tpu(x).requires_grad_(), tpu(grid).requires_grad_()
        ra = F.grid_sample(a, ga, mode=mode, padding_mode=padding_mode, align_corners=align)
        rb = F.grid_sample(b, gb, mode=mode, padding_mode=padding_mode, align_corners=align)
        close(rb, ra.detach())
        (ra * ra).sum().backward()
        (rb * rb).sum().backward()
        close(b.grad, a.grad, atol=1e-5, rtol=1e-4)
        close(gb.grad, ga.grad, atol=1e-4, rtol=1e-4)


def test_max_unpool_and_its_out_of_range_index_error():
    x = torch.randn(1, 2, 4, 4)
    out, idx = F.max_pool2d(x, 2, return_indices=True)
    close(F.max_unpool2d(tpu(out), tpu(idx), 2), F.max_unpool2d(out, idx, 2))
    bad = idx.clone()
    bad[0, 0, 0, 0] = 99
    with pytest.raises(IndexError, match="max_unpool2d"):
        F.max_unpool2d(tpu(out), tpu(bad), 2).cpu()


def test_bicubic_and_adaptive_pool3d_with_gradients():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 5, 6, generator=g)
    for align in (False, True):
        a, b = x.clone().requires_grad_(), tpu(x).requires_grad_()
        ra = F.interpolate(a, size=(7, 4), mode="bicubic", align_corners=align)
        rb = F.interpolate(b, size=(7, 4), mode="bicubic", align_corners=align)
        close(rb, ra.detach())
        ra.square().sum().backward()
        rb.square().sum().backward()
        close(b.grad, a.grad, atol=1e-5, rtol=1e-4)
    v = torch.randn(2, 3, 5, 6, 7, generator=g)
    close(F.adaptive_avg_pool3d(tpu(v), (2, 3, 4)), F.adaptive_avg_pool3d(v, (2, 3, 4)))


def test_group_norm_and_transposed_conv_gradients():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 4, 5, generator=g)
    gn_cpu = torch.nn.GroupNorm(3, 6)
    gn_tpu = torch.nn.GroupNorm(3, 6).to("tpu")
    gn_tpu.load_state_dict(gn_cpu.state_dict())
    a, b = x.clone().requires_grad_(), tpu(x).requires_grad_()
    gn_cpu(a).square().sum().backward()
    gn_tpu(b).square().sum().backward()
    close(b.grad, a.grad, atol=1e-4, rtol=1e-4)
    close(gn_tpu.weight.grad, gn_cpu.weight.grad, atol=1e-4, rtol=1e-4)
    w = torch.randn(6, 2, 3, 3, generator=g)
    a, b = x.clone().requires_grad_(), tpu(x).requires_grad_()
    wa, wb = w.clone().requires_grad_(), tpu(w).requires_grad_()
    F.conv_transpose2d(a, wa, stride=2, padding=1, output_padding=1, groups=2).square().sum().backward()
    F.conv_transpose2d(b, wb, stride=2, padding=1, output_padding=1, groups=2).square().sum().backward()
    close(b.grad, a.grad, atol=1e-4, rtol=1e-4)
    close(wb.grad, wa.grad, atol=1e-4, rtol=1e-4)


def test_random_distributions_have_the_right_moments():
    torch.manual_seed(0)
    x = torch.empty(200_000, device="tpu")
    assert abs(x.cauchy_(1.0, 2.0).cpu().median().item() - 1.0) < 0.05
    logs = x.log_normal_(0.5, 0.25).cpu().log()
    assert abs(logs.mean().item() - 0.5) < 0.01 and abs(logs.std().item() - 0.25) < 0.01
    geo = x.geometric_(0.3).cpu()
    assert geo.min().item() == 1 and abs(geo.mean().item() - 1 / 0.3) < 0.05
    p = torch.tensor([0.1, 0.0, 0.6, 0.3], device="tpu")
    freq = torch.bincount(torch.multinomial(p, 100_000, replacement=True).cpu(), minlength=4) / 1e5
    torch.testing.assert_close(freq, p.cpu(), atol=0.01, rtol=0)
    draws = torch.multinomial(p.expand(1000, 4).contiguous(), 3).cpu()
    assert (draws != 1).all()  # a zero-probability category is never drawn without replacement
    assert all(len(set(r.tolist())) == 3 for r in draws)
    a = torch.randn(1000, device="tpu")
    noise = torch.empty(1000, device="tpu")
    out = torch.ops.aten.rrelu_with_noise(a, noise, 0.1, 0.3, True)
    neg = a.cpu() < 0
    assert noise.cpu()[neg].min() >= 0.1 and noise.cpu()[neg].max() <= 0.3
    assert (noise.cpu()[~neg] == 1).all()
    torch.testing.assert_close(out.cpu(), a.cpu() * noise.cpu())


def test_eval_batch_norm_statistics_are_empty_like_the_cpu():
    x, rm, rv = torch.randn(3, 2, 4), torch.zeros(2), torch.ones(2)
    ref = torch.native_batch_norm(x, None, None, rm, rv, False, 0.1, 1e-5)
    out = torch.native_batch_norm(tpu(x), None, None, tpu(rm), tpu(rv), False, 0.1, 1e-5)
    assert [t.shape for t in out] == [t.shape for t in ref]
    close(out[0], ref[0])


def test_sum_with_dim_none_keeps_dims():
    m = torch.ones(2, 3, 4, dtype=torch.bool)
    close(torch.sum(tpu(m), dim=None, keepdim=True), torch.sum(m, dim=None, keepdim=True))


def test_bincount_gcd_lcm_and_bincount_errors():
    x = torch.tensor([1, 3, 3, 0, 7])
    for w in (None, torch.tensor([0.5, 1.0, 2.0, 1.0, 3.0]), torch.tensor([1, 2, 3, 4, 5])):
        ref = torch.bincount(x, w, minlength=10)
        out = torch.bincount(tpu(x), None if w is None else tpu(w), minlength=10)
        assert out.dtype == ref.dtype
        close(out, ref)
    close(torch.bincount(tpu(torch.tensor([], dtype=torch.int64)), minlength=3),
          torch.bincount(torch.tensor([], dtype=torch.int64), minlength=3))
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(tpu(torch.tensor([-1, 2])))
    a = torch.tensor([0, 12, -18, 7, 0, 2**40])
    b = torch.tensor([0, 8, 12, -21, 5, 6])
    close(torch.gcd(tpu(a), tpu(b)), torch.gcd(a, b))
    close(torch.lcm(tpu(a), tpu(b)), torch.lcm(a, b))


@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_forward_and_gradients(dim):
    # nn.utils.parametrizations.weight_norm (wav2vec2's positional convolution) lowers
    # _weight_norm_interface and its backward.
    torch.manual_seed(0)
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 6, 3), dim=dim)
    x = torch.randn(2, 4, 9)
    dev = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 6, 3), dim=dim).to("tpu")
    dev.load_state_dict(conv.state_dict())
    conv(x).square().sum().backward()
    out = dev(tpu(x))
    out.square().sum().backward()
    close(out, conv(x).detach())
    for p, q in zip(conv.parameters(), dev.parameters()):
        close(q.grad, p.grad)


def test_histc_counts_integer_inputs_like_cuda():
    # MoE routers (transformers' grouped experts) count expert ids with histc on int32
    # off the CPU; values outside [min, max] are dropped, max falls in the last bin.
    ids = torch.tensor([3, 0, 2, 2, 7, 3, 3, 9, -1], dtype=torch.int32)
    out = torch.histc(tpu(ids), bins=4, min=0, max=3)
    assert out.dtype == torch.int32
    assert out.cpu().tolist() == [1, 0, 2, 3]
    close(torch.histc(tpu(ids.float()), bins=5, min=0, max=0),
          torch.histc(ids.float(), bins=5, min=0, max=0))


@pytest.mark.parametrize("make", [
    lambda: torch.nn.LSTM(5, 7, num_layers=2, batch_first=True),
    lambda: torch.nn.LSTM(5, 7, bidirectional=True, bias=False),
    lambda: torch.nn.GRU(5, 7, num_layers=2),
    lambda: torch.nn.GRU(5, 7, bias=False),
    lambda: torch.nn.LSTMCell(5, 7),
    lambda: torch.nn.GRUCell(5, 7),
], ids=["lstm", "lstm-bidir-nobias", "gru", "gru-nobias", "lstm-cell", "gru-cell"])
def test_recurrent_layers_forward_and_gradients(make):
    # Off the CPU, PyTorch runs every time step through the fused cell ops
    # (_thnn_fused_lstm_cell / _thnn_fused_gru_cell), which have no CPU kernel to fall back to.
    torch.manual_seed(0)
    cpu = make()
    dev = make().to("tpu")
    dev.load_state_dict(cpu.state_dict())
    cell = isinstance(cpu, (torch.nn.LSTMCell, torch.nn.GRUCell))
    x = torch.randn(3, 5) if cell else torch.randn(3, 4, 5)

    def flat(o):
        return [t for e in o for t in flat(e)] if isinstance(o, tuple) else [o]

    ref, out = flat(cpu(x)), flat(dev(tpu(x)))
    sum(t.square().sum() for t in ref).backward()
    sum(t.square().sum() for t in out).backward()
    close(out, [t.detach() for t in ref])
    for p, q in zip(cpu.parameters(), dev.parameters()):
        close(q.grad, p.grad)


def test_fused_lstm_cell_rejects_mismatched_sizes():
    gates, cx = torch.randn(3, 28, device="tpu"), torch.randn(3, 6, device="tpu")  # 28 != 4 * 6
    with pytest.raises(RuntimeError, match="previous state"):
        torch.ops.aten._thnn_fused_lstm_cell(gates, gates, cx)


def test_masked_scatter_values_gradients_and_short_source():
    # Multimodal models splice image/audio features into the text embeddings with it.
    g = torch.Generator().manual_seed(0)
    x, src = torch.randn(3, 4, generator=g), torch.randn(20, generator=g)
    for mask in (torch.rand(3, 4, generator=g) > 0.5, torch.tensor([True, False, True, True])):
        close(tpu(x).masked_scatter(tpu(mask), tpu(src)), x.masked_scatter(mask, src))
        xs, ss = x.clone().requires_grad_(), src.clone().requires_grad_()
        xt, st = tpu(x).requires_grad_(), tpu(src).requires_grad_()
        w = torch.arange(12.0).view(3, 4)
        (xs.masked_scatter(mask, ss) * w).sum().backward()
        (xt.masked_scatter(tpu(mask), st) * tpu(w)).sum().backward()
        close(xt.grad, xs.grad)
        close(st.grad, ss.grad)
    # Fewer source elements than selected positions: the CPU raises RuntimeError at once;
    # the device checks it in the program and raises IndexError at the next host read.
    with pytest.raises(IndexError, match="masked_scatter"):
        tpu(x).masked_scatter(torch.ones(3, 4, dtype=torch.bool, device="tpu"),
                              torch.randn(5, device="tpu")).cpu()
    # An empty source is valid while nothing is selected (a text-only batch of a multimodal
    # model splices in zero image features), an IndexError otherwise.
    nothing = torch.zeros(3, 4, dtype=torch.bool)
    close(tpu(x).masked_scatter(tpu(nothing), torch.zeros(0, device="tpu")), x)
    with pytest.raises(IndexError, match="masked_scatter"):
        tpu(x).masked_scatter(tpu(nothing | (x > 0)), torch.zeros(0, device="tpu")).cpu()


def test_masked_fill_takes_a_cpu_scalar_tensor_value():
    # PyTorch lets a 0-d CPU tensor fill a tensor on an accelerator (SEW-D's attention mask);
    # the meta kernel refused it beside meta tensors.
    x, mask = torch.randn(2, 2, 6, 6), torch.rand(2, 1, 1, 6) > 0.5
    value = torch.tensor(torch.finfo(torch.float32).min)
    close(tpu(x).masked_fill(tpu(mask), value), x.masked_fill(mask, value))
    close(torch.where(tpu(mask), tpu(x), torch.tensor(0.5)), torch.where(mask, x, torch.tensor(0.5)))
