"""Execution modes by Google's TorchTPU names (vLLM's TorchTPU platform reads and sets
``eager_mode``): ``DEFER_NEVER`` is torch_tpu's strict eager, ``DEFER_NEVER_AND_LAUNCH_BLOCKING``
its debug mode and ``DEFER_AND_FUSE`` fused eager."""

from __future__ import annotations

import sys
import types

from torch_tpu.device import EagerMode, _eager_mode, set_eager_mode

__all__ = ["EagerMode", "set_eager_mode"]  # and the eager_mode property


class _Module(types.ModuleType):
    @property
    def eager_mode(self) -> EagerMode:
        return _eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        set_eager_mode(mode)


sys.modules[__name__].__class__ = _Module
