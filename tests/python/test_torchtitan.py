"""TorchTitan (from PyPI) trains its llama3 debug model on tpu through torchrun, unchanged:
FSDP=2 and TP=2 over 2 processes give the losses of the 1-rank run, step for step. Its Qwen3
mixture-of-experts recipe (made small: tools/titan_moe.py) with expert parallelism 2 does too.

All three runs start from one seed checkpoint (TorchTitan's own way to compare
parallelisms: a sharded model initialises its weights with other random draws) and read
the same sequences at every step (tools/titan_assets.py --parity lays the data file out
so). The tokenizer and data are made offline from the project's corpus."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10

pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/setup.sh installs it)")

COMMON = ["--module", "llama3", "--config", "llama3_debugmodel_varlen_attn", "--parallelism.spmd_backend",
          "partial_dtensor", "--training.seq_len", "64", "--training.steps", str(STEPS), "--checkpoint.enable",
          "--checkpoint.interval", "1000"]


MOE = ["--module", "titan_moe", "--config", "qwen3_moe_tiny", "--parallelism.spmd_backend", "partial_dtensor",
       "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "1000"]


def _env(**extra):
    env = dict(os.environ, TORCH_TPU_FALLBACK="error", TORCH_TPU_PLUGIN="cpu", **extra)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tools"), env.get("PYTHONPATH", "")])
    return env


def _titan(cwd, nproc, *args, timeout=400, config=COMMON, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "torch_tpu.titan", *config, *args]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env or _env(), timeout=timeout)
    out = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
    assert r.returncode == 0, out[-6000:]
    return out


def _losses(out):
    found = {}
    for step, loss in re.findall(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)", out):
        found[int(step)] = float(loss)
    assert sorted(found) == list(range(1, STEPS + 1)), out[-3000:]
    return [found[s] for s in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("titan"))
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "titan_assets.py"), d, "--parity", str(STEPS)],
                   check=True, capture_output=True, env=_env(), timeout=300)
    _titan(d, 1, "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1",
           "--training.steps", "1", "--dump_folder", "seed")
    assert os.path.isdir(os.path.join(d, "seed", "checkpoint", "step-0"))
    return d


def _run(workdir, name, nproc, *args, seed="seed", **kw):
    return _losses(_run_out(workdir, name, nproc, *args, seed=seed, **kw))


def _run_out(workdir, name, nproc, *args, seed, **kw):
    os.makedirs(os.path.join(workdir, name, "checkpoint"))
    shutil.copytree(os.path.join(workdir, seed, "checkpoint", "step-0"),
                    os.path.join(workdir, name, "checkpoint", "step-0"))
    return _titan(workdir, nproc, "--dump_folder", name, *args, **kw)


@pytest.fixture(scope="module")
def one_rank(workdir):
    return _run(workdir, "one", 1, "--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "1")


def test_one_rank_trains_natively(one_rank):
    # The gate's TorchTitan run: the seed checkpoint and one rank's training (about 35 s).
    assert one_rank[-1] < one_rank[0] - 0.3  # it learns


# Slow (about 30 s each): the full tier; the distributed tests cover FSDP2 and TP in both modes.
@pytest.mark.slow
def test_fsdp2_over_2_ranks_matches_1_rank(workdir, one_rank):
    got = _run(workdir, "fsdp", 2, "--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2")
    assert got == pytest.approx(one_rank, rel=1e-4), (got, one_rank)
    assert one_rank[-1] < one_rank[0] - 0.3  # it learns


@pytest.mark.slow
def test_tp2_matches_1_rank(workdir, one_rank):
    got = _run(workdir, "tp", 2, "--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "1",
               "--parallelism.tensor_parallel_degree", "2")
    assert got == pytest.approx(one_rank, rel=1e-4), (got, one_rank)


# Slow (about 70 s): TorchTitan's MoE layers (router, token reordering, grouped experts, the
# load-balancing hook) over `tpu_dist`. With EP 2 each rank holds 4 of the 8 experts, so the
# losses can equal one rank's only if the all_to_alls (uneven: token counts per expert) send
# every token to its experts and back.
@pytest.mark.slow
def test_moe_expert_parallel_2_matches_1_rank(workdir, tmp_path):
    _titan(workdir, 1, "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1",
           "--training.steps", "1", "--dump_folder", "moe_seed", config=MOE)
    one = _run(workdir, "moe_one", 1, "--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree",
               "1", seed="moe_seed", config=MOE)
    metrics = str(tmp_path / "metrics.{rank}.json")
    out = _run_out(workdir, "moe_ep", 2, "--training.local_batch_size", "2",
                   "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
                   seed="moe_seed", config=MOE, env=_env(TORCH_TPU_METRICS_FILE=metrics))
    assert re.search(r"active dimensions: \[[^]]*'ep'", out), out[-3000:]  # TorchTitan made the EP mesh
    ep = _losses(out)
    assert ep == pytest.approx(one, rel=1e-4), (ep, one)
    for rank in (0, 1):
        with open(metrics.replace("{rank}", str(rank))) as f:
            m = json.load(f)
        assert m["dist_collectives"] > 0 and not m["fallbacks"], m
