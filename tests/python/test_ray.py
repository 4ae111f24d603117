"""Ray Train trains on tpu through Ray's own TPU code path.

A local Ray cluster that Ray itself detects as a TPU v6e host with 2 chips: the TPU
environment variables a GKE TPU node carries (TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_NAME,
TPU_WORKER_ID, TPU_WORKER_HOSTNAMES) are set before Ray starts, so it never asks a cloud
metadata server; ``resources={"TPU": 2}`` gives the chip count (there are no /dev/accel*
devices to count), and TORCH_TPU_CPU_DEVICES=2 gives the CPU plugin the 2 devices.

Ray Train v2's ``TorchTrainer`` with ``ScalingConfig(num_workers=2, use_tpu=True,
topology="1x1", accelerator_type="TPU-V6E", resources_per_worker={"TPU": 1, ...})``:
Ray's slice placement group reserves two single-chip (1x1) slices, picks the ``tpu_dist``
backend, calls ``torch_tpu._loader.load()`` and gives each worker one chip through
TPU_VISIBLE_CHIPS, which torch_tpu applies on the CPU plugin. Both workers train a small
model with ``prepare_model`` (DDP on tpu), each on its half of a fixed global batch, and the
per-step losses and final weights equal one process trained on the whole batch.
"""

import os
import shutil
import tempfile

import pytest
import torch
from torch import nn

pytest.importorskip("ray.train.torch", reason="ray[train] is not installed")

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from ray.train.v2._internal.constants import is_v2_enabled  # noqa: E402

STEPS = 4
LR = 0.1
GLOBAL_BATCH = 16

# The node, as a GKE TPU pod's environment describes it: one v6e host, worker 0 of its
# slice. With these set Ray reads them instead of polling metadata.google.internal.
TPU_NODE_ENV = {
    "TPU_ACCELERATOR_TYPE": "v6e-1",
    "TPU_TOPOLOGY": "1x1",
    "TPU_NAME": "local-tpu",
    "TPU_WORKER_ID": "0",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TORCH_TPU_CPU_DEVICES": "2",  # the host's 2 chips, on the CPU plugin
}


def _model():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _reference(init_state, x, y):
    """The same model and steps in this process, on the CPU, on the whole batch."""
    model = _model()
    model.load_state_dict(init_state)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.slow
def test_torch_trainer_use_tpu_two_workers(tmp_path, monkeypatch):
    if not is_v2_enabled():
        pytest.skip("Ray Train v2 is turned off (RAY_TRAIN_V2_ENABLED=0); this test uses its use_tpu path")

    torch.manual_seed(0)
    init_state = {k: v.clone() for k, v in _model().state_dict().items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 1, generator=g)

    def train_loop(config):
        # Runs in each Ray Train worker; self-contained so cloudpickle sends it by value.
        import os
        import tempfile

        import torch
        import torch.distributed as dist
        from torch import nn

        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        assert world == 2 and dist.get_world_size() == 2, (world, dist.get_world_size())
        assert dist.get_backend() == "tpu_dist", dist.get_backend()
        # Ray's TPU accelerator manager gave this worker one chip of the host's 2.
        chips = os.environ.get("TPU_VISIBLE_CHIPS")
        assert chips is not None and chips.isdigit(), f"TPU_VISIBLE_CHIPS={chips!r}"
        assert torch.tpu.device_count() == 1, torch.tpu.device_count()

        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        model.load_state_dict(config["init_state"])
        model = ray.train.torch.prepare_model(model)
        assert isinstance(model, nn.parallel.DistributedDataParallel), type(model)
        assert all(p.device.type == "tpu" for p in model.parameters()), [p.device for p in model.parameters()]
        device = next(model.parameters()).device

        # Which chip each rank holds, gathered on tpu.
        mine = torch.tensor([int(chips), torch.tpu.device_count()], device=device)
        every = torch.empty(2 * world, dtype=mine.dtype, device=device)
        dist.all_gather_into_tensor(every, mine)
        every = every.cpu().view(world, 2).tolist()

        half = config["x"].shape[0] // world
        x = config["x"][rank * half:(rank + 1) * half].to(device)
        y = config["y"][rank * half:(rank + 1) * half].to(device)
        opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
        for step in range(config["steps"]):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            # Both halves are the same size: the mean of the two ranks' losses is the
            # global batch's loss.
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            metrics = {
                "step": step,
                "loss": (global_loss / world).item(),
                "chips": [c for c, _ in every],
                "device_counts": [n for _, n in every],
            }
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    state = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
                    torch.save(state, os.path.join(d, "model.pt"))
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report(metrics, checkpoint=checkpoint)

    # A cluster of its own (not one RAY_ADDRESS names), whose processes see every chip.
    for name in ("RAY_ADDRESS", "TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in TPU_NODE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token written to the home directory

    # Ray's Unix sockets live under its temp dir: keep that path short.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        ray.init(
            num_cpus=2,
            resources={"TPU": 2},
            object_store_memory=200 * 1024 * 1024,
            include_dashboard=False,
            _temp_dir=ray_tmp,
            runtime_env={"env_vars": {"TORCH_TPU_FALLBACK": "error", "OMP_NUM_THREADS": "1"}},
        )
        node = ray.nodes()[0]
        assert node["Resources"].get("TPU") == 2, node["Resources"]
        assert node["Resources"].get("accelerator_type:TPU-V6E") == 1, node["Resources"]
        assert node["Labels"].get("ray.io/accelerator-type") == "TPU-V6E", node["Labels"]

        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"init_state": init_state, "x": x, "y": y, "lr": LR, "steps": STEPS},
            scaling_config=ray.train.ScalingConfig(
                num_workers=2,
                use_tpu=True,
                topology="1x1",
                accelerator_type="TPU-V6E",
                resources_per_worker={"TPU": 1, "CPU": 1},
            ),
            run_config=ray.train.RunConfig(
                storage_path=str(tmp_path),
                name="tpu_ddp",
                # Fail instead of retrying: a run that cannot start or train is a failure here.
                failure_config=ray.train.FailureConfig(max_failures=0, controller_failure_limit=0),
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)

    assert result.error is None, result.error
    reports = sorted((m for _, m in result.best_checkpoints), key=lambda m: m["step"])
    assert [m["step"] for m in reports] == list(range(STEPS))
    # One chip each, the host's two: Ray set TPU_VISIBLE_CHIPS per worker, torch_tpu applied it.
    assert sorted(reports[0]["chips"]) == [0, 1], reports[0]["chips"]
    assert reports[0]["device_counts"] == [1, 1], reports[0]["device_counts"]

    ref_losses, ref_state = _reference(init_state, x, y)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in reports]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)
    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "model.pt"))
    assert state.keys() == ref_state.keys()
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6)


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
