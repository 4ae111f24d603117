"""``synchronize``, as Google's TorchTPU names it (TorchRec's benchmarks call it)."""

from __future__ import annotations

import torch


def synchronize(*tensors, wait: bool = True) -> None:
    """Runs what is pending (in fused eager, the deferred graph) for the given tensors, or for
    everything when none is given, and with ``wait`` waits until it has finished. A pending
    graph runs whole: it holds the given tensors' producers and whatever was deferred with them."""
    flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
    devices = {t.device.index or 0 for t in flat if isinstance(t, torch.Tensor) and t.device.type == "tpu"}
    for d in sorted(devices) or [None]:
        torch.tpu.synchronize(d)  # runs the pending graph first; waits for the device's programs
    del wait  # launches are asynchronous either way; synchronize always waits
