"""The tpu device's PyTorch-facing API: device objects, torch.tpu.*, torch.accelerator,
random-number state, memory statistics, streams/events, serialization, printing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torch_tpu


def _sync():
    torch.tpu.synchronize()


# ------------------------------------------------------------ device objects


def test_device_objects(tpu):
    assert tpu.type == "tpu"
    d0 = torch.device("tpu:0")
    assert d0.type == "tpu" and d0.index == 0
    assert torch.device("tpu", 0) == d0
    x = torch.ones(3, device="tpu")
    assert x.device == d0
    assert x.device.type == "tpu"
    y = torch.ones(3, device=d0)
    assert y.device == d0


def test_to_and_back(tpu):
    c = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = c.to("tpu")
    assert t.device.type == "tpu"
    assert t.shape == c.shape and t.dtype == c.dtype
    torch.testing.assert_close(t.cpu(), c)
    torch.testing.assert_close(c.to(tpu).to("cpu"), c)


def test_tensor_tpu_method_and_is_tpu():
    c = torch.randn(4)
    t = c.tpu()
    assert t.is_tpu
    assert not c.is_tpu
    assert t.device == torch.device("tpu:0")
    torch.testing.assert_close(t.cpu(), c)


def test_module_tpu_method():
    m = torch.nn.Linear(3, 2).tpu()
    assert all(p.device.type == "tpu" for p in m.parameters())


def test_module_to_keeps_tied_weights():
    """nn.Module.to() must keep parameters shared between modules shared (GPT-2 style
    tied embeddings). Module._apply keeps Parameter identity only when
    torch._has_compatible_shallow_copy_type(cpu_param, tpu_param) is True."""
    emb = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    m = torch.nn.ModuleList([emb, head]).to("tpu")
    assert m[0].weight.device.type == "tpu"
    assert id(m[0].weight) == id(m[1].weight), "tied weights were untied by .to('tpu')"


def test_torch_accelerator():
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() >= 1
    acc = torch.accelerator.current_accelerator()
    assert acc is not None and acc.type == "tpu"
    torch.accelerator.synchronize()


# ------------------------------------------------------------ torch.tpu module


def test_torch_tpu_module_basics():
    assert torch.tpu.is_available()
    n = torch.tpu.device_count()
    assert n >= 1
    assert 0 <= torch.tpu.current_device() < n
    torch.tpu.set_device(0)
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device("tpu:0")
    assert torch.tpu.current_device() == 0
    with torch.tpu.device(0):
        assert torch.tpu.current_device() == 0
        x = torch.ones(2, device="tpu")
        assert x.device.index == 0
    with torch.tpu.device(torch.device("tpu:0")):
        assert torch.tpu.current_device() == 0
    torch.tpu.synchronize()
    torch.tpu.synchronize(0)


def test_device_context_switches_when_several_devices():
    n = torch.tpu.device_count()
    if n < 2:
        import pytest

        pytest.skip("needs two tpu devices")
    with torch.tpu.device(1):
        assert torch.tpu.current_device() == 1
        assert torch.ones(1, device="tpu").device.index == 1
    assert torch.tpu.current_device() == 0


def test_device_name_and_properties():
    name = torch.tpu.get_device_name()
    assert isinstance(name, str) and name
    assert torch.tpu.get_device_name(0) == name
    props = torch.tpu.get_device_properties(0)
    assert props.name == name
    assert props.total_memory > 0
    assert "total_memory" in repr(props)


# ------------------------------------------------------------ random numbers


def test_manual_seed_and_initial_seed():
    torch.tpu.manual_seed(123)
    assert torch.tpu.initial_seed() == 123
    a = torch.rand(8, device="tpu").cpu()
    torch.tpu.manual_seed(123)
    b = torch.rand(8, device="tpu").cpu()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.tpu.manual_seed(124)
    c = torch.rand(8, device="tpu").cpu()
    assert not torch.equal(a, c)
    torch.tpu.manual_seed_all(7)
    assert torch.tpu.initial_seed() == 7


def test_torch_manual_seed_seeds_tpu():
    torch.manual_seed(5)
    a = torch.randn(8, device="tpu").cpu()
    torch.manual_seed(5)
    b = torch.randn(8, device="tpu").cpu()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rng_state_round_trip():
    torch.tpu.manual_seed(0)
    torch.rand(3, device="tpu")  # advance the generator
    state = torch.tpu.get_rng_state()
    assert isinstance(state, torch.Tensor) and state.device.type == "cpu" and state.dtype == torch.uint8
    a = torch.rand(16, device="tpu").cpu()
    b = torch.randn(16, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    a2 = torch.rand(16, device="tpu").cpu()
    b2 = torch.randn(16, device="tpu").cpu()
    torch.testing.assert_close(a, a2, rtol=0, atol=0)
    torch.testing.assert_close(b, b2, rtol=0, atol=0)
    assert len(torch.tpu.get_rng_state_all()) == torch.tpu.device_count()


def test_rng_state_must_be_a_cpu_byte_tensor_as_on_cuda():
    torch.tpu.manual_seed(7)
    state = torch.tpu.get_rng_state()
    expected = torch.rand(4, device="tpu").cpu()
    for bad in (state.to("tpu"), state.float()):  # a checkpoint loaded with map_location="tpu"; a wrong dtype
        torch.tpu.set_rng_state(state)
        with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
            torch.tpu.set_rng_state(bad)
        assert torch.equal(torch.rand(4, device="tpu").cpu(), expected)  # the state is unchanged
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
        torch.Generator(device="tpu").set_state(state.to("tpu"))


def test_rng_state_round_trip_dropout():
    x = torch.ones(64, 64, device="tpu")
    state = torch.tpu.get_rng_state()
    a = torch.nn.functional.dropout(x, 0.5, training=True).cpu()
    torch.tpu.set_rng_state(state)
    b = torch.nn.functional.dropout(x, 0.5, training=True).cpu()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    frac = (a == 0).float().mean().item()
    assert 0.4 < frac < 0.6


# ------------------------------------------------------------ memory


def test_memory_allocated_grows_and_drops():
    _sync()
    before = torch.tpu.memory_allocated()
    nbytes = 4 << 20
    x = torch.ones(nbytes // 4, device="tpu")
    _sync()
    during = torch.tpu.memory_allocated()
    assert during >= before + nbytes
    assert torch.tpu.memory_allocated(0) == during
    assert torch.tpu.memory_allocated("tpu:0") == during
    del x
    _sync()
    after = torch.tpu.memory_allocated()
    assert after <= during - nbytes


def test_peak_memory_stats():
    _sync()
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    assert torch.tpu.max_memory_allocated() == base
    nbytes = 8 << 20
    x = torch.zeros(nbytes // 4, device="tpu")
    _sync()
    del x
    _sync()
    assert torch.tpu.max_memory_allocated() >= base + nbytes
    assert torch.tpu.memory_allocated() < base + nbytes
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == torch.tpu.memory_allocated()


def test_memory_stats_keys():
    x = torch.ones(1000, device="tpu")
    _sync()
    stats = torch.tpu.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.current", "reserved_bytes.all.peak"):
        assert key in stats, key
        assert isinstance(stats[key], int)
    assert stats["allocated_bytes.all.current"] >= x.numel() * 4
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    free, total = torch.tpu.mem_get_info()
    assert 0 <= free <= total
    assert total == stats["limit_bytes"]
    torch.tpu.empty_cache()


def test_torch_accelerator_memory_api_reads_the_tpu_allocator():
    # torch.accelerator's memory functions (what accelerate and the Trainer call)
    # need a c10::DeviceAllocator; they agree with torch.tpu's.
    assert torch.accelerator.current_accelerator().type == "tpu"
    _sync()
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.reset_accumulated_memory_stats()
    base = torch.accelerator.memory_allocated()
    assert base == torch.tpu.memory_allocated()
    nbytes = 4 << 20
    x = torch.ones(nbytes // 4, device="tpu")
    _sync()
    assert torch.accelerator.memory_allocated(0) == torch.tpu.memory_allocated() >= base + nbytes
    assert torch.accelerator.memory_reserved() == torch.accelerator.memory_allocated()
    del x
    _sync()
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.peak"] == torch.tpu.max_memory_allocated() >= base + nbytes
    assert stats["allocated_bytes.all.current"] == torch.tpu.memory_allocated()
    assert stats["allocated_bytes.all.allocated"] >= nbytes
    assert stats["allocated_bytes.all.freed"] >= nbytes
    assert stats["allocation.all.allocated"] >= 1 and stats["allocation.all.freed"] >= 1
    assert torch.tpu.memory_stats()["allocated_bytes.all.peak"] == stats["allocated_bytes.all.peak"]
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.accelerator.memory_stats()["allocated_bytes.all.allocated"] == 0
    free, total = torch.accelerator.get_memory_info()
    assert (free, total) == torch.tpu.mem_get_info()
    assert total - free == torch.tpu.memory_allocated()
    torch.accelerator.empty_cache()


def test_accelerator_memory_api_rejects_a_bad_device_index():
    for fn in (torch.accelerator.memory_stats, torch.accelerator.reset_peak_memory_stats,
               torch.accelerator.reset_accumulated_memory_stats, torch.accelerator.get_memory_info):
        with pytest.raises(RuntimeError, match="Invalid device tpu:7"):
            fn(7)


_EMPTY_CACHE = """
import torch, torch_tpu
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
# The runtime's start and the program's compile first: their memory, freed
# between the arrays, would pin heap pages that a trim cannot return.
torch.ones(4 << 20, device="tpu")
torch.tpu.synchronize()
# 16 MB arrays come from the heap (not their own mmap), which keeps them once freed.
xs = [torch.ones(4 << 20, device="tpu") for _ in range(12)]
torch.tpu.synchronize()
del xs
held = rss()
torch.tpu.empty_cache()
print(held - rss())
"""


def test_memory_stats_before_any_tpu_tensor():
    # The first call in a process starts the runtime rather than report nothing.
    code = ("import torch, torch_tpu; s = torch.tpu.memory_stats(); "
            "print(s['allocated_bytes.all.current'], s['limit_bytes'] > 0)")
    assert _last_line(code) == "0 True"


def test_empty_cache_returns_freed_device_memory_to_the_system():
    released = int(_last_line(_EMPTY_CACHE))
    assert released > 100 << 20, released


# ------------------------------------------------------------ streams and events


def test_stream_and_event():
    s = torch.tpu.Stream()
    assert s.device.type == "tpu"
    cur = torch.tpu.current_stream()
    assert cur.device.type == "tpu"
    x = torch.ones(256, 256, device="tpu")
    y = x * 2 + 1
    e = torch.tpu.Event()
    e.record()
    e.synchronize()
    assert e.query()
    s.synchronize()
    assert s.query()
    e2 = torch.Event(device="tpu")
    e2.record(cur)
    e2.wait(s)
    e2.synchronize()
    assert e2.query()
    assert y[0, 0].item() == 3.0


def test_event_elapsed_time_between_tpu_events():
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    plain = torch.Event(device="tpu", enable_timing=True)
    assert isinstance(start, torch.tpu.Event) and isinstance(plain, torch.tpu.Event)
    assert not isinstance(torch.Event(device="cpu"), torch.tpu.Event)
    start.record()
    (torch.ones(256, 256, device="tpu") * 2).sum().item()
    end.record()
    plain.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    assert start.elapsed_time(plain) >= start.elapsed_time(end)


def test_accelerator_stream_api():
    s = torch.accelerator.current_stream()
    assert s.device.type == "tpu"
    s.synchronize()


# ------------------------------------------------------------ serialization


def test_save_load_round_trip(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to("tpu")
    path = tmp_path / "t.pt"
    torch.save({"t": t, "v": t[1]}, path)

    on_cpu = torch.load(path, map_location="cpu")
    assert on_cpu["t"].device.type == "cpu"
    torch.testing.assert_close(on_cpu["t"], t.cpu())
    torch.testing.assert_close(on_cpu["v"], t.cpu()[1])

    on_tpu = torch.load(path, map_location="tpu")
    assert on_tpu["t"].device.type == "tpu"
    torch.testing.assert_close(on_tpu["t"].cpu(), t.cpu())
    torch.testing.assert_close(on_tpu["v"].cpu(), t.cpu()[1])

    default = torch.load(path)  # saved on tpu -> restored on tpu
    assert default["t"].device.type == "tpu"
    torch.testing.assert_close(default["t"].cpu(), t.cpu())


def test_save_load_state_dict(tmp_path):
    m = torch.nn.Linear(4, 3).to("tpu")
    path = tmp_path / "m.pt"
    torch.save(m.state_dict(), path)
    sd = torch.load(path, map_location="cpu")
    m2 = torch.nn.Linear(4, 3)
    m2.load_state_dict(sd)
    torch.testing.assert_close(m2.weight, m.weight.cpu())


# ------------------------------------------------------------ printing and host reads


def test_print_tensor(capsys):
    t = torch.tensor([1.0, 2.5, -3.0], device="tpu")
    r = repr(t)
    assert "device='tpu:0'" in r
    assert "2.5" in r
    print(t)
    assert "device='tpu:0'" in capsys.readouterr().out
    assert "device='tpu:0'" in repr(torch.tensor([1, 2], device="tpu"))


def test_item_tolist_numpy():
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="tpu")
    assert t[1, 0].item() == 3.0
    assert torch.tensor(7, device="tpu").item() == 7
    assert t.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    n = t.cpu().numpy()
    assert n.shape == (2, 2) and n[1, 1] == 4.0
    assert float(t.sum()) == 10.0
    assert bool(torch.tensor(True, device="tpu"))


def _run(code: str, **env) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter with these environment variables set."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=300)


def _last_line(code: str, **env) -> str:
    """Runs `code` (it must succeed); returns the last line it printed."""
    r = _run(code, **env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


_HOST_READS = """
import torch, torch_tpu
g = torch.Generator().manual_seed(0)
x = torch.randn(4, 6, generator=g)
t = x.to("tpu")
y = (t * 2 + 1).t()[1:3]  # a computed result read through a strided view
cases = [
    (y.cpu(), (x * 2 + 1).t()[1:3]),
    (t.sum(), x.sum()),
    ((t > 0), (x > 0)),
    (t.to(torch.int64), x.to(torch.int64)),
    (t.to(torch.bfloat16), x.to(torch.bfloat16)),
]
for a, b in cases:
    torch.testing.assert_close(a.cpu(), b)
assert (t.sum() * 0 + 3).item() == 3.0 and (t[0] > 100).tolist() == [False] * 6
# A deferred index check's flag is read the same way: a good index passes, a bad one raises.
v = t.flatten()
torch.testing.assert_close(v[torch.tensor([0, 23], device="tpu")].cpu(), x.flatten()[[0, 23]])
try:
    v[torch.tensor([0, 24], device="tpu")].cpu()
    raise SystemExit("no IndexError for index 24 of 24")
except IndexError as e:
    assert "index out of range" in str(e), e
print("ok", torch_tpu.metrics()["d2h_transfers"] > 0)
"""


@pytest.mark.parametrize("host_reads", ["1", "0"])
def test_reading_results_in_place_and_through_the_plugin_copy(host_reads):
    # On the CPU plugin results are read in place (device memory is host
    # memory); TORCH_TPU_HOST_READS=0 takes the plugin's own copy, the path
    # every other plugin uses. Both must give the same values.
    assert _last_line(_HOST_READS, TORCH_TPU_HOST_READS=host_reads) == "ok True"


_MALLOC_TUNING = r"""
import ctypes
import torch, torch_tpu
torch.ones(1, device="tpu").cpu()
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
p = libc.malloc(24 << 20)
libc.free(p)
print("tuned", torch_tpu._C._host_malloc_tuned(), libc.mallinfo2().fordblks >= 24 << 20)
"""


@pytest.mark.parametrize("tuning", ["1", "0"])
def test_cpu_plugin_keeps_freed_host_memory_unless_told_not_to(tuning):
    # The CPU plugin's buffers come from malloc; glibc's defaults hand freed
    # blocks back to the kernel, so each new program output page-faults. The
    # runtime keeps freed blocks (up to 32 MB) in the process:
    # a freed 24 MB block stays free in the heap. TORCH_TPU_MALLOC_TUNING=0
    # leaves malloc as it was.
    line = _last_line(_MALLOC_TUNING, TORCH_TPU_MALLOC_TUNING=tuning)
    if tuning == "1":
        assert line == "tuned True True", line
    else:
        assert line.startswith("tuned False"), line


_VECTOR_WIDTH = """
import torch, torch_tpu
import torch.nn.functional as F
torch_tpu.set_fallback("error")
x = torch.linspace(-4, 4, 17 * 241).reshape(17, 241)
torch.testing.assert_close(F.gelu(x.to("tpu")).cpu(), F.gelu(x))
torch.testing.assert_close(torch.softmax(x.to("tpu"), -1).cpu(), torch.softmax(x, -1))
print(torch_tpu._C._compile_option_overrides())
"""


def _host_has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx512f" in line for line in f)


@pytest.mark.skipif(torch_tpu._C._platform() != "cpu", reason="the vector width is a CPU-plugin option")
@pytest.mark.parametrize("env, want", [
    ({}, "auto"),
    ({"TORCH_TPU_CPU_VECTOR_WIDTH": "256"}, "[('xla_cpu_prefer_vector_width', 256)]"),
    ({"TORCH_TPU_CPU_VECTOR_WIDTH": "512", "XLA_FLAGS": "--xla_cpu_prefer_vector_width=256"}, "[]"),
])
def test_cpu_plugin_compiles_for_the_host_vector_width(env, want):
    # XLA:CPU targets 256-bit vectors unless told otherwise; on AVX-512 hosts
    # the runtime asks for 512 (a compile option), TORCH_TPU_CPU_VECTOR_WIDTH
    # picks the width, and a width in XLA_FLAGS is left to XLA.
    if want == "auto":
        want = "[('xla_cpu_prefer_vector_width', 512)]" if _host_has_avx512() else "[]"
    assert _last_line(_VECTOR_WIDTH, **env) == want


def test_a_bad_vector_width_is_a_clear_error():
    code = "import torch, torch_tpu\ntorch.ones(1, device='tpu')"
    r = _run(code, TORCH_TPU_CPU_VECTOR_WIDTH="300")
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "TORCH_TPU_CPU_VECTOR_WIDTH='300' must be 128, 256 or 512" in r.stderr


_SPINNERS = """
import os, time, resource, torch, torch_tpu
x = torch.randn(512, 512, device="tpu")
for _ in range(20):
    x = torch.tanh(x @ x)
x.cpu()
time.sleep(0.05)  # past the linger
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
t0 = cpu()
time.sleep(0.5)
print(torch_tpu._C._core_spinner_threads(), round(cpu() - t0, 3))
"""


def _sched_idle_allowed() -> bool:
    r = subprocess.run([sys.executable, "-c", "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))"])
    return r.returncode == 0


@pytest.mark.skipif(torch_tpu._C._platform() != "cpu", reason="the core spinner is a CPU-plugin runtime feature")
@pytest.mark.parametrize("spin_us", [None, "0"])
def test_core_spinners_run_per_core_and_sleep_when_idle(spin_us):
    # The CPU plugin's runtime keeps one SCHED_IDLE spinner per core while
    # programs run (TORCH_TPU_CPU_SPIN_US=0: none). Idle, they sleep: the
    # process takes no CPU time.
    env = {} if spin_us is None else {"TORCH_TPU_CPU_SPIN_US": spin_us}
    threads, idle_cpu_s = _last_line(_SPINNERS, **env).split()
    want = len(os.sched_getaffinity(0)) if spin_us is None and _sched_idle_allowed() else 0
    assert int(threads) == want
    assert float(idle_cpu_s) < 0.05


def test_a_bad_spin_linger_is_a_clear_error():
    r = _run("import torch, torch_tpu\ntorch.ones(1, device='tpu')", TORCH_TPU_CPU_SPIN_US="2ms")
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "TORCH_TPU_CPU_SPIN_US='2ms' must be a number of microseconds" in r.stderr


def test_metrics_api():
    torch_tpu.reset_metrics()
    x = torch.ones(3, device="tpu") + 1
    x.cpu()
    m = torch_tpu.metrics()
    for key in ("compiles", "cache_hits", "cache_misses", "executions", "fallbacks"):
        assert key in m, key
    assert m["executions"] >= 1
    assert isinstance(torch_tpu.metrics_report(), str)


def test_metrics_file_is_written_at_exit_per_rank(tmp_path):
    # A torchrun job's counters, read from outside: each rank writes its own file.
    path = str(tmp_path / "metrics.{rank}.json")
    r = _run("import torch, torch_tpu\n(torch.ones(3, device='tpu') + 1).cpu()", TORCH_TPU_METRICS_FILE=path, RANK="3")
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "metrics.3.json") as f:
        m = json.load(f)
    assert m["executions"] >= 1 and "dist_collectives" in m


def test_factory_functions_respect_arguments():
    # Programs are cached by fingerprint: calls that differ only in scalar
    # arguments (and so in output size) must not reuse each other's results.
    for args in [(32,), (4,), (6,), (2, 5), (0, 1, 0.25)]:
        torch.testing.assert_close(torch.arange(*args, device="tpu").cpu(), torch.arange(*args))
    for n, v in [(3, 2.0), (5, 7.0)]:
        torch.testing.assert_close(torch.full((n,), v, device="tpu").cpu(), torch.full((n,), v))
    torch.testing.assert_close(torch.linspace(0, 1, 5, device="tpu").cpu(), torch.linspace(0, 1, 5))


@pytest.mark.mode_dependent  # it checks both modes: the gate runs it in strict and fused eager
def test_fills_reuse_kept_results_and_in_place_updates_do_not_leak():
    # A fill (zeros, ones_like, full) reads no tensor: its result is kept and
    # handed out again, with no launch, to a later call with the same shape
    # and value once no live tensor holds it (strict eager; fused eager defers
    # fills into the next program anyway).
    shape = (300, 1024)  # 1.2 MB: large enough that in-place updates donate buffers
    fused = torch_tpu._C._fused()
    torch.zeros(shape, device="tpu")  # kept, and free again
    m0 = torch_tpu.metrics()
    a = torch.zeros(shape, device="tpu")
    m1 = torch_tpu.metrics()
    if not fused:
        assert m1["executions"] == m0["executions"]
        assert m1["constant_reuses"] == m0["constant_reuses"] + 1
    b = torch.zeros(shape, device="tpu")  # `a` holds the kept buffer: b gets its own
    if not fused:
        assert torch_tpu.metrics()["executions"] == m1["executions"] + 1
    # Updating a holder must not reach the kept result.
    a.add_(1)
    b.mul_(3).add_(2)
    c = torch.zeros(shape, device="tpu")
    c[0, :5] = 7.0  # a partial write: a scatter from the kept buffer
    d = torch.zeros(shape, device="tpu")
    torch.testing.assert_close(a.cpu(), torch.ones(shape))
    torch.testing.assert_close(b.cpu(), torch.full(shape, 2.0))
    want_c = torch.zeros(shape)
    want_c[0, :5] = 7.0
    torch.testing.assert_close(c.cpu(), want_c)
    torch.testing.assert_close(d.cpu(), torch.zeros(shape))
    del d
    # Programs that take their input's buffer for the result (a compiled
    # graph's replay, a fused chain of in-place ops) must not take a kept one.
    bump = torch.compile(lambda t: t.add_(1).mul_(2), backend="tpu")
    w = torch.zeros(shape, device="tpu")
    bump(w)
    bump(w)  # captured: later calls replay the program, which donates its input
    d0 = torch_tpu.metrics()["donated_buffers"]
    e = torch.zeros(shape, device="tpu")
    bump(e)
    torch.testing.assert_close(e.cpu(), torch.full(shape, 2.0))
    del e
    f = torch.zeros(shape, device="tpu")
    with torch_tpu.mode("fused"):
        f.add_(1).mul_(3)
        f.cpu()
    if not fused:
        assert torch_tpu.metrics()["donated_buffers"] == d0  # both copied the kept buffer
    g = torch.zeros(shape, device="tpu")
    torch.testing.assert_close(f.cpu(), torch.full(shape, 3.0))
    torch.testing.assert_close(g.cpu(), torch.zeros(shape))
    # The value, dtype and shape are part of what is kept.
    for v in (2.0, 3.0, 2.0):
        torch.testing.assert_close(torch.full((4, 5), v, device="tpu").cpu(), torch.full((4, 5), v))
    torch.testing.assert_close(torch.full((4, 5), 2, dtype=torch.int32, device="tpu").cpu(),
                               torch.full((4, 5), 2, dtype=torch.int32))
    x = torch.randn(6, 7, device="tpu")
    torch.testing.assert_close(torch.ones_like(x).cpu(), torch.ones(6, 7))
    torch.testing.assert_close(torch.zeros(6, 8, device="tpu").cpu(), torch.zeros(6, 8))
    # Large fills are not kept: each one runs its program.
    big = (1100, 1024)  # 4.5 MB
    torch.zeros(big, device="tpu")
    e0 = torch_tpu.metrics()["executions"]
    z = torch.zeros(big, device="tpu")
    if not fused:
        assert torch_tpu.metrics()["executions"] - e0 == 1
    torch.testing.assert_close(z.cpu(), torch.zeros(big))


def test_param_data_moves_between_cpu_and_tpu_as_on_cuda():
    # FSDP2's _move_states_to_device does `param.data = param.to(device)`; Module.to keeps the
    # Parameter objects (an optimizer made before .to() still holds the model's parameters).
    p = torch.nn.Parameter(torch.arange(3.0))
    p.data = p.to("tpu")
    assert p.device.type == "tpu" and isinstance(p, torch.nn.Parameter) and p.requires_grad
    (p * 2).sum().backward()
    assert p.grad.device.type == "tpu" and p.grad.cpu().tolist() == [2.0, 2.0, 2.0]
    p.data = p.data.cpu()
    assert p.device.type == "cpu" and p.tolist() == [0.0, 1.0, 2.0]
    m = torch.nn.Linear(4, 2)
    weight = m.weight
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.to("tpu")
    assert m.weight is weight and m.weight.device.type == "tpu"
    m(torch.ones(1, 4, device="tpu")).sum().backward()
    opt.step()
    assert m.weight.device.type == "tpu"
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        p.data = torch.ones(3, device="meta")


def test_pin_memory_is_pinned_for_tpu():
    """Tensor.pin_memory() gives host memory the tpu hooks recognise (issue 3/7, finding 6):
    views into it too, other host tensors not; DataLoader(pin_memory=True) pins its batches,
    and a non_blocking copy from pinned memory arrives whole."""
    import torch.utils.data as data

    t = torch.arange(6.0)
    p = t.pin_memory()
    assert p.is_pinned() and p.device.type == "cpu" and p[2:].is_pinned()
    assert not t.is_pinned() and not torch.ones(3).is_pinned()
    assert p.data_ptr() % 4096 == 0
    q = p.to("tpu", non_blocking=True)
    assert q.cpu().tolist() == t.tolist()
    loader = data.DataLoader(data.TensorDataset(torch.randn(8, 3)), batch_size=4, pin_memory=True)
    assert all(batch[0].is_pinned() for batch in loader)


def test_empty_host_cache_and_host_allocator():
    """torch.accelerator.empty_host_cache() (vLLM calls it at shutdown) dereferenced a missing
    host allocator and killed the process; pinned memory is the tpu host allocator's now."""
    code = (
        "import torch, torch_tpu\n"
        "p = torch.ones(1000).pin_memory()\n"
        "torch.accelerator.empty_host_cache()\n"
        "del p\n"
        "torch.accelerator.empty_host_cache()\n"
        "print('ok', torch.ones(2, device='tpu').sum().item())\n"
    )
    rc, out, err = _python(code)
    assert rc == 0 and "ok 2.0" in out, err[-2000:]


@pytest.mark.parametrize("fill, args, check", [
    ("exponential_", (), lambda a: abs(a.mean() - 1) < 0.02),
    ("cauchy_", (), lambda a: abs(a.median()) < 0.02),
    ("log_normal_", (), lambda a: abs(a.log().mean() - 1) < 0.03),  # mean 1, std 2 of the log
    ("geometric_", (0.3,), lambda a: abs(a.mean() - 1 / 0.3) < 0.05),
])
def test_random_fills_take_a_tpu_generator(fill, args, check, fallback_error):
    """exponential_, cauchy_, log_normal_ and geometric_ with generator= (vLLM's seeded sampling
    calls exponential_ so): PyTorch's meta kernels of these refuse any generator, and the CPU
    mirror of the input checks took it for a CPU one."""
    g = torch.Generator(device="tpu")
    draws = []
    for _ in range(2):
        g.manual_seed(11)
        draws.append(getattr(torch.empty(100_000, device="tpu"), fill)(*args, generator=g).cpu())
    again = getattr(torch.empty(100_000, device="tpu"), fill)(*args, generator=g).cpu()
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], again)
    assert check(draws[0].double())


def _python(code, **env):
    """Runs code in a fresh process with env added; returns (exit status, stdout, stderr)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, **env),
                       timeout=300)
    return r.returncode, r.stdout, r.stderr


def test_a_slow_compile_says_what_it_compiles():
    """A compile longer than TORCH_TPU_SLOW_COMPILE_S names the program, its op count and
    size on stderr, and its time once done (issue 3/7, finding 8); a bad value is an error."""
    code = ("import torch, torch_tpu\n"
            "x = torch.randn(64, 64, device='tpu')\n"
            "f = torch.compile(lambda x: torch.stack([(x @ x).sin().cumsum(0) * i for i in range(40)]).sum(),"
            " backend='tpu')\n"
            "print(f(x).item())\n")
    rc, _, err = _python(code, TORCH_TPU_CACHE_DIR="off", TORCH_TPU_SLOW_COMPILE_S="0.01")
    assert rc == 0, err[-3000:]
    assert "torch_tpu: still compiling the program for " in err and " ops, " in err, err[-3000:]
    assert "torch_tpu: compiled the program for " in err, err[-3000:]
    rc, _, err = _python(code, TORCH_TPU_CACHE_DIR="off", TORCH_TPU_SLOW_COMPILE_S="0")
    assert rc == 0 and "still compiling" not in err, err[-3000:]
    rc, _, err = _python("import torch, torch_tpu\nprint((torch.ones(2, device='tpu') + 1).cpu())",
                         TORCH_TPU_CACHE_DIR="off", TORCH_TPU_SLOW_COMPILE_S="soon")
    assert rc != 0 and "TORCH_TPU_SLOW_COMPILE_S must be a number of seconds" in err, err[-3000:]


def test_an_op_compiled_for_many_shapes_is_named():
    """A loop whose sizes grow each step compiles a program per step (the model zoo's slanext
    decoder: 1,566 compiles, 149 of its 153 s); at 100 programs for one op, stderr says so."""
    code = ("import torch, torch_tpu\n"
            "x = torch.zeros(0, device='tpu')\n"
            "for i in range(101):\n"
            "    x = torch.cat([x, torch.ones(1, device='tpu')])\n"
            "print(x.sum().item())\n")
    rc, out, err = _python(code, TORCH_TPU_CACHE_DIR="off", TORCH_TPU_DEFER_AND_FUSE="0")
    assert rc == 0 and out.strip().endswith("101.0"), err[-3000:]
    assert "aten::cat has been compiled for 100 different shapes" in err, err[-3000:]
