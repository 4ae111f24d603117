"""``torch_tpu._loader.load()``: what Google's TorchTPU names its loader, and what Ray Train
calls before it builds a ``tpu_dist`` process group (``ray.air``'s TPU device manager).

Importing torch_tpu does the work (the ``tpu`` device, ``torch.tpu``, the ``tpu_dist`` and
``tpu`` c10d backends); ``load()`` makes sure it happened, and may be called any number of
times.
"""

from __future__ import annotations


def load() -> None:
    """Registers the tpu device and its c10d backends (once; later calls do nothing)."""
    import torch_tpu  # noqa: F401  (registers the device)
    from torch_tpu import distributed

    distributed.register()
