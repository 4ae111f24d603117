"""Under torchrun, 2 ranks: the key-value store a multi-process plugin's client is created
with (the CUDA plugin calls it to exchange its topology and NCCL ids) reaches the other
process through torchrun's store; and on the CPU plugin, which has no cross-process
collectives, tpu_dist stages through the host, or refuses when told to use XLA."""

import datetime
import os
import time

import torch
import torch.distributed as dist

import torch_tpu
from torch_tpu import _C

rank = int(os.environ["RANK"])
span = _C._process_span()
assert span is not None, "torchrun's environment should give a process span"
process_id, process_count, kv = span
assert (process_id, process_count) == (rank, 2), span

# What the plugin does at creation: every node publishes, then reads the others'.
mine = b"node\x00" + bytes([rank])
kv.put(f"topology/{rank}", mine)
theirs = kv.get(f"topology/{1 - rank}", datetime.timedelta(seconds=60))
assert theirs == b"node\x00" + bytes([1 - rank]), theirs
assert kv.try_get(f"topology/{rank}") == mine
assert kv.try_get("never/set") is None
start = time.monotonic()
try:
    kv.get("never/set", datetime.timedelta(milliseconds=300))
    raise AssertionError("a get of a key nobody sets returned")
except RuntimeError as e:
    assert "did not appear in the c10d store within 300 ms" in str(e), e
assert time.monotonic() - start < 30
print(f"rank {rank}: key-value store ok")

os.environ["TORCH_TPU_DIST_TRANSPORT"] = "staged"
assert _C._process_span() is None
os.environ["TORCH_TPU_DIST_TRANSPORT"] = "nccl"
try:
    _C._process_span()
    raise AssertionError("an unknown transport was accepted")
except ValueError as e:
    assert "must be auto, xla or staged" in str(e), e

# The CPU plugin's client never spans processes: XLA asked for is an error, auto stages.
assert not _C._client_spans_processes()
assert _C._device_global_id(0) == 0
os.environ["TORCH_TPU_DIST_TRANSPORT"] = "xla"
try:
    torch_tpu.distributed._transport()
    raise AssertionError("TORCH_TPU_DIST_TRANSPORT=xla was accepted on the CPU plugin")
except RuntimeError as e:
    assert "does not span this job's processes" in str(e), e
os.environ["TORCH_TPU_DIST_TRANSPORT"] = "auto"
dist.init_process_group(timeout=datetime.timedelta(seconds=60))
t = torch.full((3,), float(rank + 1), device="tpu")
before = torch_tpu.metrics()["dist_staged_bytes"]
dist.all_reduce(t)
assert t.cpu().tolist() == [3.0, 3.0, 3.0], t
assert torch_tpu.metrics()["dist_staged_bytes"] > before
dist.destroy_process_group()
print(f"rank {rank}: transport choice ok")
