"""The staged transport (csrc/distributed/staging.cpp) against gloo on CPU tensors of the same
values: every collective it runs itself, at sizes on both sides of the inline limit (64 KiB),
in several chunks of 1 MiB, and past 4 MiB (all_reduce's two rounds); several dtypes; views as
inputs and outputs; its pool of host blocks reused and emptied; a mismatch raising on both
ranks, the group usable after. Run by test_staging.py under torchrun (2 processes)."""

import datetime
import sys
import time

import torch
import torch.distributed as dist

import torch_tpu

torch_tpu.set_fallback("error")
dist.init_process_group("cpu:gloo,tpu:tpu_dist", timeout=datetime.timedelta(seconds=60))
rank, size = dist.get_rank(), dist.get_world_size()
stats = torch_tpu._C._tpu_dist_staging_stats
checked = []

# 7 elements; 64 KiB of float32 exactly (inline) and one element more (chunked); 2.5 MiB + 3
# elements of float32 (3 chunks a segment, segments of unequal length).
SIZES = (7, 16384, 16385, 655363)
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.float16)


def values(dtype, numel, seed):
    """Each rank's own: floats of either sign, or small integers (int8 sums stay in range)."""
    g = torch.Generator().manual_seed(seed + 1009 * rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float32).mul(4).to(dtype)
    return torch.randint(-30, 30, (numel,), generator=g).to(dtype)


def same(name, got, want):
    """tpu_dist's result (a tpu tensor) holds exactly gloo's."""
    checked.append(name)
    assert got.device.type == "tpu", (name, got.device)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


for dtype in DTYPES:
    for numel in SIZES:
        if dtype == torch.int8 and numel > 16385:
            continue  # keeps the run short
        tag = f"[{dtype}, {numel}]"
        x = values(dtype, numel, 1)
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG]
        if not dtype.is_floating_point:
            ops.append(dist.ReduceOp.BXOR)
        for op in ops:
            ref = x.clone()
            if op == dist.ReduceOp.AVG:
                dist.all_reduce(ref)
                ref = ref.div(size, rounding_mode="trunc") if not dtype.is_floating_point else ref / size
            else:
                dist.all_reduce(ref, op)
            t = x.to("tpu")
            dist.all_reduce(t, op)
            same(f"all_reduce {op}{tag}", t, ref)
        if dtype.is_floating_point:
            ref = x.clone() * 0.5
            dist.all_reduce(ref)
            t = x.to("tpu")
            dist.all_reduce(t, dist._make_nccl_premul_sum(0.5))
            same(f"all_reduce PREMUL_SUM{tag}", t, ref)

        # all_gather_into_tensor and the list form
        ref = torch.empty(numel * size, dtype=dtype)
        dist.all_gather_into_tensor(ref, x)
        out = torch.zeros(numel * size, dtype=dtype, device="tpu")
        dist.all_gather_into_tensor(out, x.to("tpu"))
        same(f"all_gather_into_tensor{tag}", out, ref)
        outs = [torch.zeros(numel, dtype=dtype, device="tpu") for _ in range(size)]
        dist.all_gather(outs, x.to("tpu"))
        for r in range(size):
            same(f"all_gather[{r}]{tag}", outs[r], ref[r * numel:(r + 1) * numel])

        # reduce_scatter_tensor (SUM, AVG) and the list form
        big = values(dtype, numel * size, 2)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            ref = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(ref, big.clone())
            if op == dist.ReduceOp.AVG:
                ref = ref.div(size, rounding_mode="trunc") if not dtype.is_floating_point else ref / size
            out = torch.zeros(numel, dtype=dtype, device="tpu")
            dist.reduce_scatter_tensor(out, big.to("tpu"), op=op)
            same(f"reduce_scatter_tensor {op}{tag}", out, ref)
        parts = list(big.chunk(size))
        ref = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter(ref, [p.clone() for p in parts])
        out = torch.zeros(numel, dtype=dtype, device="tpu")
        dist.reduce_scatter(out, [p.to("tpu") for p in parts])
        same(f"reduce_scatter{tag}", out, ref)

        ref = x.clone()
        dist.broadcast(ref, src=1)
        t = x.to("tpu")
        dist.broadcast(t, src=1)
        same(f"broadcast{tag}", t, ref)

# Above 4 MiB a rank, all_reduce reduces in two rounds (segments of unequal length here).
for dtype, op in ((torch.float32, dist.ReduceOp.SUM), (torch.int64, dist.ReduceOp.AVG),
                  (torch.float32, dist.ReduceOp.MIN)):
    x = values(dtype, 1500007, 6)
    ref = x.clone()
    dist.all_reduce(ref, dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op)
    if op == dist.ReduceOp.AVG:
        ref = ref.div(size, rounding_mode="trunc")
    t = x.to("tpu")
    dist.all_reduce(t, op)
    same(f"all_reduce {op} in two rounds[{dtype}]", t, ref)

# Views: a transposed input, a strided output, a slice of a larger tensor.
base = values(torch.float32, 600 * 513, 3).view(600, 513)
ref = base.t().contiguous()
dist.all_reduce(ref)
t = base.to("tpu").t()
assert not t.is_contiguous()
dist.all_reduce(t)
same("all_reduce transposed", t, ref)
src = values(torch.float32, 4096 * 3, 4).view(4096, 3)[:, 1]
ref = torch.empty(4096 * size)
dist.all_gather_into_tensor(ref, src.contiguous())
holder = torch.zeros(4096 * size, 2, device="tpu")
out = holder[:, 0]
dist.all_gather_into_tensor(out, src.to("tpu"))
same("all_gather strided in and out", out, ref)
assert torch.equal(holder[:, 1].cpu(), torch.zeros(4096 * size)), "a strided output wrote past its elements"
whole = values(torch.float32, 300000, 5)
ref = whole[1000:250000].clone()
dist.all_reduce(ref)
t = whole.to("tpu")
dist.all_reduce(t[1000:250000])
same("all_reduce of a slice", t[1000:250000], ref)
same("all_reduce of a slice leaves the rest", torch.cat([t[:1000], t[250000:]]),
     torch.cat([whole[:1000], whole[250000:]]))

# The pool: blocks come back and are handed out again; results are buffers over them.
t = torch.ones(1 << 20, device="tpu")
dist.all_reduce(t)  # a block for the result
dist.all_reduce(t)  # and one for the next (the input holds the first)
before = stats()
for _ in range(5):
    dist.all_reduce(t)
after = stats()
assert after["reuses"] >= before["reuses"] + 5, (before, after)
assert after["allocations"] == before["allocations"], (before, after)
assert after["zero_copy_results"] >= before["zero_copy_results"] + 5, (before, after)
checked.append("pool reused")

# Staged bytes: an all_reduce takes its input to the host and brings its result back.
m0 = torch_tpu.metrics()["dist_staged_bytes"]
dist.all_reduce(t)
assert torch_tpu.metrics()["dist_staged_bytes"] - m0 == 2 * 4 * (1 << 20)
checked.append("staged bytes counted")

# empty_cache frees the free blocks; a result made over a block stays valid, and the block it
# holds goes back to the pool when the result is freed.
kept = torch.full((1 << 18,), float(rank + 1), device="tpu")
dist.all_reduce(kept)
torch.tpu.empty_cache()
assert stats()["cached_blocks"] == 0 and stats()["cached_bytes"] == 0, stats()
for _ in range(3):  # reuses memory; `kept` must not see it
    junk = torch.full((1 << 18,), 7.0, device="tpu")
    dist.all_reduce(junk)
assert torch.equal(kept.cpu(), torch.full((1 << 18,), float(sum(range(1, size + 1))))), "result lost its block"
assert torch.equal((kept * 2).cpu(), torch.full((1 << 18,), 2.0 * sum(range(1, size + 1))))
if torch_tpu.get_mode() != "fused":  # fused eager copies a result into a buffer of its own when its graph runs
    held = stats()["blocks_in_use"]
    del kept
    for _ in range(500):  # the plugin lets go of the buffer (and the block) on its own time
        if stats()["blocks_in_use"] == held - 1:
            break
        time.sleep(0.01)
    assert stats()["blocks_in_use"] == held - 1, (held, stats())
checked.append("empty_cache")

# A mismatch raises on both ranks, chunked (rank 1's payload) against inline (rank 0's); the
# messages announced are taken in, so the group goes on working.
try:
    dist.all_reduce(torch.ones(4 + 300000 * rank, device="tpu"))
    print(f"rank {rank}: no error", flush=True)
    sys.exit(1)
except RuntimeError as e:
    msg = str(e)
    assert "called with different tensors on different ranks" in msg, msg
    assert "Float[4]" in msg and "Float[300004]" in msg, msg
    checked.append("mismatch raises")
t = torch.ones(300000, device="tpu")
dist.all_reduce(t)
same("all_reduce after a mismatch", t, torch.full((300000,), float(size)))

print(f"rank {rank}: staging ok {len(checked)} checks", flush=True)
dist.destroy_process_group()
