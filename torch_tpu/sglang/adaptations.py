"""In-memory adaptations of the few places where SGLang 0.5.21 decides on
Triton kernels by the attention backend's name, outside its platform layer.

SGLang picks its Triton helpers (writing a request's slots into the
req_to_token table, computing an extend batch's positions, M-RoPE) unless
the attention backend is named "torch_native" or "intel_amx"
(`sglang.srt.utils.common.support_triton`, a fixed list). Triton has no
driver for tpu, so for the "tpu" backend those callers take SGLang's torch
paths instead: each module's imported `support_triton` is wrapped to answer
False for it. And an extend batch's positions are computed on the host from
the batch's lengths and sent as one upload, instead of SGLang's torch path
(an arange per request, each its own device program).

Applied once per process, in the worker (the platform's init_backend).
"""
from __future__ import annotations

import numpy as np
import torch

_applied = False


def _support_triton_unless_tpu(original):
    def support_triton(backend: str) -> bool:
        return backend != "tpu" and original(backend)

    support_triton.__wrapped__ = original
    return support_triton


def compute_position_host(extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor):
    """(positions, extend_start_loc) of an extend batch, as SGLang's
    compute_position_torch gives them: computed on the host, then uploaded."""
    prefix = extend_prefix_lens.tolist()
    lens = extend_seq_lens.tolist()
    positions = np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in zip(prefix, lens)] or
                               [np.zeros(0, dtype=np.int64)])
    starts = np.zeros(len(lens), dtype=np.int64)
    if len(lens) > 1:
        starts[1:] = np.cumsum(lens[:-1])
    device = extend_seq_lens.device
    return (torch.from_numpy(positions).to(device),
            torch.from_numpy(starts).to(extend_seq_lens.dtype).to(device))


def apply() -> None:
    global _applied
    if _applied:
        return
    import sglang.srt.layers.rotary_embedding.mrope as mrope
    import sglang.srt.mem_cache.allocation as allocation
    import sglang.srt.model_executor.forward_batch_info as forward_batch_info

    for module in (allocation, forward_batch_info, mrope):
        module.support_triton = _support_triton_unless_tpu(module.support_triton)
    forward_batch_info.compute_position_torch = compute_position_host
    _applied = True
