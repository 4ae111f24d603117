"""The project's GPT trained for a few steps with a parallelism over 2 ranks on tpu,
against the same model trained in this process without it, on the same global batch.

    torchrun --nproc-per-node 2 train.py ddp|fsdp2|tp|pp [compile]

With "compile", both sides run the model under torch.compile(backend="tpu").
"""

import datetime
import sys

import torch
import torch.distributed as dist

import torch_tpu
from torch_tpu.models import GPT

MODE = sys.argv[1]
COMPILE = "compile" in sys.argv[2:]
STEPS = 5
# Gradient clipping over a mix of DTensor and plain parameters is refused by PyTorch itself
# (aten._foreach_norm); tensor parallelism trains without it, on both sides.
CLIP = MODE not in ("tp", "pp")  # pp: the stages' norms would need a collective of their own
torch_tpu.set_fallback("error")
# DDP is ported from CUDA as users write it: no backend named (tpu_dist for tpu tensors, and
# the group's default backend, as nccl is on CUDA). The others name gloo for CPU tensors too.
BACKEND = None if MODE == "ddp" else "cpu:gloo,tpu:tpu_dist"
dist.init_process_group(BACKEND, timeout=datetime.timedelta(seconds=120))
rank, size = dist.get_rank(), dist.get_world_size()
VOCAB, BLOCK, BATCH = 32, 16, 4  # BATCH per rank; the global batch is BATCH * size


def model():
    torch.manual_seed(0)
    # Untied for pipelining: the embedding and the head live on different stages.
    return GPT(VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, dropout=0.0, tie_weights=MODE != "pp")


class FirstStage(torch.nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.tok_emb, self.pos_emb, self.block = gpt.tok_emb, gpt.pos_emb, gpt.blocks[0]

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.block(self.tok_emb(idx) + self.pos_emb(pos))


class LastStage(torch.nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.block, self.ln_f, self.lm_head = gpt.blocks[1], gpt.ln_f, gpt.lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(self.block(x)))


def pipeline():
    """Two stages (rank 0: embeddings and block 0; rank 1: block 1 and the head), GPipe over
    2 micro-batches of the global batch."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    gpt = model()
    stage_mod = (FirstStage if rank == 0 else LastStage)(gpt).to("tpu")
    stage = PipelineStage(stage_mod, rank, size, torch.device("tpu"))

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-2)
    losses = []
    for d in data:
        d = d.to("tpu")
        opt.zero_grad()
        if rank == 0:
            schedule.step(d[:, :-1])
            loss = torch.zeros((), device="tpu")
        else:
            mb_losses = []
            schedule.step(target=d[:, 1:], losses=mb_losses)
            loss = torch.stack(mb_losses).mean().detach()
        opt.step()
        dist.broadcast(loss, src=size - 1)  # the last stage has the loss
        losses.append(loss.item())
    return losses


g = torch.Generator().manual_seed(1)
data = [torch.randint(0, VOCAB, (BATCH * size, BLOCK + 1), generator=g) for _ in range(STEPS)]


def train(m, opt, local, compile=COMPILE):
    """The losses of STEPS steps on `data`; `local`: each rank takes its slice of the global
    batch and the reported loss is the ranks' mean."""
    losses = []
    params = list(m.parameters())
    if compile:
        m = torch.compile(m, backend="tpu")
    for d in data:
        if local:
            d = d[rank * BATCH:(rank + 1) * BATCH]
        d = d.to("tpu")
        _, loss = m(d[:, :-1], d[:, 1:])
        opt.zero_grad()
        loss.backward()
        if CLIP:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss = loss.detach().clone()
        if local:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def reference():
    """Single-process eager training on the global batch: the losses every parallel run must
    give, compiled or not."""
    m = model().to("tpu")
    return train(m, torch.optim.AdamW(m.parameters(), lr=1e-2), local=False, compile=False)


def parallel():
    if MODE == "pp":
        return pipeline()
    if MODE == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        m = DDP(model().to("tpu"))
        local = True
    elif MODE == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        m = model()  # built on the CPU: fully_shard moves it to the mesh's device
        mesh = init_device_mesh("tpu", (size,))
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        local = True
    elif MODE == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        m = model().to("tpu")
        mesh = init_device_mesh("tpu", (size,))
        for block in m.blocks:
            parallelize_module(block.mlp, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        local = False  # every rank sees the whole batch
    else:
        raise SystemExit(f"unknown mode {MODE}")
    # foreach kernels refuse a mix of DTensor and plain parameters (tensor parallelism).
    return train(m, torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=CLIP), local)


want = reference()
got = parallel()
torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
print(f"rank {rank}: {MODE}{' compiled' if COMPILE else ''} ok, losses {[round(v, 4) for v in got]}", flush=True)
dist.destroy_process_group()
