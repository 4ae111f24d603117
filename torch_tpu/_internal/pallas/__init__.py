"""``jax_op`` as Google's TorchTPU spells it (TorchRec's Pallas embedding kernels, Helion's
exports): a JAX or Pallas function becomes a PyTorch op, built on ``torch_tpu.kernels``.

``jax_op("ns::name", fn)`` (or ``@jax_op("ns::name")``): the parameters annotated as arrays
(``jax.Array``, ``torch.Tensor``, optional or not) are the op's tensors; every other parameter is
a compile-time value (a program per value), passed by position or by keyword. The op runs
where torch_tpu's JAX kernels run: lowered for the running plugin and fused with the ops around
it, with ``jax.vjp`` as its gradient. A Pallas kernel written for a TPU (Mosaic) lowers on a
TPU only; elsewhere it raises JAX's own error, or runs with ``interpret=True``.

Sharded kernels (``mesh=``, partition specs) need a TPU slice and Google's SPMD runtime: they
raise NotImplementedError. ``donate_argnums`` is accepted; inputs are not invalidated.
"""

from __future__ import annotations

import inspect
import re
import typing
from typing import Callable, Optional

__all__ = ["jax_op", "get_pallas_mesh", "get_default_pallas_mesh"]


def _is_array(annotation) -> bool:
    """jax.Array, torch.Tensor, Optional[...] of them (as objects or as strings)."""
    if isinstance(annotation, str):
        return bool(re.search(r"\b(jax\.Array|Array|torch\.Tensor|Tensor|jnp\.ndarray)\b", annotation))
    if annotation is inspect.Parameter.empty:
        return False
    args = typing.get_args(annotation)
    if args:
        return any(_is_array(a) for a in args if a is not type(None))
    name = getattr(annotation, "__name__", "")
    module = getattr(annotation, "__module__", "")
    return name in ("Array", "ndarray", "Tensor") and module.split(".")[0] in ("jax", "jaxlib", "torch", "numpy")


class _JaxOp:
    """The op: ``op(*args, **kwargs)`` with the function's own parameters."""

    def __init__(self, name: str, fn: Callable):
        from torch_tpu import kernels

        if name.count("::") != 1 or not all(name.split("::")):
            raise ValueError(f"jax_op: the name must be 'namespace::op', got {name!r}")
        self.name = name
        self._fn = fn
        self._sig = inspect.signature(fn)
        for p in self._sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"jax_op {name!r}: *args and **kwargs parameters are not supported")
        self._arrays = [p.name for p in self._sig.parameters.values() if _is_array(p.annotation)]
        kernel_name = re.sub(r"\W", "_", name.replace("::", "__"))

        def by_name(*arrays, _present: str = "", **static):
            present = _present.split(",") if _present else []
            return fn(**dict(zip(present, arrays)), **static)

        self._kernel = kernels.jax_op(by_name, name=kernel_name)

    def __call__(self, *args, **kwargs):
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        arrays, static, present = [], {}, []
        for pname, value in bound.arguments.items():
            if pname in self._arrays:
                if value is not None:
                    arrays.append(value)
                    present.append(pname)
                continue
            static[pname] = value
        return self._kernel(*arrays, _present=",".join(present), **static)

    def __repr__(self):
        return f"<jax_op {self.name}>"


def jax_op(name: str, fn: Optional[Callable] = None, /, *, donate_argnums=None, mesh=None,
           input_partition_specs=None, output_partition_specs=None):
    """A JAX (or Pallas) function as a PyTorch op named ``name`` ("namespace::op"); with no
    ``fn``, a decorator."""
    if mesh is not None or input_partition_specs is not None or output_partition_specs is not None:
        raise NotImplementedError(
            f"jax_op {name!r}: sharded kernels (mesh=, partition specs) need a TPU slice and Google's TorchTPU "
            "SPMD runtime; torch_tpu runs a jax_op on one device (drop mesh= and the partition specs)")
    del donate_argnums  # inputs stay valid: donation is an optimisation, not a result

    def make(f: Callable) -> _JaxOp:
        return _JaxOp(name, f)

    return make(fn) if fn is not None else make


def get_default_pallas_mesh(*args, **kwargs):
    raise NotImplementedError("Pallas meshes describe a TPU slice (Google's TorchTPU SPMD runtime); "
                              "torch_tpu runs Pallas kernels on one device")


get_pallas_mesh = get_default_pallas_mesh
