"""torch_tpu.scale: the training step traced without compute (FakeTensorMode, a fake process
group of 8 ranks, FSDP2 and DTensor TP emitting their real collectives), its FLOPs and collective
bytes checked against what the model's shapes imply, the projection's response to the chips'
numbers, and ``torch-tpu bench --project``. docs/scale.md has the tables."""

import json
import os
import subprocess
import sys

import pytest

from torch_tpu import bench, scale

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZE = "small"  # the bench's gpt:small: 4 blocks, 8 heads, width 256, vocab 256
SEQ = 256


@pytest.fixture(scope="module")
def gpt_trace():
    return scale.trace(scale.model_spec(f"gpt:{SIZE}", seq_len=SEQ), dp=8)


def _gpt_shapes():
    from torch_tpu._bench_worker import GPT_SIZES

    cfg = GPT_SIZES[SIZE]
    return cfg["n_layer"], cfg["n_head"], cfg["n_embd"]


def _real_gpt():
    from torch_tpu._bench_worker import GPT_SIZES
    from torch_tpu.models import GPT

    return GPT(256, block_size=SEQ, dropout=0.0, **GPT_SIZES[SIZE])


def test_flops_equal_the_analytic_count(gpt_trace):
    import torch.nn as nn

    model = _real_gpt()
    L, H, D = _gpt_shapes()
    T = SEQ  # one sequence per rank
    # Exact: every Linear (the tied lm_head once) is 2*in*out FLOPs per token forward, 3x for a
    # training step; attention QK^T and PV 4*S*D per token per layer forward, 3x likewise.
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    exact = 3 * (2 * T * linear + L * 4 * T * SEQ * D)
    assert gpt_trace.flops() == pytest.approx(exact, rel=1e-3)
    # The usual estimate: 6 * params * tokens (without the position table) + attention.
    params = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    assert gpt_trace.flops() == pytest.approx(6 * params * T + 12 * L * D * SEQ * T, rel=0.03)
    # As traced, attention's backward also recomputes the scores (PyTorch's flop counter).
    assert gpt_trace.flops(model=False) > gpt_trace.flops()
    # Linear in the batch: the second trace (2 sequences) fits the first.
    assert gpt_trace.flops(2) == pytest.approx(2 * gpt_trace.flops(1), rel=1e-6)


def test_fsdp_collectives_move_the_parameter_bytes(gpt_trace):
    model = _real_gpt()
    total = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    blocks = sum(p.numel() for p in model.blocks.parameters())
    colls = gpt_trace.collectives()
    by = {}
    for phase, source, kind, dim, g, S, _ in colls:
        assert (source, dim, g) == ("fsdp", "dp", 8)
        by[(phase, kind)] = by.get((phase, kind), 0) + S
    # FSDP2 with bf16 parameters and fp32 reductions: every unit gathered in bf16 for the
    # forward; the blocks (resharded after forward) again for the backward; every gradient
    # reduce-scattered in fp32 once.
    assert by == {("fw", "all_gather"): 2 * total, ("bw", "all_gather"): 2 * blocks,
                  ("bw", "reduce_scatter"): 4 * total}
    # Per rank at N: (N-1)/N of the full tensor for all-gather and reduce-scatter.
    chip = scale.CHIPS["v5p"]
    for n in (8, 256):
        _, per_rank = scale.collective_time(chip, "all_gather", 2 * total, n, n, n)
        assert per_rank == pytest.approx((n - 1) / n * 2 * total)
    _, ar = scale.collective_time(chip, "all_reduce", 1000, 4, 4, 4)
    assert ar == pytest.approx(2 * 3 / 4 * 1000)
    # The sharded state per rank: fp32 parameters and gradients, AdamW's two moments.
    assert gpt_trace.state == {"params": 4 * total // 8, "grads": 4 * total // 8, "optimizer": 8 * total // 8}


def test_cutting_ici_bandwidth_slows_the_step(gpt_trace):
    base = scale.project(gpt_trace, "v5p", 256)
    cut = scale.project(gpt_trace, "v5p", 256, ici_scale=0.1)
    assert cut["step_s"] > base["step_s"]
    assert cut["exposed_comm_s"] > base["exposed_comm_s"]
    assert cut["compute_s"] == pytest.approx(base["compute_s"])
    assert cut["mfu"] < base["mfu"]
    # A faster chip computes sooner; more chips shard the state thinner.
    assert scale.project(gpt_trace, "v7x", 256)["compute_s"] < base["compute_s"]
    assert scale.project(gpt_trace, "v5p", 8)["memory_gib"] > base["memory_gib"]
    # HSDP: FSDP groups of 8, the replicas all-reduce the shards.
    hsdp = scale.project(gpt_trace, "v5p", 256, dp_shard=8)
    assert hsdp["replicas"] == 32 and "HSDP all-reduce (dp_replicate)" in hsdp["collective_s"]
    with pytest.raises(ValueError, match="multiple"):
        scale.project(gpt_trace, "v5p", 256, global_batch=100)


def test_tensor_parallel_collectives_are_traced():
    tr = scale.trace(scale.model_spec("titan:llama3:debugmodel", seq_len=256, tp=2))
    kinds = {(source, kind, dim, g) for _, source, kind, dim, g, _, _ in tr.collectives()}
    assert ("tp", "all_gather", "tp", 2) in kinds and ("tp", "reduce_scatter", "tp", 2) in kinds
    assert ("fsdp", "all_gather", "dp", 2) in kinds and ("fsdp", "reduce_scatter", "dp", 2) in kinds
    r = scale.project(tr, "v5p", 8)
    assert (r["tp"], r["dp"]) == (2, 4)
    slow = scale.project(tr, "v5p", 8, ici_scale=0.01)
    # TP collectives sit on the critical path: a slower ICI lengthens the step by at least
    # the extra time of the TP collectives alone.
    extra = sum(v for k, v in slow["collective_s"].items() if k.startswith("TP")) - \
        sum(v for k, v in r["collective_s"].items() if k.startswith("TP"))
    assert extra > 0 and slow["step_s"] - r["step_s"] >= extra * 0.999


@pytest.mark.parametrize("spec,words", [("v9:8", "unknown chip"), ("v5p:0", "at least 1"),
                                        ("v5p", "CHIP:N"), ("v5p:many", "whole number")])
def test_bad_project_is_a_value_error(spec, words, capsys):
    with pytest.raises(ValueError, match=words):
        scale.parse_project(spec)
    assert bench.main(["--project", spec]) == 2
    assert words in capsys.readouterr().err


def test_parse_project_reads_chip_and_count():
    assert scale.parse_project("v5p:256") == ("v5p", 256)
    assert scale.parse_project("TPU7x:8192") == ("v7x", 8192)


def test_bench_project_cli_writes_json(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "torch_tpu", "bench", "--model", "gpt:tiny", "--seq-len", "64",
                        "--project", "v5p:8", "--project", "v7x:8192", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not a measurement" in r.stdout and "v7x" in r.stdout
    data = json.loads((tmp_path / "projection.json").read_text())
    assert [(row["chip"], row["chips"]) for row in data["rows"]] == [("v5p", 8), ("v7x", 8192)]
    for row in data["rows"]:
        assert row["step_s"] > 0 and 0 < row["mfu"] < 1 and row["dominant_collective"].startswith("FSDP")
    assert data["trace"]["collectives"]["fw fsdp all_gather (dp)"]["group_size_at_trace"] == 8
