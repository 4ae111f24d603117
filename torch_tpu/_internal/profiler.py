"""``profile`` and ``xprof_trace_handler``, as Google's TorchTPU names them (TorchRec's TPU
benchmarks use them), over ``torch.profiler``: the trace is PyTorch's (host ops, and the
programs torch_tpu launches as they appear on the host), written as a Chrome trace into the
handler's folder. XProf's device timeline needs a TPU and Google's runtime."""

from __future__ import annotations

import contextlib
import enum
import os
from typing import Callable, Optional


class ProfilerActivity(enum.IntEnum):
    CPU = 1
    TPU = 2
    GPU = 3


def xprof_trace_handler(dir_name: str, worker_rank: Optional[int] = None) -> Callable[..., str]:
    """The folder traces go to (one file per profile, named by the worker's rank)."""

    def handler(prof=None) -> str:
        if prof is not None:
            os.makedirs(dir_name, exist_ok=True)
            from torch_tpu import _env

            rank = worker_rank if worker_rank is not None else int(_env.get("RANK", "0") or 0)
            prof.export_chrome_trace(os.path.join(dir_name, f"trace_rank{rank}_{os.getpid()}.json"))
        return dir_name

    return handler


@contextlib.contextmanager
def profile(activities=None, on_trace_ready: Optional[Callable] = None):
    """Profiles the block; on exit ``on_trace_ready`` (an ``xprof_trace_handler``) writes it."""
    if on_trace_ready is None:
        raise ValueError("torch_tpu profiler: pass on_trace_ready=xprof_trace_handler(dir_name)")
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield None
        torch.tpu.synchronize()
    on_trace_ready(prof)
