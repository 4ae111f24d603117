"""A DLRM (TorchRec's) trained for a few steps under DistributedModelParallel, with the
sharding plan TorchRec's own planner makes for the compute device, on tpu and on the CPU.

    torchrun --nproc-per-node N torchrec_dlrm.py OUT.json CONFIG...

Each CONFIG is DEVICE:SHARDING:KERNEL (tpu|cpu, table_wise|row_wise, fused|unfused_tpu); the
planner picks the plan within that sharding type and kernel ("fused" is its default, FBGEMM's
table-batched embedding with the optimizer in the backward). Every configuration starts from the
same weights and trains on the same global batches, each rank on its share; rank 0 writes the
global loss of each step per configuration to OUT.json. The test compares 2 ranks with 1 and tpu
with the CPU.
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import torch_tpu

torch_tpu.set_fallback("error")

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints  # noqa: E402
from torchrec.distributed.types import ShardingEnv  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.optim.keyed import KeyedOptimizerWrapper  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402

OUT, CONFIGS = sys.argv[1], sys.argv[2:]
STEPS, BATCH, DENSE, LR = 4, 8, 8, 0.1  # BATCH: the global batch
TABLES = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=rows, feature_names=[f"f{i}"])
          for i, rows in enumerate((64, 100, 40))]
KEYS = [t.feature_names[0] for t in TABLES]

dist.init_process_group("cpu:gloo,tpu:tpu_dist", timeout=datetime.timedelta(seconds=180))
rank, world = dist.get_rank(), dist.get_world_size()
local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
GLOO = dist.new_group(backend="gloo")  # the losses are summed over ranks on the CPU


def model(device):
    return DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=TABLES, device=device), dense_in_features=DENSE,
                dense_arch_layer_sizes=[16, 16], over_arch_layer_sizes=[16, 1], dense_device=device)


torch.manual_seed(0)
REFERENCE = {k: v.clone() for k, v in model(torch.device("cpu")).state_dict().items()}


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        dense = torch.randn(BATCH, DENSE, generator=g)
        lengths = torch.randint(0, 4, (len(KEYS), BATCH), generator=g)
        values = [torch.randint(0, t.num_embeddings, (int(lengths[i].sum()),), generator=g)
                  for i, t in enumerate(TABLES)]
        labels = torch.randint(0, 2, (BATCH,), generator=g).float()
        yield dense, lengths, values, labels


def local_batch(dense, lengths, values, labels, device):
    """This rank's samples: dense rows, a KeyedJaggedTensor of its ids, labels."""
    vals, lens = [], []
    for i in range(len(KEYS)):
        off = torch.cat([torch.zeros(1, dtype=torch.long), lengths[i].cumsum(0)])
        vals.append(values[i][off[local.start]:off[local.stop]])
        lens.append(lengths[i][local])
    kjt = KeyedJaggedTensor(keys=KEYS, values=torch.cat(vals).to(device), lengths=torch.cat(lens).to(device))
    return dense[local].to(device), kjt, labels[local].to(device)


@torch.no_grad()
def load_reference(m):
    """The reference weights, each rank copying its shards (into FBGEMM's buffers where fused)."""
    for name, value in m.state_dict().items():
        full = REFERENCE[name]
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                idx = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
                shard.tensor.copy_(full[idx])
        else:
            value.copy_(full)


def train(device_type, sharding, kernel):
    # TorchRec places rank r's shards on device index LOCAL_RANK: tpu:r exists where the test
    # gives each process TORCH_TPU_CPU_DEVICES=2.
    device = torch.device("tpu", int(os.environ.get("LOCAL_RANK", 0))) if device_type == "tpu" else torch.device("cpu")
    pg = dist.new_group(backend="gloo" if device_type == "cpu" else "tpu_dist")
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding], compute_kernels=[kernel]) for t in TABLES}
    unsharded = model(torch.device("meta"))
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device=device_type),
                                    constraints=constraints).collective_plan(unsharded, [sharder], pg)
    m = DistributedModelParallel(unsharded, env=ShardingEnv.from_process_group(pg), device=device, plan=plan,
                                 sharders=[sharder])
    load_reference(m)
    params = dict(in_backward_optimizer_filter(m.named_parameters()))
    opt = KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=LR))
    dense_params = [p for n, p in params.items() if "embedding_bag" not in n]
    losses = []
    for dense, lengths, values, labels in batches():
        x, kjt, y = local_batch(dense, lengths, values, labels, device)
        logits = m(x, kjt).squeeze(-1)
        # Each rank's share of the global mean; the sparse gradients sum over ranks in the
        # all-to-all's backward, the dense ones are averaged by DDP: scaled back by the world size.
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="sum") / BATCH
        opt.zero_grad()
        loss.backward()
        for p in dense_params:
            if p.grad is not None:
                p.grad.mul_(world)
        opt.step()
        total = loss.detach().cpu()
        dist.all_reduce(total, group=GLOO)
        losses.append(float(total))
    fallbacks = dict(torch_tpu.metrics()["fallbacks"])
    chosen = sorted({(o.sharding_type, o.compute_kernel) for tables in plan.plan.values() for o in tables.values()})
    return {"losses": losses, "plan": chosen, "fallbacks": fallbacks}


results = {}
for config in CONFIGS:
    results[config] = train(*config.split(":"))
if rank == 0:
    with open(OUT, "w") as f:
        json.dump(results, f)
dist.destroy_process_group()
