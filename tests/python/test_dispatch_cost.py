"""Guard: what every op pays in the dispatcher is a few hash lookups, not a walk
(issue 59, item 6). csrc/dispatch/dispatcher.cpp works out what depends on the op
alone (its lowering, dtype refusal rows, overlap checks, written arguments) once
per op (OpFacts) and finds it again by one lookup keyed by the op; these tests
count that work with tpu::_dispatch_stats() (deterministic counters, no timing).
The host time per op itself is benchmarks/host_cost.py's (docs/benchmarks.md).
"""

import warnings

import pytest
import torch

import torch_tpu

FIX = ("Per-op work in csrc/dispatch/dispatcher.cpp must go through the op's cached OpFacts "
       "(factsOf/buildFacts): work out what depends on the op alone in buildFacts, and make what "
       "depends on the arguments a hash lookup (see RefusalRows), never a walk over a table.")


def stats():
    return dict(zip(torch.ops.tpu._dispatch_stat_names(), torch.ops.tpu._dispatch_stats()))


def delta(before, after):
    return {k: after[k] - before[k] for k in before}


def workload():
    """Ops of a training step, among them ops with refusal rows (relu, softmax, gelu,
    native_layer_norm, mm), with overlap checks (add_, mul_) and a dtype argument (cumsum)."""
    a = torch.randn(16, 16, device="tpu")
    b = torch.randn(16, 16, device="tpu")
    w = torch.randn(16, device="tpu")
    ops = [
        lambda: a + b,
        lambda: a * 2.5,
        lambda: torch.relu(a),
        lambda: torch.softmax(a, -1),
        lambda: torch.nn.functional.gelu(a),
        lambda: torch.nn.functional.layer_norm(a, (16,), w),
        lambda: a @ b,
        lambda: a.sum(1),
        lambda: a.cumsum(0, dtype=torch.float64),
        lambda: b.add_(a),
        lambda: b.mul_(0.5),
        lambda: torch.floor_divide(a, 2),
    ]
    return ops


def test_per_op_checks_are_lookups():
    ops = workload()
    for fn in ops:  # first sight: each op's facts are worked out here
        fn()
    before = stats()
    for _ in range(20):
        for fn in ops:
            fn()
    torch.tpu.synchronize()
    d = delta(before, stats())
    assert d["ops"] >= 20 * len(ops), d
    assert d["facts_built"] == 0, f"ops seen before had their facts worked out again: {d}. {FIX}"
    assert d["table_reads"] == 0, f"the dispatcher read its global tables per op: {d}. {FIX}"
    assert d["facts_lookups"] == d["ops"], f"not one facts lookup per op: {d}. {FIX}"
    # An op with refusal rows: at most 3 lookups in its overload's rows and 2 in its base op's.
    assert d["refusal_probes"] <= 5 * d["ops"], f"refusal checks cost more than lookups: {d}. {FIX}"
    assert d["refusal_probes"] > 0, d  # the workload has ops with rows: the check ran
    assert d["strict_ops"] + d["fused_ops"] + d["fallback_ops"] == d["ops"], d
    assert d["fallback_ops"] == 0, d


def test_table_changes_are_seen():
    a = torch.randn(8, device="tpu")
    torch.relu(a)
    before = stats()
    previous = "error" if torch_tpu._C._fallback_is_error() else "warn"
    torch_tpu.set_fallback("warn")
    try:
        with torch_tpu.lowerings_disabled("relu"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = torch.relu(a)  # the CPU fallback now: the facts were worked out again
    finally:
        torch_tpu.set_fallback(previous)
    after = stats()
    assert delta(before, after)["facts_built"] >= 1 and delta(before, after)["fallback_ops"] == 1
    torch.testing.assert_close(r.cpu(), torch.relu(a.cpu()))
    torch.relu(a)
    assert delta(after, stats())["fallback_ops"] == 0  # and back on tpu once turned on again


def test_dispatch_timing_counts_host_time():
    a = torch.randn(8, 8, device="tpu")
    a + a
    was = torch.ops.tpu._dispatch_timing(True)
    try:
        before = stats()
        for _ in range(10):
            a + a
        d = delta(before, stats())
    finally:
        torch.ops.tpu._dispatch_timing(was)
    assert d["dispatch_ns"] > 0 and d["strict_ns"] + d["fused_ns"] > 0, d
    before = stats()
    a + a
    d = delta(before, stats())
    assert d["dispatch_ns"] == 0 and d["strict_ns"] == 0 and d["fused_ns"] == 0, d  # off: no clock reads


def test_small_fills_compile_nothing_and_kept_buffers_do_not_leak():
    # Strict eager uploads a whole small tensor's fill (zeros, ones_like, full, fill_) instead of
    # compiling a program per shape; the buffers are kept and handed out again once free.
    fused = torch_tpu._C._fused()
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
              torch.uint8, torch.bool]
    before = torch_tpu.metrics()
    for dt in dtypes:
        for shape, value in [((3, 5), 0), ((7,), 1), ((2, 3, 4), 3), ((), 1)]:
            t = torch.full(shape, value, dtype=dt, device="tpu")
            torch.testing.assert_close(t.cpu(), torch.full(shape, value, dtype=dt))
    t = torch.empty(6, 4, device="tpu").fill_(2.5)
    torch.testing.assert_close(t.cpu(), torch.full((6, 4), 2.5))
    torch.testing.assert_close(torch.ones_like(t).cpu(), torch.ones(6, 4))
    after = torch_tpu.metrics()
    if not fused:
        fills = {k: v for k, v in after["compiles_by_op"].items()
                 if k in ("aten::fill_", "aten::zero_") and v != before["compiles_by_op"].get(k, 0)}
        assert not fills, f"small fills compiled programs: {fills}"
    # A holder's updates never reach the kept buffer, nor another holder.
    a = torch.zeros(64, 64, device="tpu")
    del a
    a = torch.zeros(64, 64, device="tpu")  # the kept buffer, handed out again
    b = torch.zeros(64, 64, device="tpu")  # `a` holds it: b gets its own
    a.add_(1)
    b.mul_(3).add_(2)
    c = torch.zeros(64, 64, device="tpu")
    c[0, :5] = 7.0  # a partial write over the kept buffer
    d = torch.zeros(64, 64, device="tpu")
    want_c = torch.zeros(64, 64)
    want_c[0, :5] = 7.0
    torch.testing.assert_close(a.cpu(), torch.ones(64, 64))
    torch.testing.assert_close(b.cpu(), torch.full((64, 64), 2.0))
    torch.testing.assert_close(c.cpu(), want_c)
    torch.testing.assert_close(d.cpu(), torch.zeros(64, 64))
    # Views and big tensors take the programs' path, and still fill right.
    big = torch.zeros(300, 1024, device="tpu")
    big[10:20].fill_(4.0)
    want = torch.zeros(300, 1024)
    want[10:20] = 4.0
    torch.testing.assert_close(big.cpu(), want)
    with pytest.raises(RuntimeError):
        torch.zeros(4, dtype=torch.uint8, device="tpu").fill_(300)  # the value must fit, as on the CPU
