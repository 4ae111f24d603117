"""torch.tpu.comm: one process driving several tpu devices, as ``torch.cuda.comm`` does
for GPUs (same functions, same signatures).

Each function is an XLA collective program over the devices involved (all_gather,
all_reduce, all_to_all with one replica per device, launched once over all of them and
cached like every program), so the data moves device to device inside XLA, never
through Python. ``torch_tpu.metrics()`` counts them in ``dist_xla_collectives`` and
``dist_xla_bytes``. With the CPU plugin, ``TORCH_TPU_CPU_DEVICES=N`` gives N devices.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import torch

from . import _C

__all__ = ["broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter", "gather"]


def _index(device) -> int:
    if isinstance(device, torch.device):
        if device.type == "cpu":
            return -1
        if device.type != "tpu":
            raise ValueError(f"torch.tpu.comm: expected a tpu device, got {device}")
        return torch.tpu.current_device() if device.index is None else device.index
    if isinstance(device, str):
        return _index(torch.device(device))
    if isinstance(device, int):
        return device
    raise TypeError(f"torch.tpu.comm: expected a device or an index, got {type(device).__name__}")


def _devices(devices) -> List[int]:
    if devices is None:
        raise ValueError("torch.tpu.comm: 'devices' must be given")
    idx = [_index(d) for d in devices]
    if len(set(idx)) != len(idx):
        raise ValueError(f"torch.tpu.comm: devices repeat: {idx}")
    n = torch.tpu.device_count()
    for d in idx:
        if not 0 <= d < n:
            raise ValueError(f"torch.tpu.comm: tpu:{d} does not exist ({n} devices)")
    return idx


def _on(t: torch.Tensor) -> int:
    return t.device.index if t.device.type == "tpu" else -1


def _broadcast_flat(flat: torch.Tensor, devices: List[int]) -> List[torch.Tensor]:
    """flat (1-D, on devices[0]) on every device, as one broadcast program."""
    if len(devices) == 1:
        return [flat]
    inputs = [flat] + [torch.empty(flat.numel(), dtype=flat.dtype, device=f"tpu:{d}") for d in devices[1:]]
    return _C._comm_collective("broadcast", inputs, "sum", 0)


def _source_on_first(tensor: torch.Tensor, devices: List[int]) -> torch.Tensor:
    return tensor if _on(tensor) == devices[0] else tensor.to(f"tpu:{devices[0]}")


def broadcast(tensor: torch.Tensor, devices: Optional[Iterable] = None, *, out: Optional[Sequence[torch.Tensor]] = None):
    """Copies ``tensor`` to ``devices`` (or into ``out``, one tensor per device). The
    result on the tensor's own device is the tensor itself, as on CUDA."""
    if (devices is None) == (out is None):
        raise RuntimeError("torch.tpu.comm.broadcast: give exactly one of 'devices' and 'out'")
    idx = _devices(devices) if out is None else _devices([o.device for o in out])
    if out is not None:
        for o in out:
            if o.shape != tensor.shape:
                raise RuntimeError(f"torch.tpu.comm.broadcast: out shape {tuple(o.shape)} != {tuple(tensor.shape)}")
    # The source's device first: it is the broadcast's root.
    order = sorted(idx, key=lambda d: d != _on(tensor))
    src = _source_on_first(tensor, order)
    copies = dict(zip(order, _broadcast_flat(src.contiguous().view(-1), order)))
    results = []
    for i, d in enumerate(idx):
        r = tensor if d == _on(tensor) else copies[d].view(tensor.shape)
        if out is not None:
            out[i].copy_(r)
            r = out[i]
        results.append(r)
    return tuple(results)


def _coalesce(tensors: Sequence[torch.Tensor], buffer_size: int):
    """Groups of tensor indices that share a dtype, each group at most buffer_size bytes
    (a tensor larger than the buffer goes alone)."""
    groups, sizes = {}, {}
    out = []
    for i, t in enumerate(tensors):
        key = t.dtype
        nbytes = t.numel() * t.element_size()
        if key in groups and sizes[key] + nbytes > buffer_size:
            out.append(groups.pop(key))
            sizes.pop(key)
        groups.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + nbytes
    out.extend(groups.values())
    return out


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, one after another, as one flat tensor."""
    return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)


def _unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of `flat` shaped as `like`, in the order _pack laid them out."""
    views, offset = [], 0
    for t in like:
        views.append(flat.narrow(0, offset, t.numel()).view(t.shape))
        offset += t.numel()
    return views


def _padded(flat: torch.Tensor, m: int) -> torch.Tensor:
    """`flat` with zeros after it up to `m` elements (blocks of one size for a collective)."""
    return torch.nn.functional.pad(flat, (0, m - flat.numel())) if flat.numel() < m else flat


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Iterable, buffer_size: int = 10485760):
    """Broadcasts ``tensors`` (all on ``devices[0]``) to ``devices``, packing each dtype's
    tensors into one buffer of at most ``buffer_size`` bytes per program. Returns one
    tuple of tensors per device; ``devices[0]``'s are the inputs."""
    idx = _devices(devices)
    tensors = list(tensors)
    for t in tensors:
        if _on(t) != idx[0]:
            raise RuntimeError(f"torch.tpu.comm.broadcast_coalesced: every tensor must be on tpu:{idx[0]}, got {t.device}")
    per_device = [[None] * len(tensors) for _ in idx]
    per_device[0] = list(tensors)
    for group in _coalesce(tensors, buffer_size):
        members = [tensors[i] for i in group]
        copies = _broadcast_flat(_pack(members), idx)
        for k in range(1, len(idx)):
            for i, view in zip(group, _unpack(copies[k], members)):
                per_device[k][i] = view
    return [tuple(p) for p in per_device]


def _destination(destination) -> int:
    """A destination's index (-1: the host); None: the current device."""
    if destination is None:
        return torch.tpu.current_device()
    return _index(destination)


def reduce_add(inputs: Sequence[torch.Tensor], destination=None) -> torch.Tensor:
    """The sum of ``inputs`` (one tensor per device, same shape) on ``destination``
    (default: the current device; -1 or "cpu": the host), as one all_reduce program."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("torch.tpu.comm.reduce_add: no inputs")
    shape = inputs[0].shape
    for t in inputs:
        if t.shape != shape:
            raise ValueError(f"torch.tpu.comm.reduce_add: input shapes differ: {tuple(t.shape)} vs {tuple(shape)}")
        if _on(t) < 0:
            raise ValueError(f"torch.tpu.comm.reduce_add: expected tpu tensors, got one on {t.device}")
    devs = _devices([t.device for t in inputs])
    dest = _destination(destination)
    sums = _C._comm_collective("all_reduce", [t.contiguous().view(-1) for t in inputs], "sum", 0)
    here = devs.index(dest) if dest in devs else 0
    result = sums[here].view(shape)
    return result if dest == devs[here] else result.to("cpu" if dest < 0 else f"tpu:{dest}")


def reduce_add_coalesced(inputs: Sequence[Sequence[torch.Tensor]], destination=None, buffer_size: int = 10485760):
    """``reduce_add`` of each position of ``inputs`` (one list of tensors per device),
    packing each dtype's tensors into buffers of at most ``buffer_size`` bytes."""
    inputs = [list(ts) for ts in inputs]
    if not inputs:
        raise ValueError("torch.tpu.comm.reduce_add_coalesced: no inputs")
    count = len(inputs[0])
    if any(len(ts) != count for ts in inputs):
        raise ValueError("torch.tpu.comm.reduce_add_coalesced: every device needs the same number of tensors")
    results: List[Optional[torch.Tensor]] = [None] * count
    for group in _coalesce(inputs[0], buffer_size):
        total = reduce_add([_pack([ts[i] for i in group]) for ts in inputs], destination)
        for i, view in zip(group, _unpack(total, [inputs[0][i] for i in group])):
            results[i] = view
    return tuple(results)


def scatter(tensor: torch.Tensor, devices: Optional[Iterable] = None, chunk_sizes=None, dim: int = 0, streams=None, *,
            out: Optional[Sequence[torch.Tensor]] = None):
    """Splits ``tensor`` along ``dim`` (in ``chunk_sizes``, or evenly) and puts chunk i on
    ``devices[i]`` (or into ``out[i]``). A host tensor is uploaded chunk by chunk; a tpu
    tensor moves in one all_to_all program from its device."""
    if (devices is None) == (out is None):
        raise RuntimeError("torch.tpu.comm.scatter: give exactly one of 'devices' and 'out'")
    idx = _devices(devices) if out is None else _devices([o.device for o in out])
    if out is not None:
        chunk_sizes = [o.shape[dim] for o in out]
    if chunk_sizes is None:
        # Fewer rows than devices make fewer chunks: the last devices get none, as on CUDA.
        chunks = list(tensor.chunk(len(idx), dim))
        idx = idx[:len(chunks)]
    else:
        if len(chunk_sizes) != len(idx) or sum(chunk_sizes) != tensor.shape[dim]:
            raise ValueError(f"torch.tpu.comm.scatter: chunk sizes {list(chunk_sizes)} do not split {tensor.shape[dim]} "
                             f"over {len(idx)} devices")
        chunks = list(tensor.split(list(chunk_sizes), dim))
    if _on(tensor) < 0 or len(idx) == 1:
        results = [c.to(f"tpu:{d}") for c, d in zip(chunks, idx)]
    else:
        results = _scatter_on_device(tensor, chunks, idx)
    if out is not None:
        for o, r in zip(out, results):
            o.copy_(r)
        return tuple(out)
    return tuple(results)


def _scatter_on_device(tensor, chunks, idx):
    src = _on(tensor)
    order = sorted(idx, key=lambda d: d != src)
    if src != order[0]:
        tensor = tensor.to(f"tpu:{order[0]}")
        chunks = [c.to(f"tpu:{order[0]}") for c in chunks]
    by_device = dict(zip(idx, chunks))
    m = max(c.numel() for c in chunks)
    if m == 0:
        return [c.to(f"tpu:{d}") for c, d in zip(chunks, idx)]
    blocks = [_padded(by_device[d].reshape(-1), m) for d in order]
    send = [torch.cat(blocks)] + [torch.empty(len(order) * m, dtype=tensor.dtype, device=f"tpu:{d}") for d in order[1:]]
    got = dict(zip(order, _C._comm_collective("all_to_all", send, "sum", 0)))
    # Replica r's block 0 came from the root: its chunk for r.
    return [by_device[d] if d == order[0] else got[d].narrow(0, 0, by_device[d].numel()).view(by_device[d].shape)
            for d in idx]


def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination=None, *, out: Optional[torch.Tensor] = None):
    """Concatenates ``tensors`` (one per device) along ``dim`` on ``destination`` (default:
    the current device; -1 or "cpu": the host), or into ``out``. Between tpu devices the
    blocks move in one all_gather program."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("torch.tpu.comm.gather: no tensors")
    if out is not None and destination is not None:
        raise RuntimeError("torch.tpu.comm.gather: give at most one of 'destination' and 'out'")
    dest = _on(out) if out is not None else _destination(destination)
    devs = [_on(t) for t in tensors]
    ndim = tensors[0].dim()
    d = dim % ndim if ndim else 0
    for t in tensors:
        if t.dim() != ndim or any(t.shape[k] != tensors[0].shape[k] for k in range(ndim) if k != d):
            raise ValueError("torch.tpu.comm.gather: tensors must match in every dimension but 'dim'")
    if dest < 0 or min(devs) < 0 or len(set(devs)) != len(devs) or len(tensors) == 1:
        where = "cpu" if dest < 0 else f"tpu:{dest}"
        result = torch.cat([t.to(where) for t in tensors], dim)
    else:
        m = max(t.numel() for t in tensors)
        blocks = [t.reshape(-1) for t in tensors]
        blocks = [_padded(b, m) for b in blocks]
        here = devs.index(dest) if dest in devs else 0
        gathered = _C._comm_collective("all_gather", blocks, "sum", 0)[here] if m else None
        parts = [gathered.narrow(0, i * m, t.numel()).view(t.shape) if m else t.to(f"tpu:{devs[here]}")
                 for i, t in enumerate(tensors)]
        result = torch.cat(parts, dim)
        if devs[here] != dest:
            result = result.to(f"tpu:{dest}")
    if out is not None:
        out.copy_(result)
        return out
    return result
