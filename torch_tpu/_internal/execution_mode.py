"""Execution modes by Google's TorchTPU names (vLLM's TorchTPU platform reads and sets
``eager_mode``): ``DEFER_NEVER`` is torch_tpu's strict eager, ``DEFER_NEVER_AND_LAUNCH_BLOCKING``
its debug mode and ``DEFER_AND_FUSE`` fused eager."""

from __future__ import annotations

import sys

from torch_tpu.device import EagerMode, _EagerModeModule, set_eager_mode

__all__ = ["EagerMode", "set_eager_mode"]  # and the eager_mode attribute

sys.modules[__name__].__class__ = _EagerModeModule
