"""torch.distributed.checkpoint with tpu tensors: an FSDP2 model sharded over 2 ranks is
saved, then loaded into a differently sharded model on 2 ranks (each rank's parameters
split the other way) and, by test_distributed.py, into one process.

    torchrun --nproc-per-node 2 checkpoint.py DIR        # save, then reshard-load
    python checkpoint.py DIR --single                      # load into one process
"""

import datetime
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import torch_tpu
from torch_tpu.models import GPT

DIR = sys.argv[1]
torch_tpu.set_fallback("error")


def model(seed):
    torch.manual_seed(seed)
    return GPT(32, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def expected():
    """The full state of the saved model: seed 0, trained one step on fixed data."""
    m = model(0).to("tpu")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    d = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(1)).to("tpu")
    m(d[:, :-1], d[:, 1:])[1].backward()
    opt.step()
    return {k: v.detach().cpu() for k, v in m.state_dict().items()}


if "--single" in sys.argv:
    m = model(1).to("tpu")
    state = m.state_dict()
    dcp.load(state, checkpoint_id=DIR)  # no process group: one process reads every shard
    m.load_state_dict(state)
    want = expected()
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v.cpu(), want[k], rtol=0, atol=0, msg=lambda s, k=k: f"{k}: {s}")
    print("single: ok", flush=True)
    raise SystemExit(0)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

dist.init_process_group(timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
mesh = init_device_mesh("tpu", (2,))

m = model(0)
fully_shard(m, mesh=mesh)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
d = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(1)).to("tpu")
m(d[:, :-1], d[:, 1:])[1].backward()  # the same step as expected(), on the full batch
opt.step()
dcp.save(m.state_dict(), checkpoint_id=DIR)

# Another sharding: parameters split along their last dimension (where it divides), and a
# different model to load into.
other = model(1)
fully_shard(other, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1) if p.shape[-1] % 2 == 0 else Shard(0))
state = other.state_dict()
dcp.load(state, checkpoint_id=DIR)
other.load_state_dict(state)
want = expected()
for k, v in other.state_dict().items():
    full = v.full_tensor() if isinstance(v, DTensor) else v
    torch.testing.assert_close(full.cpu(), want[k], rtol=0, atol=0, msg=lambda s, k=k: f"{k}: {s}")
print(f"rank {rank}: resharded load ok", flush=True)
dist.destroy_process_group()
