"""VeRL on tpu: the plugin VeRL loads from the entry-point group ``verl.plugins``.

``import verl`` loads every entry point of that group (unless
``VERL_USE_EXTERNAL_PLUGINS=none``); ours is this module, and importing it registers,
through VeRL's own registries and without touching VeRL's files:

- the platform ``tpu`` (``platform.PlatformTPU``) in ``PlatformRegistry``: VeRL's
  auto-detection picks it where torch_tpu imports and no CUDA/NPU/ROCm platform claims
  the host (``VERL_PLATFORM=tpu`` forces it); and ``torch_cpu``, PyTorch's CPU device,
  for reference runs only (``VERL_PLATFORM=torch_cpu``);
- VeRL's FSDP/FSDP2 engines (``FSDPEngineWithLMHead``, ``FSDPEngineWithValueHead``) in
  ``EngineRegistry`` for the devices ``tpu`` and ``cpu`` (VeRL registers them for cuda and
  npu only); registered once VeRL imports its FSDP engine, not before;
- the rollout ``hf`` (``rollout.HFRollout`` and ``rollout.HFReplica``): generation on
  the worker's device with weights synced in process (see ``rollout.py``).

- in-memory adaptations of the few places where VeRL assumes CUDA or NPU outside its
  platform layer (``adaptations.py``, each documented there).

Nothing here reads the environment; what VeRL reads (``VERL_PLATFORM``) is VeRL's.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ENGINE_DEVICES = ("tpu", "cpu")
_FSDP_IMPL = "verl.workers.engine.fsdp.transformer_impl"


def _register_engines(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    for model_type, cls in (("language_model", module.FSDPEngineWithLMHead),
                            ("value_model", module.FSDPEngineWithValueHead)):
        registry = EngineRegistry._engines.setdefault(model_type, {})
        for backend in ("fsdp", "fsdp2"):
            devices = [d for d in ENGINE_DEVICES if d not in registry.get(backend, {})]
            if devices:
                EngineRegistry.register(model_type=model_type, backend=backend, device=devices)(cls)


def _register_rollout_name(module) -> None:
    module._ROLLOUT_REGISTRY.setdefault(("hf", "async"), "torch_tpu.verl.rollout.HFRollout")


def _load_hf_replica():
    from .rollout import HFReplica

    return HFReplica


def _register_replica(module) -> None:
    module.RolloutReplicaRegistry.register("hf", _load_hf_replica)


def register() -> None:
    """Registers the platforms now and the engines and rollout as VeRL imports them (idempotent)."""
    from torch_tpu._import_hooks import when_imported

    from . import adaptations, platform

    platform.register()
    adaptations.register()
    when_imported(_FSDP_IMPL, _register_engines)
    when_imported("verl.workers.rollout.base", _register_rollout_name)
    when_imported("verl.workers.rollout.replica", _register_replica)


try:
    register()
except Exception:  # VeRL swallows a plugin's import error at debug level: say it louder
    logger.warning("torch_tpu.verl: registering the tpu platform with VeRL failed", exc_info=True)
    raise
