"""A serving step's model forward as one replayed program (what CUDA graphs
are to vLLM on GPUs).

The first step of each shape is recorded through fused eager as one program
(torch_tpu's capture, csrc/compile/capture.cpp); later steps of that shape
replay it with their own buffers, lowering and tracing nothing: the host
cost of a step no longer grows with the model's op count.

A step's program reads, besides its arguments, the attention metadata that
vLLM hands the attention layers through its forward context, the KV caches
the layers write, and the model's weights. All of them are passed to the
capture as inputs, and the capture refuses a recording that reads any other
device tensor (a replay would read that tensor's contents at recording
time). The key is the inputs' shapes: the token bucket and the request
bucket (see attention.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from torch_tpu import _C, _env

# Recordings of one shape that may fail (a split program, an op on the CPU)
# before the step runs unrecorded for good.
_ATTEMPTS = 2


def bucket(n: int, limit: int | None = None) -> int:
    """The power of two at or above n (at least 1), capped at limit: the
    shapes steps are padded to (vLLM's and SGLang's platforms)."""
    b = 1 << max(0, int(n) - 1).bit_length()
    return min(b, limit) if limit else b


def enabled() -> bool:
    """VLLM_TPU_CAPTURE_STEPS=0 runs every step through the model's code."""
    return _env.get("VLLM_TPU_CAPTURE_STEPS", "1") == "1"


def _device_tensors(values) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and v.device.type == "tpu"]


class StepPrograms:
    """Per shape, the captured program of the model's forward."""

    def __init__(self, model: torch.nn.Module, kv_caches: Callable[[], list]):
        self.model = model
        self.kv_caches = kv_caches
        self.graphs: dict[tuple, Any] = {}
        self.attempts: dict[tuple, int] = {}
        self.captures = 0
        self.replays = 0
        self.unrecorded = 0  # steps run through the model's code

    def stats(self) -> dict:
        return {"shapes": len(self.graphs), "captures": self.captures, "replays": self.replays,
                "unrecorded": self.unrecorded}

    def _step_inputs(self, kwargs: dict) -> list[torch.Tensor] | None:
        """Every device tensor a plain decoder step reads that can change
        between steps, or None for a step this does not record (pipeline
        stages, embeddings as input, extra model inputs, the profiling run)."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        ids, positions = kwargs.get("input_ids"), kwargs.get("positions")
        extra = set(kwargs) - {"input_ids", "positions", "intermediate_tensors", "inputs_embeds"}
        if (extra or kwargs.get("intermediate_tensors") is not None or kwargs.get("inputs_embeds") is not None
                or not isinstance(ids, torch.Tensor) or not isinstance(positions, torch.Tensor)
                or not is_forward_context_available()):
            return None
        ctx = get_forward_context()
        if not isinstance(ctx.attn_metadata, dict) or not ctx.attn_metadata:
            return None
        tensors, seen = [ids, positions], {id(ids), id(positions)}

        def add(ts):
            for t in _device_tensors(ts):
                if id(t) not in seen:
                    seen.add(id(t))
                    tensors.append(t)

        for md in ctx.attn_metadata.values():
            if not dataclasses.is_dataclass(md):
                return None
            add(getattr(md, f.name) for f in dataclasses.fields(md))
        if isinstance(ctx.slot_mapping, dict):
            add(ctx.slot_mapping.values())
        add([getattr(ctx, "is_padding", None)])
        caches = self.kv_caches()
        if any(not isinstance(c, torch.Tensor) for c in caches):
            return None
        add(caches)
        return tensors

    def __call__(self, forward: Callable[[], Any], kwargs: dict) -> Any:
        step = self._step_inputs(kwargs)
        if step is None:
            self.unrecorded += 1
            return forward()
        key = tuple((tuple(t.shape), t.dtype) for t in step)
        # The weights as inputs too: a replay reads the tensors the model
        # holds now, also after a weight reload.
        args = step + _device_tensors(self.model.parameters()) + _device_tensors(self.model.buffers())
        graph = self.graphs.get(key)
        if graph is not None:
            out = _C._replay(graph, args)
            if out is not None:
                self.replays += 1
                return out[0]
        if self.attempts.get(key, 0) >= _ATTEMPTS or not _C._capture_begin(args, True):
            self.unrecorded += 1
            return forward()
        self.attempts[key] = self.attempts.get(key, 0) + 1
        try:
            out = forward()
        except BaseException:
            _C._capture_abort()
            raise
        if not isinstance(out, torch.Tensor):  # auxiliary hidden states and the like
            _C._capture_abort()
            self.attempts[key] = _ATTEMPTS
            self.unrecorded += 1
            return out
        graph = _C._capture_end([out])
        if graph is not None:
            self.graphs[key] = graph
            self.captures += 1
        else:
            self.unrecorded += 1
        return out


def record_steps(model: torch.nn.Module, kv_caches: Callable[[], list]) -> StepPrograms:
    """Makes calls of `model` (the runner's, in execute_model and in its
    dummy runs) go through a StepPrograms. The model's class is swapped for a
    subclass whose __call__ does it, so isinstance checks still hold."""
    programs = StepPrograms(model, kv_caches)
    base = type(model)

    def __call__(self, *args, **kwargs):
        if args:  # vLLM calls the model with keywords only
            return base.__call__(self, *args, **kwargs)
        return programs(lambda: base.__call__(self, **kwargs), kwargs)

    model.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    return programs
