"""Collectives inside compiled programs: ranks as threads of one process, each on its
own device (TORCH_TPU_CPU_DEVICES=2), each thread's default group made by
torch_tpu.distributed.init_local_process_group. Run by test_collectives_in_program.py:
`in_program.py MODE` prints one JSON line per result ("result {...}") and "ok ..." lines."""

import copy
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn as nn

import torch_tpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import local  # noqa: E402  (ranks as threads)

torch_tpu.set_fallback("error")
WORLD = 2
STEPS = 5


def run_ranks(fn, timeout=60, world=WORLD):
    """fn(rank) on one thread per rank, each with its default group; returns results or exceptions."""
    return local.run_ranks(lambda r, pg: fn(r), world=world, timeout=timeout, default_group=True)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab=64, d=32, h=64, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (4, 17), generator=g) for _ in range(STEPS)]


def loss_of(model, ids, reduction="mean"):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                                       reduction=reduction)


def train(model, device, data, full=True, loss_fn=loss_of):
    """STEPS AdamW steps, the forward and backward compiled; `full`: gradient clipping and
    foreach (PyTorch refuses _foreach_* over a mix of DTensor and plain parameters)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=full)

    def step(ids):
        loss = loss_fn(model, ids)
        loss.backward()
        return loss

    compiled = torch.compile(step, backend="tpu") if device != "cpu" else step
    losses, per_step = [], []
    for i, ids in enumerate(data):
        m0 = torch_tpu.metrics()
        t0 = time.perf_counter()
        loss = compiled(ids.to(device))
        if full:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        m1 = torch_tpu.metrics()
        per_step.append({"seconds": time.perf_counter() - t0,
                         **{k: m1[k] - m0[k] for k in ("executions", "replicated_programs",
                                                       "collectives_in_programs", "dist_xla_collectives")}})
    return losses, per_step


def tp_plan(sequence_parallel):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        plan = {}
        for i in range(2):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        return plan
    # TorchTitan's plan: activations between the blocks sharded along the sequence.
    plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(2):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def tensor_parallel(sequence_parallel):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    base = Model()
    data = batches()
    ref, _ = train(copy.deepcopy(base), "cpu", data, full=sequence_parallel)

    def rank(r):
        mesh = DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), "tpu")
        model = copy.deepcopy(base).to(f"tpu:{r}")
        parallelize_module(model, mesh, tp_plan(sequence_parallel))
        return train(model, f"tpu:{r}", data, full=sequence_parallel)

    results = run_ranks(rank)
    for res in results:
        if isinstance(res, Exception):
            raise res
    report(ref, [res[0] for res in results], [res[1] for res in results])


def report(reference, losses, steps):
    m = torch_tpu.metrics()
    print("result " + json.dumps({"reference": reference, "ranks": losses, "steps": steps,
                                  "graphs": __import__("torch_tpu._compile").
                                  _compile.compiled_graphs(),
                                  "replicated_programs": m["replicated_programs"],
                                  "collectives_in_programs": m["collectives_in_programs"],
                                  "calls": m["dist_xla_collectives"]}), flush=True)


def data_parallel(mode):
    """TorchTitan's SimpleFSDP (graph_trainer.simple_fsdp.data_parallel): DDP ("replicate") or
    FSDP ("fully_shard") written as DTensor parametrizations, so that the parameters'
    all_gather and the gradients' all_reduce / reduce_scatter are functional collectives in
    the traced forward and backward. Each rank takes half of the batch; its loss is its
    tokens' share of the global mean (the gradients are summed over ranks)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel as simple_fsdp

    torch.manual_seed(0)
    base = Model()
    data = batches()
    ref, _ = train(copy.deepcopy(base), "cpu", data)
    tokens = data[0][:, 1:].numel()

    def rank(r):
        mesh = DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), "tpu")
        model = simple_fsdp(copy.deepcopy(base).to(f"tpu:{r}"), mesh, mode=mode)
        half = [ids[2 * r:2 * r + 2] for ids in data]
        return train(model, f"tpu:{r}", half, loss_fn=lambda m, ids: loss_of(m, ids, reduction="sum") / tokens)

    results = run_ranks(rank)
    for res in results:
        if isinstance(res, Exception):
            raise res
    total = [sum(step) for step in zip(*(res[0] for res in results))]
    report(ref, [total] * WORLD, [res[1] for res in results])


def failures():
    # A rank that never reaches the compiled step's collective: the other raises
    # within the group's timeout, and the process goes on.
    def absent(r):
        def f(x):
            return fc.all_reduce(x * 2, "sum", dist.distributed_c10d._get_default_group()) + 1
        x = torch.ones(4, device=f"tpu:{r}")
        if r == 1:
            return "stayed away"
        return torch.compile(f, backend="tpu")(x).cpu()

    res = run_ranks(absent, timeout=5)
    assert isinstance(res[0], RuntimeError) and "did not reach all_reduce" in str(res[0]), res
    print("ok absent rank", flush=True)

    # Ranks whose compiled steps run different collectives: both raise.
    def mismatched(r):
        def f(x):
            return fc.all_reduce(x, "sum", dist.distributed_c10d._get_default_group())
        # dynamic=False: the ranks' two shapes would otherwise make Dynamo trace sizes symbolic.
        return torch.compile(f, backend="tpu", dynamic=False)(torch.ones(4 + r, device=f"tpu:{r}")).cpu()

    res = run_ranks(mismatched, timeout=10)
    assert all(isinstance(e, RuntimeError) and "disagree" in str(e) for e in res), res
    print("ok mismatched collectives", flush=True)

    # The devices keep working: a step over both afterwards is right.
    def again(r):
        def f(x):
            return fc.all_reduce(x, "sum", dist.distributed_c10d._get_default_group()) * 3
        return torch.compile(f, backend="tpu")(torch.full((3,), float(r + 1), device=f"tpu:{r}")).cpu()

    res = run_ranks(again)
    assert all(torch.equal(t, torch.full((3,), 9.0)) for t in res), res
    print("ok devices after failures", flush=True)


def fsdp2_tp():
    """PyTorch's FSDP2 (fully_shard) over the mesh's "dp" dimension and the colwise/rowwise
    plan over "tp": 4 ranks as threads (TORCH_TPU_CPU_DEVICES=4), a 2 x 2 DeviceMesh whose
    dimension groups are XLA groups of those threads. FSDP2's all_gathers and reduce_scatters
    are calls (its hooks stay outside compiled graphs); the TP all_reduces are inside the
    programs, each over its own pair of devices. A dp rank's loss is its half-batch mean: the
    two halves' mean is the global loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    base = Model()
    data = batches()
    ref, _ = train(copy.deepcopy(base), "cpu", data, full=False)

    def rank(r):
        mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = copy.deepcopy(base).to(f"tpu:{r}")
        parallelize_module(model, mesh["tp"], tp_plan(False))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh["dp"].get_local_rank()
        return train(model, f"tpu:{r}", [ids[2 * dp:2 * dp + 2] for ids in data], full=False)

    results = run_ranks(rank, world=4)
    for res in results:
        if isinstance(res, Exception):
            raise res
    # Ranks 0, 1 hold dp rank 0 (the batch's first half); ranks 2, 3 dp rank 1.
    total = [(a + b) / 2 for a, b in zip(results[0][0], results[2][0])]
    report(ref, [total, [(a + b) / 2 for a, b in zip(results[1][0], results[3][0])]], [res[1] for res in results])


class _PerThread(__import__("collections.abc").abc.MutableMapping):
    """A dict of each thread's own (threading.local underneath)."""

    def __init__(self):
        self._local = threading.local()

    def _d(self):
        if not hasattr(self._local, "d"):
            self._local.d = {}
        return self._local.d

    def __getitem__(self, k):
        return self._d()[k]

    def __setitem__(self, k, v):
        self._d()[k] = v

    def __delitem__(self, k):
        del self._d()[k]

    def __iter__(self):
        return iter(self._d())

    def __len__(self):
        return len(self._d())


def simple_fsdp_classes_per_thread():
    """TorchTitan's SimpleFSDP keeps one wrapper class per module class in the process, its
    parameter properties bound to the first wrapped module's parametrization, and so to that
    rank's dp mesh: with ranks as threads, every rank would gather over rank 0's groups. Each
    thread gets classes of its own."""
    from torchtitan.experiments.graph_trainer import simple_fsdp

    if not isinstance(simple_fsdp._wrap_class_cache, _PerThread):
        simple_fsdp._wrap_class_cache = _PerThread()


def report_dp_halves(reference, results):
    """A 2 x 2 (dp, tp) mesh's results: ranks 0, 1 hold dp rank 0 (the batch's first half),
    ranks 2, 3 dp rank 1; each tp rank's loss is the sum of its two halves'."""
    for res in results:
        if isinstance(res, Exception):
            raise res
    totals = [[a + b for a, b in zip(results[t][0], results[t + 2][0])] for t in (0, 1)]
    report(reference, totals, [res[1] for res in results])


def simple_fsdp_tp(sequence_parallel=True):
    """TorchTitan's FSDP x TP as its graph trainer composes them: the tensor parallel plan over
    the mesh's "tp" dimension, then SimpleFSDP ("fully_shard") over "dp" (parameters sharded over
    both dimensions), 4 ranks as threads. Every collective of the step is a functional one in the
    traced graphs: the all_gathers and reduce_scatters over dp, TP's over tp, in one program."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.experiments.graph_trainer import simple_fsdp as simple_fsdp_module

    torch.manual_seed(0)
    base = Model()
    data = batches()
    ref, _ = train(copy.deepcopy(base), "cpu", data)
    tokens = data[0][:, 1:].numel()
    simple_fsdp_classes_per_thread()

    def rank(r):
        mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = copy.deepcopy(base).to(f"tpu:{r}")
        parallelize_module(model, mesh["tp"], tp_plan(sequence_parallel))
        model = simple_fsdp_module.data_parallel(model, mesh["dp"], mode="fully_shard")
        dp = mesh["dp"].get_local_rank()
        half = [ids[2 * dp:2 * dp + 2] for ids in data]
        return train(model, f"tpu:{r}", half, loss_fn=lambda m, ids: loss_of(m, ids, reduction="sum") / tokens)

    report_dp_halves(ref, run_ranks(rank, world=4))


def titan_fsdp_tp():
    """TorchTitan's llama3 debug model (graph_trainer's, SDPA attention) with TorchTitan's own
    parallelisms over a 2 x 2 mesh of ranks as threads: its tensor parallel plan with sequence
    parallelism and loss parallelism (Module.parallelize over ParallelDims' "tp", the model
    configured for it by update_from_config as TorchTitan's trainer does), then graph_trainer's
    SimpleFSDP over "fsdp" (float32 parameters). Each dp rank takes half of every batch; losses
    against the unparallelized model on the CPU."""
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_dist
    from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp
    from torchtitan.experiments.graph_trainer.llama3 import model_registry

    titan_dist.set_spmd_backend("partial_dtensor")
    cfg = model_registry("debugmodel", attn_backend="sdpa").model
    torch.manual_seed(0)
    base = cfg.build()
    base.init_states(buffer_device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 2048, (4, 65), generator=g) for _ in range(STEPS)]
    tokens = data[0][:, 1:].numel()
    ref, _ = train(copy.deepcopy(base), "cpu", data)
    simple_fsdp_classes_per_thread()
    parallelism = ParallelismConfig(tensor_parallel_degree=2, data_parallel_shard_degree=2,
                                    spmd_backend="partial_dtensor")
    tp_cfg = copy.deepcopy(cfg)
    tp_cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))

    def loss_fn(model, ids):
        logits = model(ids[:, :-1])
        if isinstance(logits, DTensor):  # loss parallel: the vocabulary sharded over tp
            logits = logits.full_tensor()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                                           reduction="sum") / tokens

    def rank(r):
        dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4,
                            spmd_backend="partial_dtensor")
        model = tp_cfg.build()
        model.load_state_dict(base.state_dict())
        model = model.to(f"tpu:{r}")
        model.parallelize(dims)
        model = apply_simple_fsdp(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"))
        dp = dims.get_mesh("fsdp").get_local_rank()
        return train(model, f"tpu:{r}", [ids[2 * dp:2 * dp + 2] for ids in data], loss_fn=loss_fn)

    report_dp_halves(ref, run_ranks(rank, world=4, timeout=120))


def calls_after_collectives_inside():
    """Collectives that must stay calls in a graph whose program already holds one: a bitwise
    reduction, and a group of the same threads whose world lists the devices in another order
    (a program's replicas are one world's). The call reads a value of the program being
    recorded, so that part runs first, launched by every rank without the engine's lock (held,
    it stopped the other rank from launching: XLA:CPU aborted the process after 40 s)."""
    store = dist.HashStore()

    def rank(r):
        first = dist.distributed_c10d._get_default_group()
        second = torch_tpu.distributed.local_group(1 - r, 2, store, devices=[1, 0])
        x = torch.full((4,), float(r + 1), device=f"tpu:{r}")
        n = torch.full((4,), r + 1, device=f"tpu:{r}", dtype=torch.int32)
        worlds = torch.compile(lambda x: fc.all_reduce(x, "sum", first) * 10 + fc.all_reduce(x * x, "max", second),
                               backend="tpu")
        bitwise = torch.compile(lambda n: fc.all_reduce(n, "sum", first) * 10 + fc.all_reduce(n * n, "bor", first),
                                backend="tpu")
        m0 = torch_tpu.metrics()
        out = [(worlds(x).cpu(), bitwise(n).cpu())]
        m1 = torch_tpu.metrics()
        out += [(worlds(x).cpu(), bitwise(n).cpu()) for _ in range(2)]
        m2 = torch_tpu.metrics()
        return out, m2["collectives_in_programs"] - m0["collectives_in_programs"], m2["compiles"] - m1["compiles"]

    for out, inside, compiles in run_ranks(rank):
        for a, b in out:
            assert torch.equal(a, torch.full((4,), 34.0)), a  # 3 * 10 + max(1, 4)
            assert torch.equal(b, torch.full((4,), 35, dtype=torch.int32)), b  # 3 * 10 + (1 | 4)
        assert inside >= 2, inside
        # Not replayed, the graphs record again at each call, to the same programs.
        assert compiles == 0, compiles
    print("ok calls after collectives inside", flush=True)


def split_inputs():
    # Collectives made as calls while a graph records (the split): the graph is not replayed,
    # since a replay would reuse the call's result. Here the collective reads a graph input
    # directly, so no recorded value is read back to mark the recording; the second call must
    # see the input's new values.
    def rank(r):
        group = dist.distributed_c10d._get_default_group()
        w = torch.full((4,), float(r + 1), device=f"tpu:{r}")
        step = torch.compile(lambda w: fc.all_gather_tensor(w, 0, group) * 2, backend="tpu")
        first = step(w).cpu()
        w.add_(10)
        return first, step(w).cpu()

    for first, second in run_ranks(rank):
        assert torch.equal(first, torch.tensor([2.0] * 4 + [4.0] * 4)), first
        assert torch.equal(second, torch.tensor([22.0] * 4 + [24.0] * 4)), second
    print("ok split collective on a graph input", flush=True)


def fused_eager():
    """Fused eager (TORCH_TPU_DEFER_AND_FUSE=1): eager functional collectives join the pending
    graph; one of another world (a group listing the devices in another order) runs what is
    pending first. A rank that does not come to the launch of its program with collectives is an
    error on the others, and the devices keep working."""
    store = dist.HashStore()

    def rank(r):
        first = dist.distributed_c10d._get_default_group()
        second = torch_tpu.distributed.local_group(1 - r, 2, store, devices=[1, 0])
        x = torch.full((4,), float(r + 1), device=f"tpu:{r}")
        y = fc.wait_tensor(fc.all_reduce(x * 2, "sum", first)) + 1  # 7
        z = fc.wait_tensor(fc.all_reduce(y * x, "max", second))  # max(7, 14)
        return y.cpu(), z.cpu()

    # The counts are the process's: taken around both ranks' runs (the groups are made first).
    run_ranks(lambda r: None)
    m0 = torch_tpu.metrics()
    for y, z in run_ranks(rank):
        assert torch.equal(y, torch.full((4,), 7.0)) and torch.equal(z, torch.full((4,), 14.0)), (y, z)
    m1 = torch_tpu.metrics()
    counts = {k: m1[k] - m0[k] for k in ("collectives_in_programs", "dist_xla_collectives")}
    assert counts == {"collectives_in_programs": 4, "dist_xla_collectives": 0}, counts  # 2 per rank
    print("ok eager collectives in the pending graph", flush=True)

    def absent(r):
        group = dist.distributed_c10d._get_default_group()
        f = torch.compile(lambda x: fc.all_reduce(x * 2, "sum", group) + 1, backend="tpu")
        x = torch.ones(4, device=f"tpu:{r}")
        f(x).cpu()  # recorded by both
        if r == 1:
            return "stayed away"
        return f(x).cpu()  # a call in the pending graph: its launch waits for rank 1

    res = run_ranks(absent, timeout=5)
    assert isinstance(res[0], RuntimeError) and "did not reach a program with 1 collectives" in str(res[0]), res
    print("ok absent rank at the launch", flush=True)

    def again(r):
        group = dist.distributed_c10d._get_default_group()
        return (fc.wait_tensor(fc.all_reduce(torch.full((3,), float(r + 1), device=f"tpu:{r}"), "sum", group)) *
                3).cpu()

    res = run_ranks(again)
    assert all(torch.equal(t, torch.full((3,), 9.0)) for t in res), res
    print("ok devices after failures", flush=True)


if __name__ == "__main__":
    modes = {"tp": lambda: tensor_parallel(sequence_parallel=False),
             "sp": lambda: tensor_parallel(sequence_parallel=True),
             "replicate": lambda: data_parallel("replicate"), "fully_shard": lambda: data_parallel("fully_shard"),
             "failures": failures, "fsdp2_tp": fsdp2_tp, "simple_fsdp_tp": simple_fsdp_tp,
             "titan_fsdp_tp": titan_fsdp_tp, "calls_after_inside": calls_after_collectives_inside,
             "split_inputs": split_inputs, "fused_eager": fused_eager}
    if sys.argv[1] not in modes:
        raise SystemExit(f"unknown mode {sys.argv[1]}")
    modes[sys.argv[1]]()
