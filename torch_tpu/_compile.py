"""The `tpu` backend of torch.compile.

Dynamo captures the graph; AOTAutograd functionalizes it, applies PyTorch's core ATen
decompositions and splits it into forward and backward graphs. Each graph runs through
the same lowering table as eager, recorded into one pending graph with no loop or size
cuts, and becomes one StableHLO program, compiled once and kept in the shared
compilation cache (memory and disk): a second process loads it instead of compiling.
Python scalars that reach a graph as inputs are program inputs, so a new value does not
compile a new program; a new input shape does (and says so in the recompile log).

Ops whose result size depends on data (nonzero, unique, ...) end the program early and
the rest of the graph becomes a second program; ops without a lowering run on the CPU
as in eager (TORCH_TPU_FALLBACK=error makes them an error).
"""

from __future__ import annotations

import itertools
import threading

import torch

from . import _C

_graphs: list[dict] = []  # one entry per compiled graph: name, ops, first-call compiles
_lock = threading.Lock()
_counter = itertools.count()


def compiled_graphs() -> list[dict]:
    """The graphs the backend has compiled: name, FX op count, calls, replays of the
    captured program, XLA programs compiled and compile seconds on its first call."""
    with _lock:
        return [dict(g) for g in _graphs]


def _reset() -> None:
    with _lock:
        _graphs.clear()


def _run_whole_graph(fn, args):
    was = _C._begin_whole_graph()
    try:
        out = fn(*args)
    except BaseException:
        try:
            _C._end_whole_graph(was)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        raise
    _C._end_whole_graph(was)
    return out


class _Graph:
    """One AOTAutograd graph. The first call per argument signature records it as one
    program (through the eager lowerings); later calls replay that program with the new
    arguments, lowering nothing. Graphs that cannot be replayed (they read data on the
    host, split into several programs, or run an op on the CPU) run as one fused graph
    each call."""

    def __init__(self, gm, kind):
        self.run = gm.forward
        # Recorded programs, one per argument signature (dtype, device, sizes,
        # strides, storage offset: checked by the replay itself).
        self.captured = []
        self.entry = {"name": f"{kind}_{next(_counter)}",
                      "ops": sum(1 for n in gm.graph.nodes if n.op == "call_function"),
                      "calls": 0, "replays": 0, "programs_compiled": 0, "compile_seconds": 0.0}
        with _lock:
            _graphs.append(self.entry)

    def __call__(self, *args):
        first = self.entry["calls"] == 0
        if first:
            # The caller's pending fused-eager work runs at capture start anyway;
            # run it first so that its compiles are not counted as this graph's.
            for a in args:
                if isinstance(a, torch.Tensor) and a.device.type == "tpu":
                    _C._synchronize(a.device.index or 0)
                    break
            m0 = _C._metrics()
        out = self._call(args)
        self.entry["calls"] += 1
        if first:
            m1 = _C._metrics()
            self.entry["programs_compiled"] = m1["compiles"] - m0["compiles"]
            self.entry["compile_seconds"] = round(m1["compile_seconds"] - m0["compile_seconds"], 4)
        return out

    def _call(self, args):
        # Symbolic sizes and Python numbers: no replay (the recording bakes them in).
        # Other objects (a DeviceMesh or process group that functional collectives
        # name) are part of what was recorded: a replay needs equal ones.
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        objects = tuple(a for a in args if not isinstance(a, torch.Tensor))
        replayable = not any(map(_is_number, objects))
        if replayable:
            for graph, objs, out_objects in self.captured:
                if len(objs) != len(objects) or not all(map(_same_object, objs, objects)):
                    continue
                outs = _C._replay(graph, tensors)
                if outs is not None:
                    self.entry["replays"] += 1
                    outs = iter(outs)
                    return tuple(next(outs) if o is _TENSOR else o for o in out_objects)
        if not replayable or not _C._capture_begin(tensors):
            return _run_whole_graph(self.run, args)
        try:
            out = self.run(*args)
        except BaseException:
            _C._capture_abort()
            raise
        flat = list(out) if isinstance(out, (tuple, list)) else None
        # Outputs other than tensors: objects (a DeviceMesh) are returned as they were;
        # numbers would change call after call.
        if flat is None or not all(o is None or isinstance(o, torch.Tensor) or not _is_number(o) for o in flat):
            _C._capture_abort()
            return out
        graph = _C._capture_end([o for o in flat if o is None or isinstance(o, torch.Tensor)])
        if graph is not None:
            out_objects = tuple(_TENSOR if o is None or isinstance(o, torch.Tensor) else o for o in flat)
            self.captured.append((graph, objects, out_objects))
        return out


_TENSOR = object()  # a captured graph's output that is a tensor (or None), in its place


def _is_number(a) -> bool:
    return isinstance(a, (int, float, bool, complex, torch.SymInt, torch.SymFloat, torch.SymBool))


def _same_object(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)  # a DeviceMesh made again for the same ranks
    except Exception:  # noqa: BLE001 - objects that do not compare are not the same
        return False


def _graph_compiler(kind: str):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func

        return make_boxed_func(_Graph(gm, kind))

    return compile_graph


def _decompositions() -> dict:
    """Core ATen decompositions, except attention and layer norm: the device
    lowers the fused attention op and layer norm, forward and backward, as one op
    each (on the CPU plugin, one kernel each), see csrc/ops/attention.cpp and
    csrc/ops/nn.cpp."""
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    for op in (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
               torch.ops.aten.layer_norm.default, torch.ops.aten.native_layer_norm_backward.default):
        table.pop(op, None)
    return table


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """torch.compile(model, backend="tpu")."""
    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(
        fw_compiler=_graph_compiler("forward"),
        bw_compiler=_graph_compiler("backward"),
        inference_compiler=_graph_compiler("inference"),
        decompositions=_decompositions(),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs, **kwargs)


def _register() -> None:
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends.registry import lookup_backend

    with _lock:
        if "tpu" not in list_backends(exclude_tags=()):
            register_backend(compiler_fn=tpu_backend, name="tpu")
            return
        # Found through the entry point: load it now. Dynamo loads it at the first
        # compile otherwise, and two threads compiling at once (ranks as threads)
        # both registered it ("duplicate name: tpu").
        lookup_backend("tpu")
