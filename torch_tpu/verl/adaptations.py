"""The places where VeRL 0.9.1 assumes CUDA or NPU outside its platform layer, adapted
in memory for the platforms of this plugin (``tpu``, and ``torch_cpu`` for reference runs).

Each adaptation is applied when VeRL imports the module it concerns (never to VeRL's files
on disk), changes behaviour only when the current platform is one of ours, and says which
VeRL code it stands in for. ``APPLIED`` lists the ones that ran in this process.
"""

from __future__ import annotations

import functools

APPLIED: list[str] = []


def _ours() -> bool:
    from verl.plugin.platform import get_platform

    from .platform import PlatformTPU

    return isinstance(get_platform(), PlatformTPU)  # PlatformHostCPU derives from it


def _resource_pool_check(module) -> None:
    """``ResourcePoolManager._check_resource_available`` counts a node's ``GPU`` or ``NPU``
    resources only; ours are Ray's ``TPU`` chips (or CPUs on the CPU reference)."""
    cls = module.ResourcePoolManager
    original = cls._check_resource_available
    if getattr(original, "_torch_tpu", False):
        return

    @functools.wraps(original)
    def check(self):
        if not _ours():
            return original(self)
        import ray
        from verl.plugin.platform import get_platform

        name = get_platform().ray_resource_name()
        available = sum(n.get(name, 0) for n in ray._private.state.available_resources_per_node().values())
        wanted = sum(c for nodes in self.resource_pool_spec.values() for c in nodes)
        if available < wanted:
            raise ValueError(f"Ray has {available} {name} resources available, the resource pools want {wanted}")

    check._torch_tpu = True
    cls._check_resource_available = check
    APPLIED.append("ResourcePoolManager._check_resource_available")


def _cpu_process_group(module) -> None:
    """``initialize_global_process_group_ray`` asks for ``"cpu:gloo,<device>:<backend>"``, which
    on PyTorch's CPU device names the CPU twice (torch refuses it): there it is ``gloo``. The CPU
    reference platform only; tpu's is ``cpu:gloo,tpu:tpu_dist`` as VeRL builds it."""
    original = module.initialize_global_process_group_ray
    if getattr(original, "_torch_tpu", False):
        return

    @functools.wraps(original)
    def init(timeout_second=None, backend=None):
        from verl.plugin.platform import get_platform

        from .platform import PlatformHostCPU

        if backend is None and isinstance(get_platform(), PlatformHostCPU):
            backend = "gloo"
        return original(timeout_second=timeout_second, backend=backend)

    init._torch_tpu = True
    module.initialize_global_process_group_ray = init
    APPLIED.append("initialize_global_process_group_ray (torch_cpu)")


HOOKS = {
    "verl.single_controller.ray.base": _resource_pool_check,
    "verl.utils.distributed": _cpu_process_group,
}


def register() -> None:
    from torch_tpu._import_hooks import when_imported

    for name, fn in HOOKS.items():
        when_imported(name, fn)
