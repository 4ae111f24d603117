"""Collectives inside compiled programs (docs/distributed.md, "Inside torch.compile"):
compiled tensor-parallel, DDP and FSDP steps (the latter two as TorchTitan's SimpleFSDP
writes them) over ranks as threads (2 devices of one process) run their functional
collectives inside their forward and backward programs, with losses equal to the same step
with the collectives between programs (TORCH_TPU_COLLECTIVES_IN_PROGRAM=0) and to one
process on the CPU. Each case runs dist_workers/in_program.py in a process
of its own (the device count is fixed at start)."""

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_workers", "in_program.py")

# Each test picks its execution mode (fused eager where FUSED is passed, strict otherwise): the
# counts it asserts are that mode's, so the fused pass does not repeat the file.
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch was built without torch.distributed"),
              pytest.mark.own_modes]


def _run(mode, in_program=True, timeout=300, devices=2, env=None):
    env = {**os.environ, "TORCH_TPU_DEFER_AND_FUSE": "0", **(env or {}), "TORCH_TPU_CPU_DEVICES": str(devices),
           "TORCH_TPU_PLUGIN": "cpu", "TORCH_TPU_FALLBACK": "error",
           "TORCH_TPU_COLLECTIVES_IN_PROGRAM": "1" if in_program else "0"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, WORKER, mode], capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def _result(out):
    line = next(ln for ln in out.splitlines() if ln.startswith("result "))
    return json.loads(line[len("result "):])


def _check(mode, programs_per_step=2):
    inside, split = _result(_run(mode)), _result(_run(mode, in_program=False))
    ref = torch.tensor(inside["reference"])
    for res in (inside, split):
        for losses in res["ranks"]:
            torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(inside["ranks"][0]), torch.tensor(split["ranks"][0]),
                               rtol=1e-4, atol=1e-5)
    # Inside: every step's forward and backward carry their collectives (2 programs per
    # rank per step); split: none does, each collective is a call between programs.
    steps = len(ref)
    assert inside["replicated_programs"] == 2 * programs_per_step * steps, inside["replicated_programs"]
    assert inside["collectives_in_programs"] > 0 and inside["collectives_in_programs"] % (2 * steps) == 0
    assert split["replicated_programs"] == 0 and split["collectives_in_programs"] == 0
    return inside, split


def test_tensor_parallel_step_runs_its_collectives_inside_its_programs():
    inside, split = _check("tp")
    # Colwise/rowwise MLPs: one all_reduce per MLP forward, one per backward; nothing
    # else is a collective, so the split run made them all as calls.
    assert inside["collectives_in_programs"] == 2 * 2 * len(inside["reference"]) * 2
    calls = sum(s["dist_xla_collectives"] for s in inside["steps"][0])
    assert calls == 0, inside["steps"][0]
    assert sum(s["dist_xla_collectives"] for s in split["steps"][0]) > 0


# Calls counted over the whole run (both ranks): SimpleFSDP's set-up distributes each of the 16
# parameters with one collective per rank.
SETUP = 2 * 16


def test_compiled_ddp_step_runs_its_gradient_all_reduces_inside_its_backward():
    # TorchTitan's SimpleFSDP in "replicate" mode (DDP): one all_reduce per parameter (16),
    # all in the backward program; the forward has no collective (1 program with collectives).
    pytest.importorskip("torchtitan", reason="SimpleFSDP is TorchTitan's (scripts/setup.sh installs it)")
    inside, split = _check("replicate", programs_per_step=1)
    steps = len(inside["reference"])
    assert inside["collectives_in_programs"] == 2 * 16 * steps
    assert inside["calls"] == SETUP and split["calls"] == SETUP + 2 * 16 * steps, (inside["calls"], split["calls"])


def test_compiled_fsdp_step_runs_its_all_gathers_and_reduce_scatters_inside_its_programs():
    # SimpleFSDP "fully_shard": 16 all_gathers in the forward, 16 reduce_scatters in the
    # backward; the calls left are the eager gradient clipping's norm over the shards (one per
    # rank per step; the counts are the process's, both ranks).
    pytest.importorskip("torchtitan", reason="SimpleFSDP is TorchTitan's (scripts/setup.sh installs it)")
    inside, split = _check("fully_shard")
    steps = len(inside["reference"])
    assert inside["collectives_in_programs"] == 2 * 32 * steps
    assert inside["calls"] == SETUP + 2 * steps and split["calls"] == SETUP + 2 * 33 * steps, (inside["calls"],
                                                                                           split["calls"])


def test_fsdp2_with_tensor_parallel_on_a_2d_mesh_of_ranks_as_threads():
    # A 2 x 2 DeviceMesh over 4 threads: its dimension groups are groups of threads too.
    inside = _result(_run("fsdp2_tp", devices=4))
    split = _result(_run("fsdp2_tp", in_program=False, devices=4))
    ref = torch.tensor(inside["reference"])
    for res in (inside, split):
        for losses in res["ranks"]:
            torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-4, atol=1e-5)
    # TP's all_reduces inside the programs; FSDP2's collectives are calls.
    steps = len(ref)
    assert inside["collectives_in_programs"] == 4 * 4 * steps, inside["collectives_in_programs"]
    assert split["collectives_in_programs"] == 0
    assert all(s["dist_xla_collectives"] > 0 for rank in inside["steps"] for s in rank)


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_collectives_share_one_program_per_rank(tmp_path):
    # TorchTitan's composition (TP + sequence parallel over "tp", SimpleFSDP over "dp", clipping
    # and foreach AdamW) on a 2 x 2 mesh of ranks as threads: each rank's forward and backward
    # each hold collectives of both groups, each over its own pair of devices.
    pytest.importorskip("torchtitan", reason="SimpleFSDP is TorchTitan's (scripts/setup.sh installs it)")
    dump = tmp_path / "xla"
    inside = _result(_run("simple_fsdp_tp", devices=4, env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}))
    split = _result(_run("simple_fsdp_tp", in_program=False, devices=4))
    ref = torch.tensor(inside["reference"])
    for res in (inside, split):
        for losses in res["ranks"]:
            torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(inside["ranks"]), torch.tensor(split["ranks"]), rtol=1e-4, atol=1e-5)
    steps, ranks = len(ref), 4
    assert inside["replicated_programs"] == ranks * 2 * steps, inside["replicated_programs"]
    assert split["replicated_programs"] == 0 and split["collectives_in_programs"] == 0
    # Each collective inside a program is one call fewer than in the split run; the calls left
    # are the set-up's and the eager clipping's.
    assert inside["collectives_in_programs"] > 0
    assert split["calls"] - inside["calls"] == inside["collectives_in_programs"], (split["calls"], inside["calls"])
    assert len(_programs_over_both_groups(dump)) >= 2, sorted(p.name for p in dump.glob("*before_optimizations.txt"))


def _programs_over_both_groups(dump):
    """What XLA compiled: programs whose collectives run over the tp pairs and the dp pairs."""
    both = []
    for hlo in dump.glob("*torch_tpu.before_optimizations.txt"):
        text = hlo.read_text()
        if "replica_groups={{0,1},{2,3}}" in text and "replica_groups={{0,2},{1,3}}" in text:
            both.append(hlo.name)
    return both


def _check_titan(res, ranks=4):
    ref = torch.tensor(res["reference"])
    for losses in res["ranks"]:
        torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-4, atol=1e-5)
    return len(ref), ranks


FUSED = {"TORCH_TPU_DEFER_AND_FUSE": "1"}


def _one_program_per_step(res, ranks):
    """Fused eager: after the first two steps (recording, then the first step of calls), each
    step is one launch per rank, every collective inside it, none a call between programs.
    The counts are the process's (all ranks'), taken around each step by rank 0: the median,
    since another rank's launch may fall just before or after rank 0's window."""
    later = res["steps"][0][2:]
    for key in ("executions", "replicated_programs"):
        assert statistics.median(s[key] for s in later) == ranks, later
    assert all(s["dist_xla_collectives"] == 0 and s["collectives_in_programs"] > 0 for s in later), later


@pytest.mark.parametrize("mode", ["sp", "fully_shard"])
def test_fused_eager_runs_a_compiled_step_and_its_optimizer_as_one_program_per_rank(mode):
    # The compiled forward and backward are recorded as calls of their programs into the
    # pending graph, with the eager clipping and foreach AdamW (DTensor's eager collectives
    # among them) after them: TP + sequence parallel, and SimpleFSDP's FSDP.
    if mode == "fully_shard":
        pytest.importorskip("torchtitan", reason="SimpleFSDP is TorchTitan's (scripts/setup.sh installs it)")
    fused = _result(_run(mode, env=FUSED))
    ref = torch.tensor(fused["reference"])
    for losses in fused["ranks"]:
        torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-4, atol=1e-5)
    _one_program_per_step(fused, ranks=2)


def test_fused_eager_collectives_join_the_pending_graph_and_a_missing_rank_raises():
    out = _run("fused_eager", env=FUSED, timeout=240)
    for line in ("eager collectives in the pending graph", "absent rank at the launch", "devices after failures"):
        assert f"ok {line}" in out, out


def test_torchtitan_llama3_fsdp_and_tp_step_is_one_program_per_rank_in_fused_eager(tmp_path):
    # TorchTitan's llama3 debug model, its own TP plan (sequence and loss parallel) over "tp" and
    # graph_trainer's SimpleFSDP over "fsdp", 2 x 2 ranks as threads, against the model on the
    # CPU: forward, backward, clipping and foreach AdamW, 158 collectives, one program, whose
    # collectives run over both groups (XLA's own dump).
    pytest.importorskip("torchtitan", reason="TorchTitan is installed by scripts/setup.sh")
    dump = tmp_path / "xla"
    fused = _result(_run("titan_fsdp_tp", devices=4, timeout=600,
                         env={**FUSED, "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}))
    _check_titan(fused)
    _one_program_per_step(fused, ranks=4)
    assert _programs_over_both_groups(dump), sorted(p.name for p in dump.glob("*before_optimizations.txt"))


@pytest.mark.slow
def test_torchtitan_llama3_fsdp_and_tp_runs_one_program_per_phase_per_rank():
    # The same without fused eager: the compiled forward and backward each one program with
    # its collectives inside; the eager clipping and optimizer run around them.
    pytest.importorskip("torchtitan", reason="TorchTitan is installed by scripts/setup.sh")
    inside = _result(_run("titan_fsdp_tp", devices=4, timeout=600))
    steps, ranks = _check_titan(inside)
    assert inside["replicated_programs"] == ranks * 2 * steps, inside["replicated_programs"]
    assert inside["collectives_in_programs"] >= ranks * 100 * steps, inside["collectives_in_programs"]


@pytest.mark.slow
def test_torchtitan_llama3_fsdp_and_tp_split_equals_inside():
    pytest.importorskip("torchtitan", reason="TorchTitan is installed by scripts/setup.sh")
    inside = _result(_run("titan_fsdp_tp", devices=4, timeout=600))
    split = _result(_run("titan_fsdp_tp", in_program=False, devices=4, timeout=600))
    _check_titan(split)
    torch.testing.assert_close(torch.tensor(inside["ranks"]), torch.tensor(split["ranks"]), rtol=1e-4, atol=1e-5)
    assert split["replicated_programs"] == 0
    assert split["calls"] - inside["calls"] == inside["collectives_in_programs"], (split["calls"], inside["calls"])


def test_split_collective_on_a_graph_input_sees_its_new_values():
    assert "ok split collective on a graph input" in _run("split_inputs", in_program=False)


def test_collectives_that_stay_calls_after_ones_inside_the_same_graph():
    assert "ok calls after collectives inside" in _run("calls_after_inside", timeout=240)


@pytest.mark.slow
def test_sequence_parallel_step_with_clipping_and_foreach():
    _check("sp")


def test_absent_and_mismatched_ranks_raise_and_devices_keep_working():
    out = _run("failures", timeout=240)
    for line in ("absent rank", "mismatched collectives", "devices after failures"):
        assert f"ok {line}" in out, out
