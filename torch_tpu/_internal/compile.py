"""Importing it registers torch.compile's ``tpu`` backend (vLLM's TorchTPU platform does)."""

from torch_tpu._compile import _register, tpu_backend  # noqa: F401

_register()
