"""Under torchrun on a GPU machine (scripts/gpu_check.sh runs it): does the CUDA plugin's
client span torchrun's processes through torch_tpu's key-value bridge, and does one
all_reduce run as an XLA (NCCL) collective across them?

    TORCH_TPU_PLUGIN=cuda TORCH_TPU_DIST_TRANSPORT=xla torchrun --nproc-per-node N scripts/gpu_dist_span.py

With fewer GPUs than processes the ranks share a GPU, which NCCL refuses: the client's
creation (the topology exchanged through the store) is still checked, and the collective's
error is printed."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
import torch_tpu  # noqa: E402
from torch_tpu import _C  # noqa: E402

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank)) % torch.tpu.device_count()
torch.tpu.set_device(local)
print(f"rank {rank}: spans processes {_C._client_spans_processes()}, local devices {torch.tpu.device_count()}, "
      f"global id of tpu:{local} {_C._device_global_id(local)}", flush=True)
dist.init_process_group(timeout=datetime.timedelta(seconds=60))
t = torch.full((1024,), float(rank + 1), device="tpu")
try:
    dist.all_reduce(t)
    ok = t.cpu().eq(world * (world + 1) / 2).all().item()
    m = torch_tpu.metrics()
    how = "as an XLA collective" if m["dist_xla_collectives"] else "staged through the host"
    print(f"rank {rank}: all_reduce {how} {'correct' if ok else 'WRONG'} (dist_xla_bytes {m['dist_xla_bytes']}, "
          f"dist_staged_bytes {m['dist_staged_bytes']})", flush=True)
except RuntimeError as e:
    print(f"rank {rank}: all_reduce raised: {str(e)[:400]}", flush=True)
dist.destroy_process_group()
