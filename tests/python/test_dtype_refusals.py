"""Dtypes PyTorch's kernels refuse are refused on tpu too (issue 3/7, finding 1).

The CPU's kernels raise for dtypes they have no code for ("\"addmm_impl_cpu_\" not implemented
for 'Bool'"); tpu's lowerings would compute something, or crash in the compiler. The table
torch_tpu/_dtype_rejections.json (tools/dtype_rejections.py) makes tpu raise the same, in every
mode. The walk over every OpInfo variant and every dtype neither its CPU nor its CUDA OpInfo
declares is the slow test here."""

import json
import os
import subprocess
import sys

import pytest
import torch

import torch_tpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "dtype_rejections.py")
TABLE = os.path.join(ROOT, "torch_tpu", "_dtype_rejections.json")


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_the_issue_examples_raise_as_on_the_cpu(mode):
    cases = [
        lambda d: torch.softmax(torch.arange(3, device=d), 0),
        lambda d: torch.log_softmax(torch.arange(3, device=d), 0),
        lambda d: torch.clamp(torch.tensor([1 + 2j, 3 - 1j], device=d), 0, 1),
        lambda d: torch.ones(2, 2, dtype=torch.bool, device=d) @ torch.ones(2, 2, dtype=torch.bool, device=d),
        lambda d: torch.bmm(torch.ones(1, 2, 2, dtype=torch.bool, device=d),
                            torch.ones(1, 2, 2, dtype=torch.bool, device=d)),
        lambda d: torch.cdist(torch.ones(1, 3, 2, dtype=torch.bfloat16, device=d),
                              torch.ones(1, 4, 2, dtype=torch.bfloat16, device=d)),
        lambda d: torch.fmod(torch.ones(3, dtype=torch.complex64, device=d), 2),
        lambda d: torch.remainder(torch.ones(3, dtype=torch.complex64, device=d), 2),
        lambda d: torch.floor_divide(torch.ones(3, dtype=torch.complex64, device=d), 2),
        lambda d: torch.div(torch.ones(3, dtype=torch.complex64, device=d), 2, rounding_mode="floor"),
        lambda d: 2 % torch.ones(3, dtype=torch.complex64, device=d),
        lambda d: torch.arange(3, dtype=torch.bool, device=d),
        lambda d: torch.bincount(torch.ones(3, device=d)),
        # The CPU refuses inside max_pool1d's own code (no ATen op); tpu, like CUDA, receives
        # max_pool2d_with_indices, which the CPU computes for integers.
        lambda d: torch.nn.functional.max_pool1d(torch.ones(1, 2, 4, dtype=torch.int32, device=d), 2),
        # cummax's composite calls a helper with the outputs as arguments.
        lambda d: torch.cummax(torch.ones(3, dtype=torch.complex64, device=d), 0),
        lambda d: torch.cummin(torch.ones(3, dtype=torch.complex64, device=d), 0),
        # Refused for the "mean" reduction only.
        lambda d: torch.zeros(3, dtype=torch.bool, device=d).scatter_reduce(
            0, torch.tensor([0, 1, 1], device=d), torch.ones(3, dtype=torch.bool, device=d), "mean"),
        # The CPU's dropout refuses in bernoulli_; tpu and CUDA call native_dropout.
        lambda d: torch.nn.functional.dropout(torch.ones(3, dtype=torch.complex64, device=d), 0.5),
        # random_'s bounds: outside the dtype, from >= to, a complex tensor.
        lambda d: torch.randint_like(torch.ones(3, dtype=torch.bool, device=d), 10),
        lambda d: torch.randint(0, 300, (3,), dtype=torch.uint8, device=d),
        lambda d: torch.empty(3, dtype=torch.int8, device=d).random_(-200, 3),
        lambda d: torch.empty(3, dtype=torch.int32, device=d).random_(5, 5),
        lambda d: torch.randint_like(torch.ones(3, dtype=torch.complex64, device=d), 10),
    ]
    previous = torch_tpu.get_mode()
    torch_tpu.set_mode(mode)
    try:
        for i, case in enumerate(cases):
            with pytest.raises(Exception) as cpu:
                case("cpu")
            with pytest.raises(type(cpu.value)) as on_tpu:
                case("tpu")
                torch.tpu.synchronize()
            dtype_word = str(cpu.value).split("'")[-2] if "'" in str(cpu.value) else ""
            assert dtype_word in str(on_tpu.value), (i, str(cpu.value), str(on_tpu.value))
    finally:
        torch_tpu.set_mode(previous)
    # What the CPU computes still computes.
    x = torch.arange(3.0, device="tpu")
    torch.testing.assert_close(torch.softmax(x, 0).cpu(), torch.softmax(torch.arange(3.0), 0))
    assert torch.fmod(torch.arange(5, device="tpu"), 2).cpu().tolist() == [0, 1, 0, 1, 0]


def test_a_guarded_composite_still_computes_and_differentiates():
    """max_pool1d refuses integers through a guard at its autograd and backend keys; floats
    still decompose as before: gradients, inference mode and torch.compile equal the CPU."""
    x = torch.randn(1, 2, 7, requires_grad=True)
    t = x.detach().to("tpu").requires_grad_()
    torch.nn.functional.max_pool1d(x, 3).sum().backward()
    torch.nn.functional.max_pool1d(t, 3).sum().backward()
    assert torch.equal(t.grad.cpu(), x.grad)
    with torch.inference_mode():
        assert torch.equal(torch.nn.functional.max_pool1d(t, 2).cpu(), torch.nn.functional.max_pool1d(x, 2))
        with pytest.raises(NotImplementedError, match="'Int'"):
            torch.nn.functional.max_pool1d(torch.ones(1, 2, 4, dtype=torch.int32, device="tpu"), 2)
    f = torch.compile(lambda a: torch.nn.functional.max_pool1d(a, 2) * 2, backend="tpu")
    assert torch.equal(f(t.detach()).cpu(), torch.nn.functional.max_pool1d(x.detach(), 2) * 2)
    # What the CPU computes with integers, tpu computes: max_pool2d, max_pool1d with indices.
    xi = torch.arange(8, dtype=torch.int32).reshape(1, 2, 4)
    assert torch.equal(torch.nn.functional.max_pool2d(xi.to("tpu"), (1, 2)).cpu(),
                       torch.nn.functional.max_pool2d(xi, (1, 2)))
    assert torch.equal(torch.nn.functional.max_pool1d(xi.to("tpu"), 2, return_indices=True)[1].cpu(),
                       torch.nn.functional.max_pool1d(xi, 2, return_indices=True)[1])


def test_random_bounds_are_checked_per_call():
    """A program is cached per signature: the bounds are checked on every call, not only when
    the program is built."""
    e = torch.empty(4, dtype=torch.bool, device="tpu")
    assert set(e.random_(0, 2).cpu().tolist()) <= {False, True}
    with pytest.raises(RuntimeError, match="to - 1 is out of bounds for bool"):
        e.random_(0, 3)
    z = torch.empty(1000, dtype=torch.int64, device="tpu").random_(-5, 5).cpu()
    assert z.min() >= -5 and z.max() <= 4


def test_compiled_graphs_refuse_too():
    f = torch.compile(lambda t: torch.softmax(t, 0) * 2, backend="tpu")
    with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        f(torch.arange(3, device="tpu"))
    torch.testing.assert_close(f(torch.arange(3.0, device="tpu")).cpu(), torch.softmax(torch.arange(3.0), 0) * 2)


def test_an_unreadable_table_warns_and_imports(tmp_path):
    code = ("import warnings, json, torch_tpu, os\n"
            "p = os.path.join(os.path.dirname(torch_tpu.__file__), '_dtype_rejections.json')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # A copy of the package whose table is corrupt: the import warns, ops still run.
    import shutil

    pkg = os.path.dirname(torch_tpu.__file__)
    shutil.copytree(pkg, tmp_path / "torch_tpu", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "torch_tpu" / "_dtype_rejections.json").write_text("{not json")
    r = subprocess.run([sys.executable, "-W", "always", "-c", code + "import torch\n"
                        "print(torch.softmax(torch.arange(3., device='tpu'), 0).sum().item())"],
                       capture_output=True, text=True, env=env, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "could not be read" in r.stderr and "1.0" in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
def test_the_table_is_what_the_tool_writes(tmp_path):
    """The committed table matches this torch's kernels (rewrite it after a torch upgrade)."""
    out = tmp_path / "table.json"
    r = subprocess.run([sys.executable, TOOL, "--write", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    fresh, committed = json.load(open(out)), json.load(open(TABLE))
    if fresh["torch"] != committed["torch"]:
        pytest.skip(f"the table was written for torch {committed['torch']}, this is {fresh['torch']}")
    assert fresh["rejections"] == committed["rejections"], (
        "torch_tpu/_dtype_rejections.json is stale: run python tools/dtype_rejections.py --write "
        "torch_tpu/_dtype_rejections.json")


@pytest.mark.slow
def test_every_opinfo_dtype_both_cpu_and_cuda_refuse_is_refused_on_tpu(tmp_path):
    """Every OpInfo variant, every tpu dtype neither its CPU nor its CUDA OpInfo declares, up to
    4 samples each: where the CPU raises, tpu must raise the same exception type; none is let
    through (at 747e6e6, 10 units were). Units run in worker processes, so a
    crash is counted, not fatal."""
    report_path = tmp_path / "report.json"
    r = subprocess.run([sys.executable, TOOL, "--check", "--workers", "2", "--out", str(report_path)],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert report_path.exists(), r.stdout[-2000:] + r.stderr[-3000:]
    report = json.load(open(report_path))
    bad = {k: (v["status"], v.get("message", "")) for k, v in report["results"].items()
           if v["status"] in ("silent", "crash", "raised_other")}
    assert not bad, f"{len(bad)} units where tpu does not raise as the CPU does: {json.dumps(bad, indent=1)[:6000]}"
    assert report["counts"].get("raised", 0) > 1000, report["counts"]


def test_a_dtype_argument_is_not_a_tensor_of_that_dtype():
    # The CPU sums a bool tensor cumulatively in int64 (Hugging Face masks do) but has no bool
    # kernel for dtype=torch.bool: the table must not merge the two.
    x = torch.tensor([True, False, True])
    t = x.to("tpu")
    assert t.cumsum(0).cpu().tolist() == x.cumsum(0).tolist() and t.cumsum(0).dtype == torch.int64
    with pytest.raises(NotImplementedError, match="cumsum_out_cpu"):
        x.cumsum(0, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="cumsum_out_cpu"):
        t.cumsum(0, dtype=torch.bool)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_what_the_cpu_refuses_and_cuda_computes_is_computed_as_cuda_does(mode):
    # The table's "beyond" rows (issue 2/6, class 10): the CPU raises, CUDA's kernel computes, so
    # tpu computes CUDA's result (each checked here against what that kernel does, computed on
    # the CPU through a dtype it takes).
    b = torch.tensor([[True, False, True], [False, True, True], [True, True, False]])
    ints = torch.tensor([0, 3, 3, 7, 9, 1, 4])
    x16 = torch.tensor([-2.0, -0.5, 0.0, 1.5, 3.0], dtype=torch.float16)
    with torch_tpu.mode(mode):
        tb = b.to("tpu")
        assert torch.equal(torch.abs(tb).cpu(), b)  # abs_cuda: the identity on bool
        torch.testing.assert_close(torch.nn.functional.softsign(tb).cpu(), b / (1 + b.long()))
        got = torch.trace(tb).cpu()  # trace_cuda: the diagonal's sum, int64 for bool
        assert got.dtype == torch.int64 and got.item() == 2
        torch.testing.assert_close(torch.histc(ints.to("tpu"), bins=5, min=0, max=10).cpu(),
                                   torch.histc(ints.float(), bins=5, min=0, max=10).to(torch.int64))
        got = torch.nn.functional.rrelu(x16.to("tpu"), training=False).cpu()  # eval: the mean slope
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, torch.nn.functional.rrelu(x16.float(), training=False).half())


@pytest.mark.parametrize("op", ["pixel_shuffle", "pixel_unshuffle"])
def test_an_explicit_composite_refuses_as_the_cpu_does(op):
    # pixel_shuffle's math kernel (tpu's path) computes every dtype; the CPU's own kernel has no
    # uint16 code. The refusal row is checked before the composite runs.
    x = torch.arange(16).reshape(1, 4, 2, 2).to(torch.uint16)
    for device in ("cpu", "tpu"):
        with pytest.raises(NotImplementedError, match="UInt16"):
            getattr(torch, op)(x.to(device), 2)
    check = torch.arange(16.0).reshape(1, 4, 2, 2)
    torch.testing.assert_close(getattr(torch, op)(check.to("tpu"), 2).cpu(), getattr(torch, op)(check, 2))
