"""Ray Train trains on tpu through Ray's own code paths.

One local Ray cluster (tests/python/ray_local.py) that Ray itself detects as a TPU v6e host with
2 chips serves the file. Two ``TorchTrainer`` runs, 2 workers each, with TORCH_TPU_FALLBACK=error
in the workers (they claim native execution):

1. ``ScalingConfig(use_tpu=True, topology="1x1", accelerator_type="TPU-V6E",
   resources_per_worker={"TPU": 1, "CPU": 1})``: Ray's slice placement group reserves two
   single-chip slices, picks the ``tpu_dist`` backend, calls ``torch_tpu._loader.load()`` and gives
   each worker one chip through TPU_VISIBLE_CHIPS, which torch_tpu applies on the CPU plugin.
2. ``TorchConfig(backend="tpu_dist")`` on plain CPU-resource workers (no TPU resource: Ray's
   device manager is the CPU one, the loop names ``tpu`` itself), resuming from the checkpoint
   run 1 reported after its second step (Ray Train v2 refuses ``resume_from_checkpoint=``; the
   checkpoint goes to the loop in its config, which reads ``ray.train.get_checkpoint()`` first).

Each step of each run trains two copies of one small model on the same data: DDP
(``ray.train.torch.prepare_model``) and FSDP2 (``fully_shard`` over the workers' process group, a
``tpu`` device mesh), SGD with momentum. The data come from Ray Data: a dataset of the global batch
(``ray.data.from_items``), split by Ray Train between the workers (``get_dataset_shard``, equal
halves), one epoch per step, read with ``iter_torch_batches`` onto tpu. With equal halves, the mean
of the two ranks' mean losses is the global batch's mean loss and DDP's and FSDP2's averaged
gradients are the whole batch's: the per-step losses and the weights equal one process (one
worker) trained on the whole batch. Each step reports its losses with a checkpoint (full state
dicts of both models and optimizers, written by rank 0); the resumed run continues where run 1's
checkpoint stood and matches run 1's later steps and final weights.
"""

import os
import sys
import tempfile

import pytest
import torch
from torch import nn

pytest.importorskip("ray.train.torch", reason="ray[train] is not installed")

import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
import ray.train  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402
from ray.train.v2._internal.constants import is_v2_enabled  # noqa: E402

from ray_local import local_tpu_cluster, reports_by_step, run_config, tpu_scaling_config  # noqa: E402

STEPS = 4
RESUME_AFTER = 1  # run 2 resumes from the checkpoint of this step of run 1
LR = 0.1
MOMENTUM = 0.9
GLOBAL_BATCH = 16
TOL = {"rtol": 1e-5, "atol": 1e-6}

# The train loop below refers to this module's functions: Ray sends them by value (the workers
# cannot import tests/python).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _model(init_state=None):
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if init_state is not None:
        model.load_state_dict(init_state)
    return model


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)


def _dataset():
    x, y = _data()
    return ray.data.from_items([{"i": i, "x": x[i].numpy(), "y": y[i].numpy()} for i in range(GLOBAL_BATCH)])


def _train_loop(config):
    """Each Ray Train worker: DDP and FSDP2 copies of the model, one step each per epoch of this
    worker's shard of the dataset, a checkpoint per step."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ray.train.torch
    import torch_tpu

    assert torch_tpu._C._fallback_is_error(), "TORCH_TPU_FALLBACK=error did not reach the worker"
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    assert world == 2 and dist.get_world_size() == 2, (world, dist.get_world_size())
    assert dist.get_backend() == "tpu_dist", dist.get_backend()
    chips = os.environ.get("TPU_VISIBLE_CHIPS")
    if config["use_tpu"]:
        # Ray's TPU device manager: the worker's device is tpu, one chip of the host's 2.
        assert ray.train.torch.get_device().type == "tpu", ray.train.torch.get_device()
        assert chips is not None and chips.isdigit(), f"TPU_VISIBLE_CHIPS={chips!r}"
        assert torch.tpu.device_count() == 1, torch.tpu.device_count()
    else:
        # A CPU-resource worker: Ray knows no accelerator, the loop names tpu itself.
        assert ray.train.torch.get_device().type == "cpu", ray.train.torch.get_device()
        assert chips is None, chips
    device = torch.device("tpu")
    # On TPU workers Ray's own device choice (prepare_model's and iter_torch_batches' default) is tpu.
    ray_device = True if config["use_tpu"] else device

    ddp = ray.train.torch.prepare_model(_model(config["init_state"]), move_to_device=ray_device)
    assert isinstance(ddp, nn.parallel.DistributedDataParallel), type(ddp)
    fsdp = _model(config["init_state"])
    mesh = init_device_mesh("tpu", (world,))
    for layer in (fsdp[0], fsdp[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    models = {"ddp": ddp, "fsdp2": fsdp}
    for m in models.values():
        assert all(p.device.type == "tpu" for p in m.parameters()), [p.device for p in m.parameters()]
    optimizers = {name: _optimizer(m) for name, m in models.items()}

    start = 0
    # Ray Train v2 restores a run's own latest checkpoint through get_checkpoint(); a checkpoint
    # of another run comes in the loop's config (v2 refuses TorchTrainer(resume_from_checkpoint=)).
    checkpoint = ray.train.get_checkpoint() or config.get("resume_from")
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"))
        for name, m in models.items():
            set_state_dict(m, optimizers[name], model_state_dict=saved[name]["model"],
                           optim_state_dict=saved[name]["optim"], options=StateDictOptions(full_state_dict=True))
        start = saved["step"] + 1

    shard = ray.train.get_dataset_shard("train")
    for step in range(start, config["steps"]):
        # One epoch of this worker's shard: its half of the global batch, on tpu.
        batches = list(shard.iter_torch_batches(batch_size=GLOBAL_BATCH,
                                                device="auto" if config["use_tpu"] else device))
        x, y, ids = (torch.cat([b[k] for b in batches]) for k in ("x", "y", "i"))
        assert x.device.type == "tpu", x.device
        every_id = torch.empty(world * ids.numel(), dtype=ids.dtype, device=device)
        dist.all_gather_into_tensor(every_id, ids)
        metrics = {"step": step, "rows": ids.numel(), "ids": sorted(every_id.cpu().tolist()), "chips": None}
        if chips is not None:
            every_chip = torch.empty(world, dtype=torch.int64, device=device)
            dist.all_gather_into_tensor(every_chip, torch.tensor([int(chips)], device=device))
            metrics["chips"] = every_chip.cpu().tolist()
        for name, m in models.items():
            opt = optimizers[name]
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            # Both halves are the same size: the mean of the ranks' losses is the global batch's.
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            metrics[name] = (global_loss / world).item()
        # Full (unsharded) state dicts, gathered to rank 0's CPU memory: collectives on every rank.
        state = {"step": step}
        for name, m in models.items():
            model_state, optim_state = get_state_dict(
                m, optimizers[name], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            state[name] = {"model": model_state, "optim": optim_state}
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                torch.save(state, os.path.join(d, "state.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)


def _reference(init_state):
    """One process, one tpu device, the whole global batch: the losses and final weights the
    2-worker runs must reproduce."""
    x, y = (t.to("tpu") for t in _data())
    model = _model(init_state).to("tpu")
    opt = _optimizer(model)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


def _saved_state(checkpoint):
    with checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"))


def _assert_runs_reference(reports, ref_losses, steps):
    """Each reported step: both halves of the global batch read once, both models' losses equal
    the one-process losses."""
    assert [m["step"] for m in reports] == list(steps), [m["step"] for m in reports]
    for m in reports:
        assert m["rows"] == GLOBAL_BATCH // 2 and m["ids"] == list(range(GLOBAL_BATCH)), m
    for name in ("ddp", "fsdp2"):
        torch.testing.assert_close(torch.tensor([m[name] for m in reports]),
                                   torch.tensor([ref_losses[s] for s in steps]), **TOL, msg=name)


def _assert_states_equal(state, ref_state):
    for name in ("ddp", "fsdp2"):
        assert state[name]["model"].keys() == ref_state.keys(), (name, state[name]["model"].keys())
        for k, v in ref_state.items():
            torch.testing.assert_close(state[name]["model"][k], v, **TOL, msg=f"{name} {k}")


def _trainer(init_state, storage, name, use_tpu, resume_from=None, **kwargs):
    return TorchTrainer(
        _train_loop,
        train_loop_config={"init_state": init_state, "steps": STEPS, "use_tpu": use_tpu, "resume_from": resume_from},
        datasets={"train": _dataset()},
        run_config=run_config(storage, name),
        **kwargs,
    )


@pytest.fixture(scope="module")
def cluster():
    if not is_v2_enabled():
        pytest.skip("Ray Train v2 is turned off (RAY_TRAIN_V2_ENABLED=0); these tests use its use_tpu path")
    with local_tpu_cluster(chips=2, num_cpus=2, worker_env={"TORCH_TPU_FALLBACK": "error"}):
        node = ray.nodes()[0]
        assert node["Resources"].get("TPU") == 2, node["Resources"]
        assert node["Resources"].get("accelerator_type:TPU-V6E") == 1, node["Resources"]
        assert node["Labels"].get("ray.io/accelerator-type") == "TPU-V6E", node["Labels"]
        yield


@pytest.fixture(scope="module")
def init_state():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in _model().state_dict().items()}


@pytest.fixture(scope="module")
def use_tpu_run(cluster, init_state, tmp_path_factory):
    """Run 1: use_tpu=True, 2 workers, every step (the uninterrupted run)."""
    storage = str(tmp_path_factory.mktemp("ray_results"))
    trainer = _trainer(init_state, storage, "use_tpu", use_tpu=True, scaling_config=tpu_scaling_config(2))
    result = trainer.fit()
    assert result.error is None, result.error
    return result, storage


@pytest.mark.slow
def test_torch_trainer_use_tpu_ddp_fsdp2_two_workers_equal_one(use_tpu_run, init_state, fallback_error):
    result, _ = use_tpu_run
    reports = reports_by_step(result)
    # One chip each, the host's two: Ray set TPU_VISIBLE_CHIPS per worker, torch_tpu applied it.
    assert sorted(reports[0]["chips"]) == [0, 1], reports[0]["chips"]
    ref_losses, ref_state = _reference(init_state)  # in this process, fallback an error
    _assert_runs_reference(reports, ref_losses, range(STEPS))
    _assert_states_equal(_saved_state(result.checkpoint), ref_state)


@pytest.mark.slow
def test_torch_trainer_tpu_dist_backend_resumes_from_ray_checkpoint(use_tpu_run, init_state, fallback_error):
    first, storage = use_tpu_run
    ref_losses, ref_state = _reference(init_state)
    resume_from = [c for c, m in first.best_checkpoints if m["step"] == RESUME_AFTER][0]
    trainer = _trainer(init_state, storage, "tpu_dist_resumed", use_tpu=False,
                       scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                       torch_config=TorchConfig(backend="tpu_dist"), resume_from=resume_from)
    result = trainer.fit()
    assert result.error is None, result.error
    reports = reports_by_step(result)
    assert all(m["chips"] is None for m in reports)
    # It continued from the checkpoint's step: the later steps only, equal to run 1's and to one
    # process's, and the same final weights.
    _assert_runs_reference(reports, ref_losses, range(RESUME_AFTER + 1, STEPS))
    first_later = [m for m in reports_by_step(first) if m["step"] > RESUME_AFTER]
    for name in ("ddp", "fsdp2"):
        torch.testing.assert_close(torch.tensor([m[name] for m in reports]),
                                   torch.tensor([m[name] for m in first_later]), **TOL, msg=name)
    final = _saved_state(result.checkpoint)
    _assert_states_equal(final, ref_state)
    _assert_states_equal(final, _saved_state(first.checkpoint)["ddp"]["model"])


def test_rays_tpu_device_manager_finds_and_loads_torch_tpu():
    """The calls Ray's TPU device manager makes in each worker, without a cluster (the gate's
    share of this file): torch_tpu importable, its loader registering tpu_dist, tpu devices."""
    import torch.distributed as dist
    from ray.air._internal.device_manager.tpu import TPUTorchDeviceManager

    manager = TPUTorchDeviceManager()
    assert manager.is_available()
    TPUTorchDeviceManager.register_custom_torch_dist_backend()
    assert "tpu_dist" in dist.Backend.backend_list
    assert manager.get_devices() == [torch.device("tpu")]
    assert torch.ones(2, device=manager.get_devices()[0]).device.type == "tpu"


def _reads_torch_tpu():
    return torch.tpu.device_count(), torch.tpu.eager_mode


def test_a_function_reading_torch_tpu_pickles_by_value():
    """Ray sends a train loop defined in a script (or here) by value, with the submodules it names:
    torch.tpu, a module subclass, pickles by name."""
    import pickle

    import torch_tpu._internal.execution_mode as execution_mode

    assert pickle.loads(pickle.dumps(torch.tpu)) is torch.tpu
    assert pickle.loads(pickle.dumps(execution_mode)) is execution_mode
    assert ray.cloudpickle.loads(ray.cloudpickle.dumps(_reads_torch_tpu))() == _reads_torch_tpu()
