"""torch.distributed on tpu: the ``tpu_dist`` backend.

Importing torch_tpu registers ``tpu_dist`` with ``torch.distributed`` for the ``tpu``
device, so ``dist.init_process_group()`` (no backend named) gives tpu tensors to it, and
``backend="cpu:gloo,tpu:tpu_dist"`` adds gloo for CPU tensors (as ``"cpu:gloo,cuda:nccl"``
does on GPUs). DDP, FSDP2, DTensor and pipelining call it through c10d like any backend.

The backend itself is C++ (``csrc/distributed/tpu_dist.cpp``). Its transport here stages
through the host: each collective copies the tpu tensors to the host, runs PyTorch's own
gloo collective on the copies and copies the results back (``torch_tpu.metrics()``
counts ``dist_collectives`` and ``dist_staged_bytes``). This module builds the inner gloo
group for each process group c10d creates (the default group and every ``new_group`` or
``DeviceMesh`` dimension), from that group's store, rank, size and timeout.
"""

from __future__ import annotations

BACKEND = "tpu_dist"


def _create_backend(opts, backend_options=None):
    import torch.distributed as dist

    from . import _C

    # Its own key space in the group's store, so the inner group's keys meet no other's.
    store = dist.PrefixStore(f"{BACKEND}/", opts.store)
    host = dist.ProcessGroupGloo(store, opts.group_rank, opts.group_size, opts.timeout)
    return _C._tpu_dist_backend(host, store, opts.group_rank, opts.group_size, opts.timeout)


def register() -> bool:
    """Registers ``tpu_dist`` with torch.distributed (once). False where torch was built
    without distributed support."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available():
        return False
    if getattr(dist.Backend, BACKEND.upper(), None) is not None:
        return True
    dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=["tpu"])
    return True


__all__ = ["BACKEND", "register"]
