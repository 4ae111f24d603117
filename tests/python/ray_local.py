"""A local Ray cluster that Ray itself detects as one TPU v6e host, shared by tests/python/test_ray.py,
benchmarks/ray_train.py and benchmarks/verl_grpo.py (which VeRL's tests run).

The TPU environment variables a GKE TPU node carries (TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_NAME,
TPU_WORKER_ID, TPU_WORKER_HOSTNAMES) are set before Ray starts, so Ray reads them and never asks a
cloud metadata server; ``resources={"TPU": chips}`` gives the chip count (there are no /dev/accel*
devices to count), and TORCH_TPU_CPU_DEVICES gives the CPU plugin as many devices. The cluster's
processes inherit this environment; nothing is written outside the temporary folder made here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

# The node, as a GKE TPU pod's environment describes it: one v6e host, worker 0 of its slice.
TPU_NODE_ENV = {
    "TPU_ACCELERATOR_TYPE": "v6e-1",
    "TPU_TOPOLOGY": "1x1",
    "TPU_NAME": "local-tpu",
    "TPU_WORKER_ID": "0",
    "TPU_WORKER_HOSTNAMES": "localhost",
}
# Variables the cluster must not inherit: another cluster's address, a chip mask of our own.
CLEARED = ("RAY_ADDRESS", "TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES")


@contextlib.contextmanager
def local_tpu_cluster(chips: int = 2, num_cpus: int = 2, worker_env: dict | None = None, object_store_mb: int = 200):
    """Starts a Ray cluster of this machine, seen by Ray as a TPU host with `chips` chips (the CPU
    plugin gives each process that many tpu devices; Ray's TPU_VISIBLE_CHIPS narrows a worker to
    the chips it holds); chips=0: a plain CPU cluster. `worker_env` goes to every worker through
    the job's runtime_env. Yields the ray module; on exit shuts Ray down, removes its session
    folder and restores os.environ."""
    import ray

    env = {"RAY_AUTH_MODE": "disabled"}  # no token written to the home directory
    if chips:
        env.update(TPU_NODE_ENV, TORCH_TPU_CPU_DEVICES=str(chips))
    saved = {name: os.environ.get(name) for name in (*env, *CLEARED)}
    # Ray's Unix sockets live under its temp dir: keep that path short.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        for name in CLEARED:
            os.environ.pop(name, None)
        os.environ.update(env)
        ray.init(
            num_cpus=num_cpus,
            resources={"TPU": chips} if chips else None,
            object_store_memory=object_store_mb * 1024 * 1024,
            include_dashboard=False,
            _temp_dir=ray_tmp,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **(worker_env or {})}},
        )
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def reports_by_step(result) -> list:
    """The metrics a run reported with its checkpoints (Ray keeps a report's metrics only with a
    checkpoint), in step order."""
    return sorted((m for _, m in result.best_checkpoints), key=lambda m: m["step"])


def run_config(storage_path: str, name: str):
    """A RunConfig that keeps every checkpoint and fails instead of retrying: a run that cannot
    start or train is a failure here."""
    import ray.train

    return ray.train.RunConfig(
        storage_path=storage_path,
        name=name,
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),
        failure_config=ray.train.FailureConfig(max_failures=0, controller_failure_limit=0),
    )


def tpu_scaling_config(num_workers: int):
    """One chip and one CPU per worker on the local TPU host: Ray reserves single-chip (1x1) v6e
    slices, picks tpu_dist and gives each worker its chip through TPU_VISIBLE_CHIPS."""
    import ray.train

    return ray.train.ScalingConfig(num_workers=num_workers, use_tpu=True, topology="1x1",
                                   accelerator_type="TPU-V6E", resources_per_worker={"TPU": 1, "CPU": 1})
