"""Views share storage: a write through any view is seen by its base and every
other alias, exactly as on the CPU. Each case runs the same program on cpu
and tpu and compares every tensor involved."""

import pytest
import torch

import torch_tpu

# Both modes in the gate; CPU fallback an error (conftest.py).
pytestmark = [pytest.mark.mode_dependent, pytest.mark.usefixtures("fallback_error")]


def both(program):
    """Runs program(device) -> list of tensors on cpu and tpu; compares."""
    ref = program("cpu")
    out = program("tpu")
    assert len(ref) == len(out)
    for r, o in zip(ref, out):
        assert o.device.type == "tpu"
        assert o.shape == r.shape and o.stride() == r.stride() and o.storage_offset() == r.storage_offset()
        torch.testing.assert_close(o.cpu(), r)


def base(dev, shape=(4, 6), dtype=torch.float32):
    return torch.arange(int(torch.tensor(shape).prod()), dtype=dtype, device=dev).reshape(shape)


VIEWS = {
    "view": lambda t: t.view(6, 4),
    "reshape": lambda t: t.reshape(2, 12),
    "permute": lambda t: t.permute(1, 0),
    "transpose": lambda t: t.transpose(0, 1),
    "t": lambda t: t.t(),
    "narrow": lambda t: t.narrow(1, 2, 3),
    "slice_step": lambda t: t[::2, 1::2],
    "select": lambda t: t[2],
    "select_col": lambda t: t[:, 3],
    "expand": lambda t: t[:1].expand(3, 6),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "squeeze": lambda t: t[:1].squeeze(0),
    "diagonal": lambda t: t.diagonal(),
    "diagonal_offset": lambda t: t.diagonal(1),
    "as_strided": lambda t: t.as_strided((3, 3), (5, 1), 2),
    "unfold": lambda t: t.unfold(1, 3, 2),
    "split": lambda t: t.split(2, dim=1)[1],
    "chunk": lambda t: t.chunk(2)[1],
    "unbind": lambda t: t.unbind(1)[4],
    "flatten": lambda t: t.flatten(),
    "view_as_transpose_of_slice": lambda t: t[1:, 2:].t(),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_read(name):
    both(lambda dev: [VIEWS[name](base(dev)) * 1.0, VIEWS[name](base(dev)).contiguous()])


# expand and unfold alias elements with themselves: writes through them are
# undefined (PyTorch refuses most of them).
@pytest.mark.parametrize("name", sorted(v for v in VIEWS if v not in ("expand", "unfold")))
def test_write_through_view_is_seen_by_base(name):
    def program(dev):
        b = base(dev)
        v = VIEWS[name](b)
        v.mul_(-1)
        v.add_(0.5)
        return [b, v]

    both(program)


def test_write_through_one_view_seen_by_another():
    def program(dev):
        b = base(dev)
        rows = b[1:3]
        cols = b[:, 2]
        rows.fill_(7)
        cols.copy_(torch.arange(4.0, device=dev))
        return [b, rows, cols]

    both(program)


def test_inplace_on_base_seen_by_views():
    def program(dev):
        b = base(dev)
        v = b.t()[1:4]
        b.zero_()
        b[0, 0] = 3
        return [b, v]

    both(program)


def test_setitem_variants():
    def program(dev):
        b = base(dev)
        b[1] = 5
        b[:, 1] = torch.tensor([1.0, 2.0, 3.0, 4.0], device=dev)
        b[2:, ::2] += 100
        b[b > 110] = 0
        b[torch.tensor([0, 3], device=dev)] *= 2
        return [b]

    both(program)


def test_copy_between_views_and_dtypes():
    def program(dev):
        a = base(dev)
        c = torch.zeros(6, 4, dtype=torch.float64, device=dev)
        c.t().copy_(a)              # into a transposed view, with dtype conversion
        d = torch.zeros(3, 6, dtype=torch.int32, device=dev)
        d.copy_(a[0])                # broadcast source
        return [c, d]

    both(program)


def test_cpu_tpu_copies_with_noncontiguous_sources_and_targets():
    a = torch.arange(24.0).reshape(4, 6)
    t = a.t().to("tpu")                     # non-contiguous source from cpu; strides preserved
    assert t.stride() == a.t().stride() and torch.equal(t.cpu(), a.t())
    dst = torch.zeros(6, 4, device="tpu")
    dst[:, 1::2] = a.t()[:, 1::2]           # cpu -> tpu into a strided view
    ref = torch.zeros(6, 4)
    ref[:, 1::2] = a.t()[:, 1::2]
    assert torch.equal(dst.cpu(), ref)
    out = torch.empty(4, 6).t()             # tpu -> strided cpu target
    out.copy_(t)
    assert torch.equal(out, a.t())


def test_storage_sharing_and_data_ptr():
    b = torch.zeros(4, 6, device="tpu")
    v = b[1:]
    assert v.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert v._base is b


def test_view_dtype_reinterprets_bytes():
    def program(dev):
        a = torch.tensor([1.0, -2.0, 0.5], device=dev)
        i = a.view(torch.int32)
        i.add_(1)
        return [a, i, a.view(torch.uint8)]

    both(program)


def test_resize_and_set():
    t = torch.arange(6.0, device="tpu")
    t.resize_(2, 3)
    assert t.shape == (2, 3) and torch.equal(t.cpu(), torch.arange(6.0).reshape(2, 3))
    t.resize_(4, 3)
    assert t.shape == (4, 3) and torch.equal(t.cpu()[:2], torch.arange(6.0).reshape(2, 3))
    u = torch.empty(0, device="tpu")
    u.set_(t)
    assert u.shape == t.shape and u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    s = torch.empty(0, device="tpu")
    s.set_(t.untyped_storage(), 3, (3,), (1,))
    assert torch.equal(s.cpu(), torch.tensor([3.0, 4.0, 5.0]))


def test_storage_resize_bytes_frees_and_regrows():
    # FSDP2 frees parameters this way.
    p = torch.randn(16, device="tpu")
    before = torch.tpu.memory_allocated()
    p.untyped_storage().resize_(0)
    assert torch.tpu.memory_allocated() == before - 64
    p.untyped_storage().resize_(64)
    p.copy_(torch.ones(16))
    assert torch.equal(p.cpu(), torch.ones(16))


def test_empty_is_lazy_and_cheap():
    before = torch.tpu.memory_allocated()
    big = torch.empty(1 << 28, dtype=torch.float16, device="tpu")  # 512 MiB, not touched
    assert torch.tpu.memory_allocated() - before == (1 << 29)
    del big
    assert torch.tpu.memory_allocated() == before


def test_strict_fills_take_one_program_and_read_no_buffer():
    # fill_ and zero_ read only their argument's shape: the program takes no buffer
    # for it, so an unwritten tensor is not first filled with zeros (a second
    # program) and a view is not gathered before it is overwritten. A whole small
    # tensor's fill is an upload of its value instead of a program (no compile per
    # shape: dispatch/dispatcher.cpp, fillWhole). A fill's result is kept: the same
    # fill again takes no launch or transfer once nothing holds the kept result,
    # one while something does.
    def work():
        m = torch_tpu.metrics()
        return m["executions"] + m["h2d_transfers"]

    def count(fn):
        held = fn()
        torch.tpu.synchronize()
        before = work()
        out = fn()
        torch.tpu.synchronize()
        n_held = work() - before
        del held, out
        before = work()
        out = fn()
        torch.tpu.synchronize()
        return n_held, work() - before, out

    x = torch.randn(16, 24, device="tpu")
    with torch_tpu.mode("strict"):
        for name, fn, want in [
            ("zeros", lambda: torch.zeros(16, 24, device="tpu"), torch.zeros(16, 24)),
            ("ones_like", lambda: torch.ones_like(x), torch.ones(16, 24)),
            ("full", lambda: torch.full((3, 5), 2.5, device="tpu"), torch.full((3, 5), 2.5)),
            ("empty + fill_", lambda: torch.empty(7, device="tpu", dtype=torch.int64).fill_(9),
             torch.full((7,), 9, dtype=torch.int64)),
            ("0-d ones", lambda: torch.ones((), device="tpu"), torch.ones(())),
        ]:
            n_held, n_free, out = count(fn)
            assert (n_held, n_free) == (1, 0), (name, n_held, n_free)
            torch.testing.assert_close(out.cpu(), want)
        # A column is written back into its storage (one program), but not read
        # first; the column's fill is the kept result.
        n_held, n_free, _ = count(lambda: x[:, 1].fill_(3.0))
        assert (n_held, n_free) == (1, 1), (n_held, n_free)
        torch.testing.assert_close(x[:, 1].cpu(), torch.full((16,), 3.0))


@pytest.mark.parametrize("case", ["column", "transposed row", "rows by tensor", "whole", "zero whole"])
def test_fills_through_views_match_cpu(case):
    fills = {
        "column": lambda t: t[:, 1].fill_(3.0),
        "transposed row": lambda t: t.t()[2].zero_(),
        "rows by tensor": lambda t: t[1:3].fill_(torch.tensor(2.5)),
        "whole": lambda t: t.fill_(7),
        "zero whole": lambda t: t.zero_(),
    }

    def program(dev):
        b = base(dev)
        v = fills[case](b)
        return [b, v]

    both(program)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool])
def test_fills_of_contiguous_ranges_share_one_program(dtype):
    # x[a:b].fill_(v) / zero_() on one contiguous run of a larger tensor: the
    # range and value are arguments of one program per tensor size, so new
    # lengths (a serving step's padded tail) compile nothing.
    value = True if dtype == torch.bool else 3
    host = torch.ones(40, 8, dtype=dtype)
    dev = host.to("tpu")
    flat = dev.view(-1)
    with torch_tpu.mode("strict"):
        for i, (a, b) in enumerate([(0, 5), (5, 17), (100, 320), (319, 320), (1, 2), (7, 300)]):
            for t in (host.view(-1), flat):
                if i % 2:
                    t[a:b].zero_()
                else:
                    t[a:b].fill_(value)
            if i == 0:
                torch.tpu.synchronize()
                compiles = torch_tpu.metrics()["compiles"]
        dev[3:9].fill_(value)  # rows of a 2-d tensor: one run too
        host[3:9].fill_(value)
        torch.tpu.synchronize()
        assert torch_tpu.metrics()["compiles"] == compiles
    torch.testing.assert_close(dev.cpu(), host)


def test_range_fill_refuses_what_the_cpu_refuses():
    for dev in ("cpu", "tpu"):
        t = torch.zeros(16, dtype=torch.uint8, device=dev)
        with pytest.raises(RuntimeError, match="overflow"):
            t[2:5].fill_(300)


def test_stepped_views_read_as_boxes_match_cpu():
    # Untransposed stepped views are read as a slice of their padded memory
    # window; the window may run past the end of the storage.
    base = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6)
    t = base.to("tpu")
    for view in (lambda x: x[:, :, 5], lambda x: x[:, ::2, 1::2], lambda x: x[1:, 1::3, ::5],
                 lambda x: x.reshape(12, 6)[::4, 3:]):
        torch.testing.assert_close(view(t).cpu(), view(base))
        torch.testing.assert_close((view(t) * 2).cpu(), view(base) * 2)
