"""Code written for Google's TorchTPU runs here (issue 3/6): every name the callers in
docs/compatibility.md use, through the callers' own code where they are installed."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch

import torch_tpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF_WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_workers")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=240)


# --- loading, c10d names


def test_the_loader_ray_calls_registers_the_backends_and_can_be_called_again():
    import torch.distributed as dist

    import torch_tpu._loader

    torch_tpu._loader.load()
    torch_tpu._loader.load()
    assert dist.Backend.TPU_DIST == "tpu_dist" and dist.Backend.TPU == "tpu"
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu_dist"


def test_init_process_group_tpu_is_tpu_dist():
    import torch.distributed as dist

    dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        t = torch.arange(4.0, device="tpu")
        dist.all_reduce(t)
        assert torch.equal(t.cpu(), torch.arange(4.0))
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).to("tpu"))
        ddp(t[None]).sum().backward()
    finally:
        dist.destroy_process_group()


# --- torch.compile and Dynamo


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["torch_tpu_first", "dynamo_first"])
def test_dynamo_device_interface_is_torch_tpus(dynamo_first):
    first = "import torch._dynamo.device_interface as di; import torch_tpu" if dynamo_first else \
        "import torch_tpu; import torch._dynamo.device_interface as di"
    r = _python(first + """
import torch
i = di.get_interface_for_device("tpu")
assert i.__module__ == "torch_tpu._dynamo_device", i
assert i.current_device() == 0 and i.device_count() == torch.tpu.device_count()
assert isinstance(i.current_stream(), torch.Stream) and i.current_stream().device.type == "tpu"
with i.device(0):
    assert i.current_device() == 0
assert i.exchange_device(0) == 0 and i.maybe_exchange_device(-1) == -1
assert i.get_device_properties(0).multi_processor_count == 1
assert i.is_dtype_supported(torch.float32) and not i.is_dtype_supported(torch.complex32)
print("ok")
""")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]


@pytest.mark.mode_dependent
def test_torch_compile_with_no_backend_compiles_with_torch_tpus(fallback_error, caplog):
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8)
    ref = model(x)
    ref.sum().backward()
    ref_grad = model[0].weight.grad.clone()
    model.zero_grad()
    model.to("tpu")
    before = len(torch_tpu.compiled_graphs())
    with caplog.at_level("WARNING", logger="torch_tpu"):
        out = torch.compile(model)(x.to("tpu"))  # Inductor, PyTorch's default
        out.sum().backward()
    torch.testing.assert_close(out.cpu(), ref)
    torch.testing.assert_close(model[0].weight.grad.cpu(), ref_grad)
    assert len(torch_tpu.compiled_graphs()) > before  # the graphs went through torch_tpu's backend
    said = [r for r in caplog.records if "Inductor on tpu tensors" in r.getMessage()]
    assert len(said) <= 1  # said once per process (possibly by an earlier test)
    # Inductor still compiles graphs of CPU tensors.
    torch._dynamo.reset()
    cpu_model = torch.nn.Linear(8, 2)
    torch.testing.assert_close(torch.compile(cpu_model)(x), cpu_model(x))


# --- torch.tpu


def test_the_torch_tpu_names_callers_use():
    gens = torch.tpu.default_generators
    assert len(gens) == torch.tpu.device_count() and gens[0] is torch.tpu.default_generators[0]
    assert torch.tpu._get_generator(torch.device("tpu")) is gens[0]
    assert torch.tpu._exchange_device(-1) == -1
    assert torch.tpu._exchange_device(0) == torch.tpu.current_device() == 0
    assert torch.tpu._maybe_exchange_device(0) == 0
    assert torch.tpu.get_device_properties(0).multi_processor_count == 1
    name = torch.tpu.get_device_name(0)
    assert name == torch_tpu._C._device_kind(0) and ":" not in name  # the vendor's name


def test_device_names_are_the_vendors_and_torchtitan_finds_a_tpus_peak():
    from torch_tpu.device import _TPU_NAMES

    utils = pytest.importorskip("torchtitan.tools.utils")
    peaks = {"TPU v4": 275e12, "TPU v5p": 459e12, "TPU v5e": 197e12, "TPU v6e": 918e12}
    for kind, name in _TPU_NAMES.items():
        assert name.startswith("TPU ")
        if name in peaks:
            assert utils.get_peak_flops(name) == pytest.approx(peaks[name], rel=0.01), (kind, name)


def test_the_cache_stats_vllms_torchtpu_runner_reads():
    before = torch.tpu._get_cache_stats()
    with torch_tpu.mode("strict"):  # requests and hits count strict eager's program lookups
        x = torch.randn(3, 5, device="tpu")
        (x * 3 + 1).cpu()
        (x * 3 + 1).cpu()
    after = torch.tpu._get_cache_stats()
    assert after.num_cache_reqs >= before.num_cache_reqs + 2
    assert after.num_cache_hits >= before.num_cache_hits + 1
    assert after.num_cache_reqs - after.num_cache_hits == torch.tpu._get_cache_misses()
    assert after.per_entry_stats and len(after.per_entry_stats) >= len(before.per_entry_stats)
    ran = [e for e in after.per_entry_stats if e.read_count > 0]
    assert ran
    e = max(ran, key=lambda e: e.last_read)
    assert isinstance(e.compilation_duration, datetime.timedelta) and e.compilation_duration.total_seconds() >= 0
    assert isinstance(e.last_read, datetime.datetime)
    assert (datetime.datetime.now() - e.last_read).total_seconds() < 60


def test_eager_modes_by_googles_names():
    from torch_tpu._internal import execution_mode

    E = torch.tpu.EagerMode
    assert torch.tpu.eager_mode == E(torch_tpu.get_mode())
    before = torch_tpu.get_mode()
    try:
        with torch.tpu.set_eager_mode(E.DEFER_AND_FUSE):
            assert torch_tpu.get_mode() == "fused" and execution_mode.eager_mode is E.DEFER_AND_FUSE
        assert torch_tpu.get_mode() == before
        torch.tpu.eager_mode = E.DEFER_NEVER_AND_LAUNCH_BLOCKING
        assert torch_tpu.get_mode() == "debug"
        execution_mode.eager_mode = E.DEFER_NEVER
        assert torch_tpu.get_mode() == "strict" and execution_mode.eager_mode.name == "DEFER_NEVER"
    finally:
        torch_tpu.set_mode(before)


def test_googles_launch_blocking_variable_is_debug_mode():
    r = _python("import torch_tpu; print(torch_tpu.get_mode())", TORCH_TPU_LAUNCH_BLOCKING="1",
                TORCH_TPU_DEFER_AND_FUSE=None)  # the fused pass's variable would win
    assert r.returncode == 0 and r.stdout.split()[-1] == "debug", r.stderr[-2000:]


# --- the devices a process is given


@pytest.mark.parametrize("var", ["TPU_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS"])
def test_visible_devices_are_the_ones_the_process_gets(var):
    code = """
import torch, torch_tpu
x = torch.ones(2, device="tpu:1") * 2
print(torch.tpu.device_count(), x.cpu().tolist())
"""
    other = "TPU_VISIBLE_CHIPS" if var == "TPU_VISIBLE_DEVICES" else "TPU_VISIBLE_DEVICES"
    r = _python(code, TORCH_TPU_CPU_DEVICES="3", **{var: "2,0", other: None})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "2 [2.0, 2.0]"
    r = _python("import torch, torch_tpu; print(torch.tpu.device_count()); torch.ones(1, device='tpu')",
                TORCH_TPU_CPU_DEVICES="2", **{var: "0,5", other: None})
    # As torch.cuda.device_count() where the driver fails: 0 devices; using one names the cause.
    assert r.returncode != 0 and r.stdout.split()[-1] == "0"
    assert f"{var}=0,5: device 5 does not exist (the plugin has 2)" in r.stderr
    r = _python("import torch, torch_tpu; torch.ones(1, device='tpu')", **{var: "zero", other: None})
    assert r.returncode != 0 and "'zero' is not a device number" in r.stderr


def test_a_process_started_per_device_starts_on_its_local_rank():
    code = "import torch, torch_tpu; print(torch.tpu.current_device(), torch.ones(1, device='tpu').device)"
    r = _python(code, TORCH_TPU_CPU_DEVICES="2", LOCAL_RANK="1")
    assert r.returncode == 0 and r.stdout.split("\n")[-2] == "1 tpu:1", r.stdout + r.stderr[-2000:]
    # One visible device: every rank's is tpu:0.
    r = _python(code, LOCAL_RANK="1")
    assert r.returncode == 0 and r.stdout.split("\n")[-2] == "0 tpu:0", r.stdout + r.stderr[-2000:]


# --- torch_tpu._internal


def test_jax_op_as_torchrec_defines_and_calls_it(fallback_error):
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from torch_tpu._internal import pallas

    def lookup(indices: jax.Array, dev_weights: jax.Array, emb_dim: int) -> jax.Array:
        return jnp.take(dev_weights, indices, axis=0)[:, :emb_dim] * 2

    op = pallas.jax_op("dropin_test::embedding_lookup", lookup)
    w = torch.randn(10, 6)
    i = torch.tensor([3, 1, 3, 9])
    out = op(indices=i.to("tpu"), dev_weights=w.to("tpu"), emb_dim=4)  # by keyword, as TorchRec calls it
    torch.testing.assert_close(out.cpu(), w[i][:, :4] * 2)
    out = op(i.to("tpu"), w.to("tpu"), 6)
    torch.testing.assert_close(out.cpu(), w[i] * 2)
    with pytest.raises(ValueError, match="namespace::op"):
        pallas.jax_op("no_namespace", lookup)
    with pytest.raises(NotImplementedError, match="TPU slice"):
        pallas.jax_op("dropin_test::sharded", lookup, mesh=object())


def test_a_pallas_kernel_through_jax_op(fallback_error):
    pytest.importorskip("jax")
    import jax
    from jax.experimental import pallas as pl

    from torch_tpu._internal import pallas

    def add_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    @pallas.jax_op("dropin_test::pallas_add")
    def add(x: jax.Array, y: jax.Array) -> jax.Array:
        return pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)

    a, b = torch.randn(8, 128), torch.randn(8, 128)
    torch.testing.assert_close(add(a.to("tpu"), b.to("tpu")).cpu(), a + b)


def test_sync_profiler_and_hardware_internals(tmp_path):
    import torch_tpu._internal.compile  # noqa: F401  (registers the backend)
    from torch_tpu._internal import profiler, sync
    from torch_tpu._internal.utils import hardware

    x = torch.ones(4, device="tpu") + 1
    sync.synchronize(x, wait=True)
    sync.synchronize()
    with profiler.profile(activities=[profiler.ProfilerActivity.CPU, profiler.ProfilerActivity.TPU],
                          on_trace_ready=profiler.xprof_trace_handler(dir_name=str(tmp_path))):
        (x * 2).cpu()
    traces = list(tmp_path.iterdir())
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]
    if torch_tpu._C._platform() != "tpu":
        assert hardware.get_tpu_device_name() is None and hardware.get_tpu_topology() is None
        assert hardware.get_tpu_device_count() == 0
    import torch._dynamo as dynamo

    assert "tpu" in dynamo.list_backends(exclude_tags=())


# --- transformers, vLLM


def test_transformers_finds_tpu_and_its_test_helpers_drive_it():
    tu = pytest.importorskip("transformers.testing_utils")
    from transformers.utils import is_torch_tpu_available

    assert is_torch_tpu_available()
    assert tu.BACKEND_MANUAL_SEED["tpu"] is torch.tpu.manual_seed
    tu.backend_manual_seed("tpu", 3)
    a = torch.randn(3, device="tpu").cpu()
    tu.backend_manual_seed("tpu", 3)
    assert torch.equal(torch.randn(3, device="tpu").cpu(), a)
    tu.backend_empty_cache("tpu")
    assert tu.backend_device_count("tpu") == torch.tpu.device_count()


def test_the_vllm_plugin_is_not_named_as_vllms_own_tpu_platform():
    from importlib.metadata import entry_points

    names = {e.name: e.value for e in entry_points(group="vllm.platform_plugins")}
    assert names.get("torch_tpu") == "torch_tpu.vllm:register" and "tpu" not in names


# --- Accelerate and the Trainer under torchrun


def _trainer(nproc: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(HF_WORKERS, "trainer_ddp.py")]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]


@pytest.mark.slow  # two torchrun jobs, about 25 s
def test_the_trainer_under_torchrun_trains_ddp_over_tpu_dist_as_one_process():
    pytest.importorskip("accelerate")
    two, one = _trainer(2), _trainer(1)
    assert len(two) == 2 and len(one) == 1
    for r in two:
        assert r["distributed"] == "DistributedType.MULTI_HPU" and r["backend"] == "tpu_dist", r
        assert r["group"] == 2 and r["ddp"] == "DistributedDataParallel" and r["device"] == "tpu:0", r
        assert len(r["losses"]) == 3
        torch.testing.assert_close(r["losses"], one[0]["losses"], rtol=1e-5, atol=1e-5)
        assert r["weights"] == pytest.approx(one[0]["weights"], rel=1e-5, abs=1e-5)
    assert one[0]["distributed"] == "DistributedType.MULTI_HPU" and one[0]["group"] == 1
