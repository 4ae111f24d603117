"""The training step at scale, on paper: FLOPs and collective bytes read from the traced step,
projected onto TPU v5p, v6e and v7x slices of any size (docs/scale.md).

A step (forward, loss, backward, optimizer step) runs once under ``FakeTensorMode`` (no memory,
no arithmetic) in a world of fake ranks (``FakeStore`` + the ``fake`` process group), with the
real parallel plan: FSDP2 (``fully_shard``; TorchTitan's own ``apply_fsdp_to_decoder`` for its
models) and, when asked, tensor parallelism through DTensor ``parallelize_module``. A
``TorchDispatchMode`` sees every ATen op of one rank and records:

- FLOPs of each op through ``torch.utils.flop_counter``'s registry (mm, addmm, bmm, convolution,
  attention forward and backward; the CPU flash-attention kernel through its shape formula);
- the bytes each op reads and writes (for the memory-bound time of elementwise work);
- every collective: kind, mesh dimension, group size, and the size S of the full tensor it
  gathers or reduces (FSDP2's ``all_gather_into_tensor``/``reduce_scatter_tensor`` calls, and
  DTensor's functional collectives);
- the FSDP unit each op belongs to, from FSDP2's own ``record_function`` labels;
- the tensors autograd saves for backward (``saved_tensors_hooks``), for the activation memory.

The step is traced at two local batches (1 and 2 sequences per data-parallel rank); everything
that depends on the batch is linear in it, so any batch is a linear combination of the two
traces. Nothing in the projection is a hand formula for a model: the FLOPs, bytes and the order
of collectives come from the traced ops, and only the chips' published numbers and the stated
assumptions (``Assumptions``) are added. It is a projection from traced graphs, not a
measurement.

    python -m torch_tpu.scale --model titan:llama3:8B --project v5p:256 --project v7x:8192
    torch-tpu bench --model gpt:small --project v6e:256 --out results/
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import re
import sys

# --------------------------------------------------------------------------- chips


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip as Google publishes it (the table in docs/scale.md gives each source)."""

    key: str
    name: str
    bf16_flops: float  # peak dense bf16 FLOP/s
    hbm_bytes: float  # HBM capacity
    hbm_bw: float  # HBM bandwidth, bytes/s
    ici_bidi_bw: float  # bidirectional ICI bandwidth per chip, bytes/s (all ports together)
    dcn_bw: float  # data-center network bandwidth per chip, bytes/s
    torus_dims: int  # 3 for a 3D torus, 2 for a 2D torus
    pod_chips: int  # the largest ICI domain; beyond it slices talk over DCN

    @property
    def ici_bw(self) -> float:
        """What one chip can inject per direction, over all its ports (half the bidirectional)."""
        return self.ici_bidi_bw / 2


GiB = 2**30
CHIPS = {
    # docs.cloud.google.com/tpu/docs/tpu7x: the specification table comparing v5p, v6e and TPU7x.
    "v5p": Chip("v5p", "TPU v5p", 459e12, 95 * GiB, 2765e9, 1200e9, 50e9 / 8, 3, 8960),
    "v6e": Chip("v6e", "TPU v6e (Trillium)", 918e12, 32 * GiB, 1638e9, 800e9, 100e9 / 8, 2, 256),
    "v7x": Chip("v7x", "TPU7x (Ironwood)", 2307e12, 192 * GiB, 7380e9, 1200e9, 100e9 / 8, 3, 9216),
}
CHIP_ALIASES = {"tpu7x": "v7x", "ironwood": "v7x", "trillium": "v6e", "v7": "v7x"}


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What the projection assumes beyond the traced step and the published chip numbers."""

    efficiency: float = 0.75  # fraction of bf16 peak a large matmul / attention kernel reaches
    fusion: float = 0.5  # fraction of the unfused elementwise traffic left after XLA fusion
    causal_block: int = 512  # causal attention skips fully masked blocks of this many tokens
    ici_hop_s: float = 1e-6  # latency per ring step on ICI
    collective_s: float = 10e-6  # fixed cost per collective (launch, synchronisation)
    dcn_hop_s: float = 20e-6  # latency per step between slices over DCN (log2(slices) steps)
    buffers: int = 2  # FSDP unsharded units alive at once (the current one and the prefetched one)


ASSUMPTIONS = Assumptions()


def parse_project(spec) -> tuple[str, int]:
    """'v5p:256' -> ('v5p', 256). ValueError with the reason for anything else."""
    text = str(spec).strip()
    chip, sep, n = text.partition(":")
    known = ", ".join(CHIPS)
    if not sep or not chip or not n:
        raise ValueError(f"--project {text!r}: write CHIP:N, e.g. v5p:256 (chips: {known})")
    key = CHIP_ALIASES.get(chip.lower(), chip.lower())
    if key not in CHIPS:
        raise ValueError(f"--project {text!r}: unknown chip {chip!r} (known: {known})")
    try:
        count = int(n)
    except ValueError:
        raise ValueError(f"--project {text!r}: the chip count {n!r} is not a whole number") from None
    if count < 1:
        raise ValueError(f"--project {text!r}: the chip count must be at least 1")
    return key, count


# --------------------------------------------------------------------------- models


@dataclasses.dataclass
class ModelSpec:
    """How to build, shard and run one training step of a model (all under FakeTensorMode)."""

    name: str
    build: object  # () -> nn.Module
    vocab: int
    seq_len: int
    local_batch: int  # sequences per data-parallel rank (TorchTitan's local_batch_size)
    ac: str  # "none" | "selective" | "full": the activation checkpointing the config uses
    tp: int = 1
    titan: bool = False
    kind: str = "titan"  # "titan" | "gpt" | "hf"
    note: str = ""


TITAN_DEFAULTS = {
    # TorchTitan 0.3.0 config_registry: llama3_8b (local_batch_size=1, seq_len=8192, SelectiveAC,
    # FSDP over all ranks), llama3_70b (local_batch_size=8, seq_len=8192, TP 8, FullAC),
    # llama3_405b (local_batch_size=2, seq_len=8192, TP 8, FullAC). Qwen3 8B has only an SFT config
    # there (local 1 x 2048, SelectiveAC); we use llama3_8b's pretraining settings for it.
    ("llama3", "8B"): dict(local_batch=1, seq_len=8192, ac="selective", tp=1),
    ("llama3", "70B"): dict(local_batch=8, seq_len=8192, ac="full", tp=8),
    ("llama3", "405B"): dict(local_batch=2, seq_len=8192, ac="full", tp=8),
    ("qwen3", "8B"): dict(local_batch=1, seq_len=8192, ac="selective", tp=1),
}


def _titan_config(family: str, flavor: str):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if family == "llama3":
        from torchtitan.models.llama3 import llama3_configs as configs
    elif family == "qwen3":
        from torchtitan.models.qwen3 import qwen3_configs as configs
    else:
        raise ValueError(f"titan:{family}: llama3 or qwen3")
    if flavor not in configs:
        raise ValueError(f"titan:{family}:{flavor}: flavors are {', '.join(configs)}")
    cfg = configs[flavor](attn_backend="flex")
    if getattr(cfg, "moe_enabled", False) or any(getattr(layer, "moe", None) is not None for layer in cfg.layers):
        raise ValueError(f"titan:{family}:{flavor} is a mixture of experts; only dense models are projected")
    for layer in cfg.layers:
        # Causal SDPA instead of flex/varlen (CUDA kernels): the same FLOPs, one fused op.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def model_spec(name: str, *, seq_len=None, local_batch=None, tp=None, ac=None) -> ModelSpec:
    """A ModelSpec from a bench-style name: titan:llama3:8B, titan:qwen3:8B, gpt[:size],
    hf:ARCH[:size] or a local Hugging Face folder (its config only; no weights are read)."""
    import os

    if name.startswith("titan:"):
        parts = name.split(":")
        if len(parts) != 3:
            raise ValueError(f"--model {name!r}: write titan:FAMILY:FLAVOR, e.g. titan:llama3:8B")
        family, flavor = parts[1], parts[2]
        cfg = _titan_config(family, flavor)
        d = dict(TITAN_DEFAULTS.get((family, flavor), dict(local_batch=1, seq_len=2048, ac="selective", tp=1)))
        vocab = cfg.vocab_size
        spec = ModelSpec(name=name, build=cfg.build, vocab=vocab, titan=True, kind="titan", **d)
    elif name == "gpt" or name.startswith("gpt:"):
        from ._bench_worker import GPT_SIZES

        size = name.split(":", 1)[1] if ":" in name else "tiny"
        if size not in GPT_SIZES:
            raise ValueError(f"--model {name!r}: gpt sizes are {', '.join(GPT_SIZES)}")
        n = seq_len or 256

        def build(size=size, n=n):
            from .models import GPT

            return GPT(256, block_size=n, dropout=0.0, **GPT_SIZES[size])

        spec = ModelSpec(name=name, build=build, vocab=256, local_batch=1, seq_len=n, ac="none", kind="gpt")
    elif name.startswith("hf:") or os.path.isdir(name):
        from transformers import AutoConfig

        if name.startswith("hf:"):
            from ._bench_worker import hf_config

            try:
                hcfg = hf_config(name)
            except ValueError as e:
                raise ValueError(f"--model {name!r}: {e}") from None
        else:
            hcfg = AutoConfig.from_pretrained(name)
        n = seq_len or 256
        for k in ("max_position_embeddings", "n_positions"):
            if hasattr(hcfg, k):
                setattr(hcfg, k, max(getattr(hcfg, k) or 0, n))
        hcfg._attn_implementation = "sdpa"

        def build(hcfg=hcfg):
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(hcfg, attn_implementation="sdpa")

        spec = ModelSpec(name=name, build=build, vocab=hcfg.vocab_size, local_batch=1, seq_len=n, ac="none",
                         kind="hf")
    else:
        raise ValueError(f"--model {name!r}: not titan:FAMILY:FLAVOR, gpt[:size], hf:ARCH[:size] or a folder")
    if seq_len:
        spec.seq_len = int(seq_len)
    if local_batch:
        spec.local_batch = int(local_batch)
    if tp:
        spec.tp = int(tp)
    if ac:
        spec.ac = ac
    if spec.ac not in ("none", "selective", "full"):
        raise ValueError(f"activation checkpointing {spec.ac!r}: none, selective or full")
    if spec.tp > 1 and not spec.titan:
        raise ValueError(f"--model {name!r}: tensor parallelism is planned for TorchTitan models only")
    if spec.seq_len < 1 or spec.local_batch < 1 or spec.tp < 1:
        raise ValueError("sequence length, batch and TP degree must be positive")
    return spec


def _blocks(model):
    """The repeated blocks (FSDP units, activation-checkpointed units): TorchTitan's
    ``layers`` or the ModuleList holding most parameters."""
    import torch.nn as nn

    if hasattr(model, "layers") and isinstance(model.layers, (nn.ModuleDict, nn.ModuleList)):
        items = model.layers.items() if isinstance(model.layers, nn.ModuleDict) else enumerate(model.layers)
        return [(f"layers.{k}", m) for k, m in items]
    best, best_n = None, -1
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = (fqn, mod), n
    if best is None:
        return []
    return [(f"{best[0]}.{i}", m) for i, m in enumerate(best[1])]


def _tp_plan(model, tp_mesh):
    """TorchTitan's tensor-parallel plan (sequence parallel norms, colwise QKV / w1 / w3,
    rowwise wo / w2, loss parallel), written with DTensor's parallelize_module."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    import types

    import torch.nn as nn

    # TorchTitan's Embedding runs its own vocab-parallel code for its spmd_types backend; under
    # DTensor's plan the plain nn.Embedding forward is the one (the classic TorchTitan plan).
    model.tok_embeddings.forward = types.MethodType(nn.Embedding.forward, model.tok_embeddings)
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for _, block in _blocks(model):
        qkv = block.attention.qkv_linear
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        for sub in ("wqkv", "wq", "wk", "wv"):
            if hasattr(qkv, sub):
                plan[f"attention.qkv_linear.{sub}"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)


def _apply_fsdp(spec, model, dp_mesh):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if spec.titan:
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        apply_fsdp_to_decoder(model, dp_mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              pp_enabled=False)
        return
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for _, block in _blocks(model):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def _loss(spec, model, tokens, tp):
    import torch.nn.functional as F

    if spec.kind == "gpt":
        return model(tokens, tokens)[1]
    if spec.kind == "hf":
        return model(input_ids=tokens, labels=tokens).loss
    out = model(tokens)
    return F.cross_entropy(out.flatten(0, 1).float(), tokens.flatten(0, 1))


def _loss_context(tp):
    """TorchTitan's loss parallel under TP (the logits stay sharded over the vocabulary): the
    loss and its backward both run inside it."""
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- tracing

_SKIP = {"detach", "alias", "_local_scalar_dense", "lift_fresh", "empty", "empty_like", "empty_strided",
         "new_empty", "new_empty_strided", "_to_copy_meta", "copy_meta", "set_", "resize_", "_unsafe_view",
         "view", "t", "transpose", "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze", "permute",
         "split", "split_with_sizes", "unbind", "view_as_real", "view_as_complex", "_conj", "_reshape_alias"}
_ATTN_FWD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
             "_efficient_attention_forward"}
_COLL_KIND = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
}
_FSDP_LABEL = re.compile(r"^FSDP::(\w+)(?: \((.*)\))?$")


def _nbytes(t) -> int:
    import torch

    if isinstance(t, torch.Tensor):
        local = getattr(t, "_local_tensor", None)
        t = local if local is not None else t
        return t.numel() * t.element_size()
    return 0


def _tensors(x):
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _storage_key(t):
    try:
        local = getattr(t, "_local_tensor", None)
        return (local if local is not None else t).untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage has no producer to find
        return None


def _make_recorder(group_dims: dict):
    """The dispatch mode that records one rank's step (made here so that importing this module
    does not import torch)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
    from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
    from torch._functorch.partitioners import get_default_op_list

    intensive = {op for op in get_default_op_list().compute_intensive_ops}
    mm = torch.ops.aten.mm.default

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase = "fw"
            self.unit = None
            self.fsdp_group = None
            self.items = []  # ["u", phase, unit] | ["c", phase, unit, flops, bytes, attn, causal_n, saved] | ["m", ...]
            self.producer = {}  # storage -> (unit, saved_under_sac)
            self.mm_count = {}
            self.saved = {}  # unit -> [all, sac_kept, full_kept]
            self.saved_seen = set()
            self.ops = 0
            self.skip = 0

        # --- unit tracking through FSDP2's record_function labels
        def _label(self, text):
            if not text.startswith("FSDP::"):
                return
            self.fsdp_group = None
            m = _FSDP_LABEL.match(text)
            if not m:
                return  # FSDP::backward_prefetch for X: its all_gather label follows
            what, fqn = m.group(1), m.group(2)
            unit = fqn if fqn is not None else "(root)"
            if what in ("pre_forward", "pre_backward"):
                self._set_unit(unit)
            elif what in ("post_forward", "post_backward_accumulate"):
                self._set_unit(None)
            if what in ("all_gather", "post_backward_reduce"):
                self.fsdp_group = unit  # the c10d collective that follows is this unit's

        def _set_unit(self, unit):
            if unit != self.unit:
                self.unit = unit
                self.items.append(["u", self.phase, unit])
                if self.phase == "fw":
                    self.mm_count[unit] = 0

        # --- the ops
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(is_traceable_wrapper_subclass_type(t) for t in types):
                return NotImplemented  # DTensor & co: their local ops come back here
            if self.skip:  # DTensor's sharding propagation running an op on global shapes
                return func(*args, **kwargs)
            if func is torch.ops.profiler._record_function_enter_new.default:
                self._label(str(args[0]))
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            ns = func.namespace
            name = func._opname
            if ns in ("c10d", "_c10d_functional"):
                self._collective(ns, name, args, kwargs, out)
                return out
            if ns in ("prim", "profiler") or name in _SKIP or func.is_view:
                return out
            self.ops += 1
            ins = _tensors((args, kwargs))
            outs = _tensors(out)
            nbytes = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
            if name == "all_gather_copy_in":  # reads the shards, writes them into the buffer
                nbytes = 2 * sum(_nbytes(t) for t in _tensors(args[0]))
            flops, attn, causal = 0, 0, 0
            packet = func.overloadpacket
            if name in _ATTN_FWD or name.endswith("attention_backward") or name.endswith("_for_cpu_backward"):
                attn = 1
                flops, causal = self._attention(func, name, args, kwargs)
            elif packet in flop_registry:
                try:
                    flops = int(flop_registry[packet](*args, out_val=out, **kwargs))
                except Exception:  # noqa: BLE001 - an unusual overload: count it as memory work
                    flops = 0
            saved = 0
            if self.phase == "fw":
                if func is mm:
                    self.mm_count[self.unit] = self.mm_count.get(self.unit, 0) + 1
                # TorchTitan's selective AC: outputs of compute-intensive ops (and attention)
                # are saved, except every second mm of a block.
                saved = int(attn == 1 or (packet in intensive and not (
                    func is mm and self.mm_count.get(self.unit, 0) % 2 == 0)))
                for t in outs:
                    k = _storage_key(t)
                    if k is not None:
                        self.producer[k] = (self.unit, saved, ns == "fsdp")
            kind = "c" if (flops or attn) else "m"
            self.items.append([kind, self.phase, self.unit, flops, nbytes, attn, causal, saved, name])
            return out

        def _attention(self, func, name, args, kwargs):
            def shape(t):
                return tuple(t.shape)

            try:
                if "backward" in name:
                    g, q, k, v = args[0], args[1], args[2], args[3]
                    flops = sdpa_backward_flop_count(shape(g), shape(q), shape(k), shape(v))
                    causal = bool(args[7]) if len(args) > 7 and isinstance(args[7], bool) else \
                        bool(kwargs.get("is_causal", False))
                else:
                    q, k, v = args[0], args[1], args[2]
                    flops = sdpa_flop_count(shape(q), shape(k), shape(v))
                    causal = bool(args[4]) if len(args) > 4 and isinstance(args[4], bool) else \
                        bool(kwargs.get("is_causal", False))
                    if name in ("_flash_attention_forward", "_efficient_attention_forward"):
                        causal = False
            except Exception:  # noqa: BLE001
                return 0, 0
            return int(flops), (int(q.shape[-2]) if causal else 0)

        def _collective(self, ns, name, args, kwargs, out):
            kind = _COLL_KIND.get(name)
            if name == "wait_tensor" and self.phase == "fw":  # (under fake tensors, a new storage)
                src, dst = _storage_key(args[0]), _storage_key(out)
                if src in self.producer and dst is not None:
                    self.producer[dst] = self.producer[src]
            if kind is None:
                return  # wait_tensor, barrier, ...
            import torch.distributed as dist

            size, gname = None, None
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.ScriptObject):
                    pg = dist.ProcessGroup.unbox(a)
                    size, gname = pg.size(), pg.group_name
                    break
            if gname is None:
                gname = next((a for a in reversed(args) if isinstance(a, str)), None)
                if gname is not None:
                    from torch.distributed.distributed_c10d import _resolve_process_group

                    size = _resolve_process_group(gname).size()
            if ns == "c10d":
                first, second = _tensors(args[0]), _tensors(args[1]) if len(args) > 1 else []
                if kind == "all_gather":
                    full = sum(_nbytes(t) for t in first)
                elif kind in ("reduce_scatter", "all_to_all"):
                    full = sum(_nbytes(t) for t in second) if kind == "reduce_scatter" else sum(
                        _nbytes(t) for t in args[1:2] if hasattr(t, "shape"))
                else:
                    full = sum(_nbytes(t) for t in first)
            else:
                ins = _tensors(args[0])
                full = sum(_nbytes(t) for t in ins) * (size if kind == "all_gather" else 1)
            source = "fsdp" if (ns == "c10d" and self.fsdp_group is not None) else \
                ("tp" if group_dims.get(gname) == "tp" else "other")
            if self.phase == "fw":  # a gathered activation is an activation (SAC saves reduce-scatters)
                for t in _tensors(out if ns != "c10d" else args[0]):
                    k = _storage_key(t)
                    if k is not None:
                        self.producer[k] = (self.unit, int(kind in ("reduce_scatter", "all_to_all")),
                                            source == "fsdp")
            self.items.append(["x", self.phase, self.unit, kind, group_dims.get(gname, f"group{gname}"), size,
                               full, source, self.fsdp_group if source == "fsdp" else None])

        # --- saved tensors (activation memory)
        def pack(self, t):
            try:
                if self.phase != "fw" or (t.is_leaf and t.requires_grad):
                    return t
                base = getattr(t, "_base", None)
                if base is not None and base.is_leaf and base.requires_grad:
                    return t
                k = _storage_key(t)
                key = (self.unit, k)
                if k is None or key in self.saved_seen:
                    return t
                self.saved_seen.add(key)
                if k not in self.producer:
                    return t  # not made by this forward: parameters, buffers, the tokens
                unit, sac, is_param = self.producer[k]
                if is_param:
                    return t  # FSDP's unsharded parameters: freed after the unit, not activations
                n = _storage_nbytes(t)
                rec = self.saved.setdefault(self.unit, [0, 0, 0])
                rec[0] += n
                rec[1] += n if (sac and unit == self.unit) else 0
            except Exception:  # noqa: BLE001 - memory accounting never breaks the trace
                pass
            return t

        @staticmethod
        def unpack(t):
            return t

        def block_input(self, unit, module, args):
            """A checkpointed block keeps its inputs (selective and full AC alike)."""
            if self.phase == "fw":
                n = sum(_nbytes(t) for t in _tensors(args))
                rec = self.saved.setdefault(unit, [0, 0, 0])
                rec[1] += n
                rec[2] += n

    return Recorder()


def _storage_nbytes(t) -> int:
    local = getattr(t, "_local_tensor", None)
    t = local if local is not None else t
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001
        return t.numel() * t.element_size()


@contextlib.contextmanager
def _fake_world(world: int):
    """A fake process group of `world` ranks (we are rank 0) for the duration of one trace."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; the projection needs "
                           "its own fake process group (run it in a process of its own)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _not_recording_sharding_propagation(rec):
    """DTensor infers an op's output shape by running it once on global-shape fake tensors (and
    caches the answer, so only a process's first trace does it). That run is no work of the
    step: the recorder ignores ops issued inside it."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator.__dict__.get("_propagate_tensor_meta_non_cached")
    if original is None:
        yield
        return

    def propagate(self, *args, **kwargs):
        rec.skip += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            rec.skip -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


@contextlib.contextmanager
def _mesh_outside_fake():
    """DeviceMesh._concatenate (FSDP2 over TP-sharded DTensors calls it) builds a mesh from
    tensors; torch 2.13 wraps its sibling _create_sub_mesh in unset_fake_temporarily but not
    this one, so under FakeTensorMode its nonzero() fails. Run it outside the fake mode for
    the duration of the trace."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__.get("_concatenate")
    if original is None:
        yield
        return
    fn = original.__func__ if isinstance(original, staticmethod) else original

    def concatenate(device_mesh_list):
        with unset_fake_temporarily():
            return fn(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


def _trace_once(spec: ModelSpec, *, dp: int, batch: int) -> dict:
    import warnings

    with warnings.catch_warnings(), _fake_world(dp * spec.tp):
        warnings.simplefilter("ignore")
        return _trace_step(spec, dp=dp, batch=batch)


def _trace_step(spec: ModelSpec, *, dp: int, batch: int) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    tp = spec.tp
    names = ("dp", "tp") if tp > 1 else ("dp",)
    mesh = init_device_mesh("cpu", (dp, tp) if tp > 1 else (dp,), mesh_dim_names=names)
    group_dims = {mesh.get_group(d).group_name: d for d in names}
    with _mesh_outside_fake(), FakeTensorMode(allow_non_fake_inputs=True):
        with torch.device("cpu"):
            model = spec.build()
        n_params = sum(p.numel() for p in model.parameters())
        blocks = [fqn for fqn, _ in _blocks(model)]
        if tp > 1:
            _tp_plan(model, mesh["tp"])
        _apply_fsdp(spec, model, mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, spec.vocab, (batch, spec.seq_len))
        rec = _make_recorder(group_dims)
        for fqn, block in _blocks(model):
            block.register_forward_pre_hook(functools.partial(rec.block_input, fqn))
        with _not_recording_sharding_propagation(rec):
            with rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), _loss_context(tp):
                rec.phase = "fw"
                loss = _loss(spec, model, tokens, tp)
            with rec, _loss_context(tp):
                rec.phase = "bw"
                rec._set_unit(None)
                loss.backward()
                rec.phase = "opt"
                rec._set_unit(None)
                opt.step()
        state = {"params": sum(_nbytes(p) for p in model.parameters()),
                 "grads": sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None),
                 "optimizer": sum(_nbytes(v) for s in opt.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor) and v.dim() > 0)}
    return {"items": rec.items, "saved": rec.saved, "state": state, "n_params": n_params, "blocks": blocks,
            "ops": rec.ops}


def _segments(items):
    """Consecutive compute ops of one (phase, unit) -> one segment; collectives and unit marks
    stay in order between them."""
    out = []
    seg = None
    for it in items:
        if it[0] in ("c", "m"):
            _, phase, unit = it[:3]
            if seg is None or seg["phase"] != phase or seg["unit"] != unit:
                seg = {"t": "s", "phase": phase, "unit": unit, "flop": [], "mem": 0}
                out.append(seg)
            if it[0] == "c":
                seg["flop"].append([it[3], it[4], it[5], it[6], it[7]])
            else:
                seg["mem"] += it[4]
        else:
            seg = None
            if it[0] == "u":
                out.append({"t": "u", "phase": it[1], "unit": it[2]})
            else:
                out.append({"t": "x", "phase": it[1], "unit": it[2], "kind": it[3], "dim": it[4], "g": it[5],
                            "S": it[6], "source": it[7], "group": it[8]})
    return out


def _fit(a, b, name):
    """Align two segment lists traced at batch 1 and 2: numbers become [value at 1, slope]."""
    if len(a) != len(b):
        raise RuntimeError(f"{name}: the step at batch 1 and 2 differ in shape ({len(a)} vs {len(b)} events)")
    out = []
    for x, y in zip(a, b):
        if x["t"] != y["t"] or x.get("unit") != y.get("unit") or x.get("phase") != y.get("phase"):
            raise RuntimeError(f"{name}: the step at batch 1 and 2 differ in order")
        z = dict(x)
        if x["t"] == "s":
            if len(x["flop"]) != len(y["flop"]):
                raise RuntimeError(f"{name}: the step at batch 1 and 2 differ in ops")
            z["flop"] = [[(p, q - p) if i < 2 else p for i, (p, q) in enumerate(zip(f1, f2))]
                         for f1, f2 in zip(x["flop"], y["flop"])]
            z["mem"] = (x["mem"], y["mem"] - x["mem"])
        elif x["t"] == "x":
            z["S"] = (x["S"], y["S"] - x["S"])
        out.append(z)
    return out


def _at(pair, b):
    return pair[0] + pair[1] * (b - 1)


@dataclasses.dataclass
class Trace:
    """A traced step: segments fitted in the local batch, the sharded state, the saved tensors."""

    model: str
    spec: ModelSpec
    dp: int  # data-parallel ranks of the traced world
    tp: int
    n_params: int
    blocks: list
    segments: list
    saved: dict  # unit -> ([all, sac, full] at batch 1, slopes)
    state: dict  # bytes per rank at the trace
    ops: int

    @property
    def world(self):
        return self.dp * self.tp

    def flops(self, b=None, *, model=True) -> float:
        """FLOPs of one rank's step at local batch b: model FLOPs (attention counted as 3x its
        forward, as TorchTitan's MFU does) or as traced (the flop counter's attention backward
        recomputes the scores)."""
        b = self.spec.local_batch if b is None else b
        total = 0.0
        for s in self.segments:
            if s["t"] != "s" or s["phase"] == "opt":
                continue
            for f in s["flop"]:
                v = _at(f[0], b)
                if f[2] and model:
                    v = v * 3 if s["phase"] == "fw" else 0
                total += v
        return total

    def collectives(self, b=None):
        """The traced collectives at local batch b: (phase, source, kind, dim, group size, S bytes)."""
        b = self.spec.local_batch if b is None else b
        return [(s["phase"], s["source"], s["kind"], s["dim"], s["g"], _at(s["S"], b), s["group"])
                for s in self.segments if s["t"] == "x"]


def trace(spec: ModelSpec | str, *, dp: int | None = None, **kw) -> Trace:
    """Trace one training step of `spec` on dp x tp fake ranks at local batch 1 and 2
    (dp: 8 without TP, 2 with it)."""
    if isinstance(spec, str):
        spec = model_spec(spec, **kw)
    dp = dp or (8 if spec.tp == 1 else 2)
    if dp < 2:
        raise ValueError("trace with at least 2 data-parallel ranks (FSDP's collectives need a group)")
    one = _trace_once(spec, dp=dp, batch=1)
    two = _trace_once(spec, dp=dp, batch=2)
    segs = _fit(_segments(one["items"]), _segments(two["items"]), spec.name)
    saved = {}
    for u in set(one["saved"]) | set(two["saved"]):
        a = one["saved"].get(u, [0, 0, 0])
        c = two["saved"].get(u, [0, 0, 0])
        saved[u] = [(x, y - x) for x, y in zip(a, c)]
    return Trace(model=spec.name, spec=spec, dp=dp, tp=spec.tp, n_params=one["n_params"], blocks=one["blocks"],
                 segments=segs, saved=saved, state=one["state"], ops=one["ops"])


# --------------------------------------------------------------------------- projection


def _span_dims(extent: int, slice_chips: int, dims: int) -> int:
    """Torus dimensions a group of `extent` consecutive chips spans in a slice (at least 1)."""
    if extent <= 1:
        return 1
    if extent >= slice_chips:
        return dims
    return max(1, min(dims, math.ceil(dims * math.log(extent) / math.log(slice_chips) - 1e-9)))


def collective_time(chip: Chip, kind: str, S: float, g: int, extent: int, n: int, a: Assumptions = ASSUMPTIONS,
                    ici_scale: float = 1.0) -> tuple[float, float]:
    """Seconds for one collective moving a full tensor of S bytes among g ranks whose chips
    span `extent` consecutive chips of an n-chip job; and the bytes each rank sends.

    Per rank: all-gather / reduce-scatter / all-to-all (g-1)/g * S, all-reduce 2 (g-1)/g * S.
    Within a slice the ring runs over the torus dimensions the group spans, at the chip's ICI
    bandwidth times (dimensions spanned / dimensions); beyond a slice (chip.pod_chips) the
    collective is hierarchical: the inter-slice part crosses DCN once per slice."""
    if g <= 1 or S <= 0:
        return 0.0, 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    per_rank = factor * (g - 1) / g * S
    if kind == "broadcast":
        per_rank = S
    slice_chips = min(n, chip.pod_chips)
    n_slices = max(1, math.ceil(extent / slice_chips)) if extent > slice_chips else 1
    in_slice = max(1, g // n_slices)
    ext_in = min(extent, slice_chips)
    k = _span_dims(ext_in, slice_chips, chip.torus_dims)
    bw = chip.ici_bw * ici_scale * k / chip.torus_dims
    t = a.collective_s
    if in_slice > 1:
        ici_bytes = factor * (in_slice - 1) / in_slice * S
        side = in_slice ** (1 / k)
        t += ici_bytes / bw + factor * k * (side - 1) * a.ici_hop_s
    if n_slices > 1:
        dcn_bytes = factor * (n_slices - 1) / n_slices * S / in_slice
        t += dcn_bytes / chip.dcn_bw + factor * math.ceil(math.log2(n_slices)) * a.dcn_hop_s
    return t, per_rank


def _label_of(x) -> str:
    return f"{'FSDP' if x['source'] == 'fsdp' else x['source'].upper()} {x['kind'].replace('_', '-')} ({x['dim']})"


def project(tr: Trace, chip, n: int, *, global_batch: int | None = None, dp_shard: int | None = None,
            ac: str | None = None, assumptions: Assumptions = ASSUMPTIONS, ici_scale: float = 1.0) -> dict:
    """Step time, tokens/s, MFU, the dominant collective and the memory of the traced step on n
    chips. global_batch (sequences) None: TorchTitan's local batch per data-parallel rank (weak
    scaling). dp_shard: FSDP group size (HSDP: replicas all-reduce the sharded gradients);
    None shards over every data-parallel rank."""
    a = assumptions
    c = CHIPS[chip] if isinstance(chip, str) else chip
    tp = tr.tp
    if n < 1:
        raise ValueError(f"{n} chips: at least 1")
    if n % tp:
        raise ValueError(f"{n} chips: not a multiple of the TP degree {tp}")
    dp = n // tp
    ds = dp if not dp_shard or dp_shard < 0 else int(dp_shard)
    if ds > dp or dp % ds:
        raise ValueError(f"FSDP group of {ds}: must divide the {dp} data-parallel ranks")
    rep = dp // ds
    if global_batch is None:
        b = tr.spec.local_batch
        gb = b * dp
    else:
        gb = int(global_batch)
        if gb % dp or gb < dp:
            raise ValueError(f"global batch {gb}: not a multiple of the {dp} data-parallel ranks")
        b = gb // dp
    ac = ac or tr.spec.ac
    peak = c.bf16_flops * a.efficiency

    def op_time(f):
        flops = _at(f[0], b)
        if f[2] and f[3]:  # causal attention: only the blocks on or below the diagonal
            nb = max(1, math.ceil(f[3] / a.causal_block))
            flops *= (nb + 1) / (2 * nb)
        return max(flops / peak, _at(f[1], b) / c.hbm_bw)

    def mem_time(seg):
        t = _at(seg["mem"], b) * a.fusion / c.hbm_bw
        return t * (tr.dp / ds) if seg["phase"] == "opt" else t  # the optimizer works on the shard

    extents = {"tp": tp, "dp": ds * tp, "dp_replicate": n}
    sizes = {"tp": tp, "dp": ds, "dp_replicate": rep}

    def coll(x, S=None):
        g = sizes.get(x["dim"], x["g"])
        S = _at(x["S"], b) if S is None else S
        return collective_time(c, x["kind"], S, g, extents.get(x["dim"], n), n, a, ici_scale)

    # Recompute under activation checkpointing: the forward of each block again, in its backward
    # (selective: what TorchTitan's policy does not save; TP all-gathers are recomputed too).
    recompute = {}
    if ac in ("selective", "full"):
        for s in tr.segments:
            if s["phase"] != "fw" or s["unit"] not in tr.blocks:
                continue
            r = recompute.setdefault(s["unit"], [0.0, 0.0, {}])
            if s["t"] == "s":
                for f in s["flop"]:
                    if ac == "full" or not f[4]:
                        r[0] += op_time(f)
                        r[1] += _at(f[0], b)
                r[0] += mem_time(s)
            elif s["t"] == "x" and s["source"] == "tp" and (ac == "full" or s["kind"] != "reduce_scatter"):
                label = _label_of(s)
                r[2][label] = r[2].get(label, 0.0) + coll(s)[0]

    t_c = t_m = 0.0
    compute = 0.0
    cur_start = prev_start = 0.0
    cur_unit = None
    ready = {}
    todo_recompute = set(recompute)
    by_class = {}
    hw_flops = 0.0
    parts = {"matmul_s": 0.0, "attention_s": 0.0, "memory_bound_s": 0.0, "recompute_s": 0.0, "optimizer_s": 0.0}
    opt_started = False
    for s in tr.segments:
        if s["t"] == "u":
            if s["unit"] is not None and s["unit"] != cur_unit:
                prev_start, cur_start = cur_start, t_c
            cur_unit = s["unit"]
            continue
        if s["t"] == "s":
            if s["phase"] == "opt" and not opt_started:
                t_c = max(t_c, t_m)  # the optimizer needs every reduce-scatter
                opt_started = True
            if s["unit"] in ready:
                t_c = max(t_c, ready.pop(s["unit"]))
            dt = 0.0
            if s["phase"] == "bw" and s["unit"] in todo_recompute:
                todo_recompute.discard(s["unit"])
                r = recompute[s["unit"]]
                dt += r[0]
                hw_flops += r[1]
                parts["recompute_s"] += r[0]
                for label, t in r[2].items():  # the recomputed forward's TP collectives
                    t_c += t
                    by_class[label] = by_class.get(label, 0.0) + t
            for f in s["flop"]:
                t = op_time(f)
                dt += t
                parts["attention_s" if f[2] else "matmul_s"] += t
                hw_flops += _at(f[0], b)
            t = mem_time(s)
            dt += t
            parts["optimizer_s" if s["phase"] == "opt" else "memory_bound_s"] += t
            t_c += dt
            compute += dt
            continue
        # a collective
        t, _ = coll(s)
        label = _label_of(s)
        if s["source"] == "fsdp":
            if s["kind"] == "all_gather":
                issue = prev_start if s["group"] == cur_unit else cur_start
                start = max(t_m, issue)
                t_m = start + t
                ready[s["group"]] = t_m
            else:
                start = max(t_m, t_c)
                t_m = start + t
                if rep > 1 and s["kind"] == "reduce_scatter":  # HSDP: all-reduce the shard
                    t2, _ = collective_time(c, "all_reduce", _at(s["S"], b) / ds, rep, n, n, a, ici_scale)
                    t_m += t2
                    lab2 = "HSDP all-reduce (dp_replicate)"
                    by_class[lab2] = by_class.get(lab2, 0.0) + t2
        else:
            t_c += t  # TP collectives sit on the critical path
        by_class[label] = by_class.get(label, 0.0) + t
    step = max(t_c, t_m)
    model_flops = tr.flops(b)
    tokens = gb * tr.spec.seq_len
    mem = memory(tr, c, ds=ds, b=b, ac=ac, a=a)
    dominant = max(by_class.items(), key=lambda kv: kv[1]) if by_class else ("none", 0.0)
    return {
        "model": tr.model, "chip": c.key, "chips": n, "tp": tp, "dp": dp, "fsdp_group": ds, "replicas": rep,
        "ac": ac, "seq_len": tr.spec.seq_len, "local_batch": b, "global_batch": gb, "tokens_per_step": tokens,
        "step_s": step, "compute_s": compute, "exposed_comm_s": max(0.0, step - compute), "compute_parts_s": parts,
        "tokens_per_s": tokens / step, "tokens_per_s_per_chip": tokens / step / n,
        "mfu": model_flops / (step * c.bf16_flops), "model_flops_per_chip": model_flops,
        "hardware_flops_per_chip": hw_flops,
        "dominant_collective": dominant[0], "dominant_collective_s": dominant[1],
        "collective_s": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        "memory_gib": mem["total"] / GiB, "hbm_gib": c.hbm_bytes / GiB, "fits": mem["total"] <= c.hbm_bytes,
        "memory_breakdown_gib": {k: v / GiB for k, v in mem.items() if k != "total"},
    }


def memory(tr: Trace, chip: Chip, *, ds: int, b: int, ac: str, a: Assumptions = ASSUMPTIONS) -> dict:
    """HBM per chip: sharded parameters, gradients and optimizer state (measured at the trace,
    scaled to an FSDP group of ds), FSDP's unsharded buffers, and the saved activations."""
    scale = tr.dp / ds
    state = {k: v * scale for k, v in tr.state.items()}
    ag = max((_at(s["S"], b) for s in tr.segments if s["t"] == "x" and s["source"] == "fsdp"
              and s["kind"] == "all_gather"), default=0)
    rs = max((_at(s["S"], b) for s in tr.segments if s["t"] == "x" and s["source"] == "fsdp"
              and s["kind"] == "reduce_scatter"), default=0)
    col = {"none": 0, "selective": 1, "full": 2}[ac]
    acts, work = 0.0, 0.0
    for unit, rows in tr.saved.items():
        full = _at(rows[0], b)
        kept = full if unit not in tr.blocks else _at(rows[col], b)
        acts += kept
        if unit in tr.blocks:
            work = max(work, full)  # one block's activations live again in its backward
    out = dict(state)
    out["fsdp_buffers"] = a.buffers * ag + rs
    out["activations"] = acts + (work if ac != "none" else 0)
    out["total"] = sum(out.values())
    return out


# --------------------------------------------------------------------------- reports

CHIP_COUNTS = (8, 256, 1024, 8192)


def _ms(seconds) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 10 else f"{ms:.3g}"


def fmt_row(r) -> list:
    return [r["model"], r["chip"], str(r["chips"]), f"{r['tp']}x{r['fsdp_group']}" + (
        f"x{r['replicas']}" if r["replicas"] > 1 else ""), str(r["global_batch"]), _ms(r["step_s"]),
        f"{r['tokens_per_s']:.3g}", f"{r['mfu']:.1%}", f"{r['exposed_comm_s'] * 1e3:.1f}",
        f"{r['dominant_collective']} {r['dominant_collective_s'] * 1e3:.1f} ms",
        f"{r['memory_gib']:.1f}/{r['hbm_gib']:.0f}" + ("" if r["fits"] else " NO")]


HEAD = ["model", "chip", "chips", "TPxFSDP", "batch (seq)", "step ms", "tokens/s", "MFU", "exposed comm ms",
        "dominant collective (total)", "HBM GiB used/cap"]


def table(rows, markdown=False) -> str:
    body = [fmt_row(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(HEAD) + " |", "|" + "|".join("---" for _ in HEAD) + "|"]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body]) + "\n"
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(HEAD)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEAD, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines) + "\n"


def summary(tr: Trace) -> dict:
    """What the trace holds, for the JSON: FLOPs, parameters, collectives by class."""
    b = tr.spec.local_batch
    colls = {}
    for phase, source, kind, dim, g, S, _ in tr.collectives(b):
        k = f"{phase} {source} {kind} ({dim})"
        e = colls.setdefault(k, {"count": 0, "full_bytes": 0.0, "group_size_at_trace": g})
        e["count"] += 1
        e["full_bytes"] += S
    return {"model": tr.model, "params": tr.n_params, "traced_world": {"dp": tr.dp, "tp": tr.tp},
            "seq_len": tr.spec.seq_len, "local_batch": b, "ac": tr.spec.ac,
            "model_flops_per_rank": tr.flops(b), "traced_flops_per_rank": tr.flops(b, model=False),
            "aten_ops_per_step": tr.ops, "collectives": colls,
            "state_bytes_per_rank_at_trace": tr.state}


def run(model: str, projects, *, seq_len=None, batch=None, tp=None, ac=None, global_batch=None, dp_shard=None,
        trace_dp: int | None = None, assumptions: Assumptions = ASSUMPTIONS) -> dict:
    """Trace `model` once and project it onto each CHIP:N of `projects`."""
    targets = [parse_project(p) for p in projects]
    spec = model_spec(model, seq_len=seq_len, local_batch=batch, tp=tp, ac=ac)
    tr = trace(spec, dp=trace_dp)
    rows = [project(tr, k, n, global_batch=global_batch, dp_shard=dp_shard, assumptions=assumptions)
            for k, n in targets]
    return {"trace": summary(tr), "assumptions": dataclasses.asdict(assumptions),
            "chips": {k: dataclasses.asdict(CHIPS[k]) for k, _ in targets}, "rows": rows,
            "note": "a projection from the traced step's graphs and published chip numbers, not a measurement"}


DOC_TRACES = [  # (model, options): TorchTitan's configs first, then the other plans
    ("titan:llama3:8B", {}), ("titan:qwen3:8B", {}), ("titan:llama3:70B", {}),
    ("titan:llama3:8B", {"tp": 8}), ("titan:llama3:70B", {"tp": 1, "local_batch": 1}),
    ("titan:llama3:8B", {"tp": 4}), ("titan:llama3:70B", {"tp": 4, "local_batch": 1}),
]
DOC_GLOBAL_BATCH = 2048  # sequences of 8192 tokens: 16.8M tokens per step


def doc_tables(out=None) -> str:
    """The tables of docs/scale.md (python -m torch_tpu.scale --doc): each plan traced once."""
    traces = [trace(model_spec(name, **kw)) for name, kw in DOC_TRACES]

    def rows_for(tr, counts=CHIP_COUNTS, **kw):
        rows = []
        for k in CHIPS:
            for n in counts:
                try:
                    rows.append(project(tr, k, n, **kw))
                except ValueError as e:
                    rows.append({"model": tr.model, "chip": k, "chips": n, "tp": tr.tp, "error": str(e)})
        return rows

    sections = []
    everything = {}

    def section(title, rows):
        everything[title] = rows
        text = f"#### {title}\n\n" + table([r for r in rows if "error" not in r], markdown=True)
        for r in rows:
            if "error" in r:
                text += f"\n- {r['model']} TP {r['tp']} on {r['chips']} {r['chip']}: not projected: {r['error']}"
        sections.append(text + "\n")

    def plan(tr):
        return f"TP {tr.tp}, {tr.spec.ac} AC, {tr.spec.local_batch} x {tr.spec.seq_len} tokens per data-parallel rank"

    for tr in traces[:3]:
        section(f"{tr.model}: TorchTitan's config ({plan(tr)})", rows_for(tr))
    for tr in traces[3:5]:
        section(f"{tr.model}: another plan ({plan(tr)})", rows_for(tr))
    fixed = []
    for tr in sorted((t for t in traces if t.model != "titan:qwen3:8B"), key=lambda t: (t.model, t.tp)):
        fixed += rows_for(tr, (1024, 8192), global_batch=DOC_GLOBAL_BATCH)
    section(f"Global batch fixed at {DOC_GLOBAL_BATCH} sequences ({DOC_GLOBAL_BATCH * 8192 / 1e6:.1f}M tokens), "
            "1,024 and 8,192 chips", fixed)
    base = traces[0]
    section(f"{base.model}, HSDP on 8,192 chips: FSDP groups of 256 and 1,024, the replicas all-reduce",
            [project(base, k, 8192, dp_shard=ds) for k in CHIPS for ds in (256, 1024)])
    tp8 = traces[3]
    variants = [(base, {}, "as assumed"), (base, {"ici_scale": 0.5}, "ICI halved"),
                (base, {"assumptions": dataclasses.replace(ASSUMPTIONS, efficiency=0.6)}, "efficiency 0.6"),
                (base, {"assumptions": dataclasses.replace(ASSUMPTIONS, fusion=1.0)}, "no fusion"),
                (base, {"assumptions": dataclasses.replace(ASSUMPTIONS, fusion=0.0)}, "elementwise free"),
                (base, {"ac": "none"}, "no AC"),
                (tp8, {"global_batch": DOC_GLOBAL_BATCH}, f"TP 8, {DOC_GLOBAL_BATCH} seq"),
                (tp8, {"global_batch": DOC_GLOBAL_BATCH, "ici_scale": 0.5}, f"TP 8, {DOC_GLOBAL_BATCH} seq, ICI halved"),
                (tp8, {"global_batch": DOC_GLOBAL_BATCH, "ici_scale": 2.0}, f"TP 8, {DOC_GLOBAL_BATCH} seq, ICI doubled")]
    rows = []
    for tr, kw, what in variants:
        r = project(tr, "v7x", 8192, **kw)
        r["model"] = f"{r['model']} ({what})"
        rows.append(r)
    section("Sensitivity on 8,192 TPU7x chips", rows)
    if out:
        with open(out, "w") as f:
            json.dump({"traces": [summary(t) for t in traces], "tables": everything,
                       "assumptions": dataclasses.asdict(ASSUMPTIONS),
                       "chips": {k: dataclasses.asdict(c) for k, c in CHIPS.items()}}, f, indent=1)
    return "\n".join(sections)


@contextlib.contextmanager
def _quiet():
    import logging

    level = logging.root.level
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
        logging.root.setLevel(level)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch_tpu.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="titan:llama3:8B")
    ap.add_argument("--project", action="append", metavar="CHIP:N",
                    help="e.g. v5p:256 (repeat); default: v5p, v6e, v7x at 8, 256, 1024, 8192 chips")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int, help="sequences per data-parallel rank (default: the config's)")
    ap.add_argument("--global-batch", type=int, help="sequences per step (default: batch x data-parallel ranks)")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--fsdp-group", type=int, help="HSDP: FSDP group size (default: all data-parallel ranks)")
    ap.add_argument("--ac", choices=("none", "selective", "full"))
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--doc", action="store_true", help="print the tables of docs/scale.md (traces 7 plans; minutes)")
    args = ap.parse_args(argv)
    if args.doc:
        with _quiet():
            sys.stdout.write(doc_tables(args.out))
        return 0
    projects = args.project or [f"{c}:{n}" for c in CHIPS for n in CHIP_COUNTS]
    try:
        with _quiet():
            result = run(args.model, projects, seq_len=args.seq_len, batch=args.batch, tp=args.tp, ac=args.ac,
                         global_batch=args.global_batch, dp_shard=args.fsdp_group)
    except ValueError as e:
        print(f"torch_tpu.scale: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(table(result["rows"], markdown=args.markdown))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
