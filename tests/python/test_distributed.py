"""torch.distributed on tpu through tpu_dist: every collective against gloo, DDP, FSDP2,
tensor parallelism and a GPipe pipeline against one process, and failures that raise instead
of hanging. Two processes each, under torchrun (the failure cases start one process per rank
themselves)."""

import datetime
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import torch_tpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_workers")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch was built without torch.distributed")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TORCH_TPU_FALLBACK"] = "error"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _torchrun(script, *args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(WORKERS, script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(mode, timeout=90, only_rank0=False):
    """Starts failures.py once per rank; returns each rank's (exit status, output).
    only_rank0: the other rank is killed once rank 0 has finished (it is the one that stays away)."""
    port = str(_free_port())
    procs = []
    for r in range(2):
        env = _env()
        env.update(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, os.path.join(WORKERS, "failures.py"), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for i, p in enumerate(procs):
        if only_rank0 and i > 0:
            p.kill()
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            o += "\n[killed: timed out]"
        out.append((p.returncode, o + e[-3000:]))
    return out


def test_tpu_dist_is_the_tpu_default():
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu_dist"
    assert "tpu" in dist.Backend.backend_capability["tpu_dist"]


def test_one_rank_group_in_process():
    store = dist.HashStore()
    dist.init_process_group("tpu_dist", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch_tpu.reset_metrics()
        t = torch.arange(6.0, device="tpu")
        dist.all_reduce(t)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out = torch.empty(6, device="tpu")
        dist.all_gather_into_tensor(out, t)
        dist.barrier()
        assert torch.equal(out.cpu(), torch.arange(6.0))
        assert torch_tpu.metrics()["dist_collectives"] >= 4
        # PREMUL_SUM (FSDP2's gradient reduction): the input scaled, then summed.
        before = t.cpu()
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        assert torch.equal(t.cpu(), before * 2)
    finally:
        dist.destroy_process_group()


def test_every_collective_matches_gloo():
    out = _torchrun("collectives.py")
    assert out.count(": ok 58 checks") == 2, out


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "tp", "pp"])
def test_training_matches_one_process(mode):
    out = _torchrun("train.py", mode)
    assert out.count(f"{mode} ok") == 2, out


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "tp"])
def test_compiled_training_matches_one_eager_process(mode):
    """torch.compile(backend="tpu") over DDP, FSDP2 and DTensor: the collectives Dynamo
    meets run between the compiled pieces; losses equal the eager one-process run."""
    out = _torchrun("train.py", mode, "compile")
    assert out.count(f"{mode} compiled ok") == 2, out


def test_process_span_store_reaches_the_other_process_and_cpu_stages():
    out = _torchrun("process_span.py", timeout=120)
    assert out.count("key-value store ok") == 2 and out.count("transport choice ok") == 2, out


def test_a_dead_rank_makes_the_other_raise():
    (rc0, out0), (rc1, _) = _ranks("dead")
    assert rc1 == 3
    assert rc0 == 0 and "rank 0: raised RuntimeError" in out0, out0


def test_mismatched_shapes_raise_on_every_rank():
    for rc, out in _ranks("mismatch"):
        assert rc == 0 and "called with different tensors on different ranks" in out, out
        assert "Float[4]" in out and "Float[68]" in out, out


def test_a_barrier_timeout_names_the_missing_rank():
    (rc0, out0), _ = _ranks("barrier", only_rank0=True)
    assert rc0 == 0 and "rank(s) 1 of 2 did not arrive" in out0, out0


def test_sharded_checkpoint_reshards_and_loads_in_one_process(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = _torchrun("checkpoint.py", ckpt)
    assert out.count("resharded load ok") == 2, out
    r = subprocess.run([sys.executable, os.path.join(WORKERS, "checkpoint.py"), ckpt, "--single"],
                       capture_output=True, text=True, env=_env(), timeout=240)
    assert r.returncode == 0 and "single: ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
