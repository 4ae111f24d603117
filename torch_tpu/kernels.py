"""Custom kernels as PyTorch ops on tpu.

A kernel is one PyTorch op (``torch.ops.torch_tpu_kernels.<name>``) with one or more
implementations, chosen by the platform of the running PJRT plugin:

- a JAX function (``jax_op``), Pallas kernels included: JAX lowers it to StableHLO once per
  signature and the module joins the programs that call it, so it fuses with its neighbours
  in fused eager and compiled graphs; its operands are the tensors' device buffers;
- StableHLO text written elsewhere (``stablehlo_op``);
- a C++ (or CUDA) XLA FFI handler the plugin runs as a custom call (``ffi_op``);
- a reference in PyTorch ops, which runs (lowered natively like any other ops) where the
  plugin has no implementation, and on the CPU.

Every mode treats the op like any other: strict eager runs it as its own program, fused eager
and ``torch.compile(backend="tpu")`` put it in one program with the ops around it; Dynamo
traces it as one node (its fake implementation comes from the kernel's shape rule, or from
``jax.eval_shape``). ``torch_tpu.metrics()["kernels"]`` counts which implementation ran.
JAX is imported only when a JAX kernel is defined.
"""

from __future__ import annotations

import ast
import hashlib
import re
import threading
from collections import defaultdict
from typing import Callable, Optional, Sequence

import torch

from . import _C

NAMESPACE = "torch_tpu_kernels"
_lib = None
_lock = threading.RLock()
_kernels: dict = {}
_counts: dict = defaultdict(lambda: defaultdict(int))
# FFI platform names by PJRT platform.
_FFI_PLATFORMS = {"cpu": "Host", "cuda": "CUDA", "rocm": "ROCM", "tpu": "TPU"}


def counts() -> dict:
    """Calls on tpu per kernel and implementation ("jax", "stablehlo", "ffi", "reference")."""
    return {k: dict(v) for k, v in _counts.items()}


# The jaxlib release whose XLA FFI headers each FFI API minor version ships in (the CPU
# plugin, xla-cpu-pjrt 0.0.1, runs handlers of API 0.2; jaxlib 0.10's headers are 0.3).
_FFI_HEADERS_FROM = {2: "0.8.1"}


def _ffi_headers_home(minor: int) -> str:
    import os
    import sys

    return os.path.join(sys.prefix, "share", "torch_tpu", f"xla_ffi_0.{minor}", "include")


def ffi_include_dir(minor: int = 2) -> str:
    """The folder holding ``xla/ffi/api/ffi.h`` for FFI API 0.`minor` (the CPU plugin's), to
    build handlers against: ``c++ -shared -fPIC -isystem <this> kernel.cc``. Fetched by
    ``fetch_ffi_headers`` (scripts/setup.sh runs it)."""
    import os

    home = _ffi_headers_home(minor)
    if not os.path.exists(os.path.join(home, "xla", "ffi", "api", "ffi.h")):
        raise FileNotFoundError(f"torch_tpu: no XLA FFI 0.{minor} headers in {home}: run "
                                "python -c 'import torch_tpu.kernels as k; k.fetch_ffi_headers()'")
    return home


def fetch_ffi_headers(minor: int = 2) -> str:
    """Puts the XLA FFI headers of API 0.`minor` (from the jaxlib wheel that ships them, via
    pip) where ``ffi_include_dir`` finds them; returns that folder."""
    import glob
    import os
    import subprocess
    import sys
    import tempfile
    import zipfile

    home = _ffi_headers_home(minor)
    if os.path.exists(os.path.join(home, "xla", "ffi", "api", "ffi.h")):
        return home
    version = _FFI_HEADERS_FROM[minor]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, f"jaxlib=={version}"],
                       check=True)
        (wheel,) = glob.glob(os.path.join(tmp, "jaxlib-*.whl"))
        prefix = "jaxlib/include/"
        with zipfile.ZipFile(wheel) as z:
            for n in z.namelist():
                if n.startswith(prefix + "xla/ffi/") and n.endswith(".h"):
                    dest = os.path.join(home, n[len(prefix):])
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with z.open(n) as src, open(dest, "wb") as out:
                        out.write(src.read())
    return home


def _library():
    global _lib
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _lib


def _platform() -> str:
    return _C._platform()


def _type_of(shape, dtype: torch.dtype) -> tuple:
    """(dtype name, shape): how the C++ core takes a type."""
    return (str(dtype).removeprefix("torch."), list(shape))


# ----------------------------------------------------------------------------- StableHLO text


def _version(text: str) -> tuple:
    return tuple(int(p) for p in text.split("."))


def plugin_stablehlo_versions() -> tuple:
    """(minimum, current) StableHLO versions the plugin accepts, as strings; None if unknown."""
    attrs = dict(_C._plugin_attributes())
    return attrs.get("stablehlo_minimum_version"), attrs.get("stablehlo_current_version")


_FUNC_PRETTY = re.compile(r"func\.func\s+(?:(public|private|nested)\s+)?@([\w$.-]+)")
_FUNC_GENERIC = re.compile(r'"func\.func"\(\)\s*<\{[^\n]*?sym_name\s*=\s*"([\w$.-]+)"')


def _embeddable(module_text: str, kernel: str, entry: str = "main") -> tuple:
    """(functions text, entry name): a module's functions renamed to names unique to this text
    and made private, so that they join another module. Either MLIR syntax."""
    text = re.sub(r"\s+loc\((?:[^()]|\([^()]*\))*\)", "", module_text)
    lines = [ln for ln in text.strip().splitlines() if not ln.startswith("#")]
    if not lines:
        raise ValueError(f"torch_tpu kernel '{kernel}': the StableHLO module is empty")
    head = lines[0].lstrip()
    if head.startswith("module") or head.startswith('"builtin.module"'):
        lines = lines[1:-1]
    body = "\n".join(lines)
    names = [m.group(2) for m in _FUNC_PRETTY.finditer(body)] + [m.group(1) for m in _FUNC_GENERIC.finditer(body)]
    if entry not in names:
        raise ValueError(f"torch_tpu kernel '{kernel}': the StableHLO module has no function @{entry} "
                         f"(it has {', '.join('@' + n for n in names) or 'none'})")
    tag = "k" + hashlib.sha256(body.encode()).hexdigest()[:20] + "_"
    for n in sorted(set(names), key=len, reverse=True):
        body = re.sub(r"@" + re.escape(n) + r"(?![\w$.-])", "@" + tag + n, body)
        body = body.replace(f'sym_name = "{n}"', f'sym_name = "{tag}{n}"')
    body = _FUNC_PRETTY.sub(lambda m: "func.func private @" + m.group(2), body)
    body = body.replace('sym_visibility = "public"', 'sym_visibility = "private"')
    # A generic-form function without a visibility is public: make it private too.
    body = re.sub(r'("func\.func"\(\)\s*<\{)(?![^\n]*sym_visibility)', r'\1sym_visibility = "private", ', body)
    return body + "\n", tag + entry


# ----------------------------------------------------------------------------- kernels


class Kernel:
    """One op with implementations per platform and an optional PyTorch reference."""

    def __init__(self, name: str, *, out_shape: Optional[Callable] = None, reference: Optional[Callable] = None):
        if not re.fullmatch(r"[A-Za-z_]\w*", name or ""):
            raise ValueError(f"torch_tpu kernels: {name!r} is not a valid op name")
        self.name = name
        self.out_shape = out_shape
        self.reference = reference
        self._impls: list = []  # (platforms or None, kind, impl)
        self._keys: dict = {}  # signature -> registered key
        self._backward = None  # (kind, fn)
        self._define()

    # -- implementations

    def add_jax(self, fn: Callable, *, platforms: Optional[Sequence[str]] = None) -> "Kernel":
        """A JAX function of arrays (``pl.pallas_call`` kernels included) for `platforms`
        (PJRT platform names such as "cpu", "cuda", "tpu"; None: every platform)."""
        _import_jax(self.name)
        self._impls.append((None if platforms is None else set(platforms), "jax", fn))
        return self

    def add_stablehlo(self, text, *, entry: str = "main", platforms: Optional[Sequence[str]] = None) -> "Kernel":
        """StableHLO module text (or a function of the input tensors returning it)."""
        self._impls.append((None if platforms is None else set(platforms), "stablehlo", (text, entry)))
        return self

    def add_ffi(self, target: str, *, platform: str = "cpu", library: Optional[str] = None,
                symbol: Optional[str] = None) -> "Kernel":
        """An XLA FFI handler registered with the plugin as custom-call `target` for `platform`.
        With `library` (a shared library) and `symbol` (its handler, exported with
        XLA_FFI_DEFINE_HANDLER_SYMBOL), torch_tpu registers it; without, it must be registered."""
        if self.out_shape is None:
            raise ValueError(f"torch_tpu kernel '{self.name}': an FFI kernel needs out_shape")
        if library is not None and platform == _platform():
            _C._register_ffi_handler(target, _FFI_PLATFORMS.get(platform, platform.upper()), library,
                                     symbol or target)
        self._impls.append(({platform}, "ffi", target))
        return self

    def backward(self, fn: Optional[Callable] = None, *, vjp: bool = False) -> "Kernel":
        """The gradient: `fn(*inputs, *grad_outputs, **attrs)` returning the gradients of the
        floating-point inputs in order (a JAX function for JAX kernels, PyTorch ops otherwise),
        or ``vjp=True``: ``jax.vjp`` of the JAX implementation."""
        if vjp:
            self._backward = ("vjp", None)
        elif fn is not None:
            self._backward = ("fn", fn)
        self._register_autograd()
        return self

    # -- the op

    def __call__(self, *tensors: torch.Tensor, **attrs):
        for a in attrs.values():
            if not isinstance(a, (bool, int, float, str)) and a is not None:
                raise TypeError(f"torch_tpu kernel '{self.name}': attribute values must be bool, int, float, "
                                f"str or None, got {type(a).__name__}")
        out = self.op(list(tensors), _encode(attrs))
        return out[0] if len(out) == 1 else tuple(out)

    def _define(self):
        with _lock:
            if self.name in _kernels:
                raise ValueError(f"torch_tpu kernels: a kernel named '{self.name}' exists already")
            lib = _library()
            lib.define(f"{self.name}(Tensor[] args, str attrs) -> Tensor[]")
            lib.impl(self.name, self._run_tpu, "PrivateUse1")
            lib.impl(self.name, self._run_cpu, "CPU")
            torch.library.register_fake(f"{NAMESPACE}::{self.name}", self._fake, lib=lib)
            self.op = getattr(getattr(torch.ops, NAMESPACE), self.name).default
            _kernels[self.name] = self

    def _specs(self, tensors, attrs) -> list:
        """[(shape, dtype)] of the results, from out_shape or the JAX function."""
        if self.out_shape is not None:
            spec = self.out_shape(*tensors, **attrs)
            specs = [spec] if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], torch.dtype) \
                else list(spec)
            return [(tuple(int(d) for d in s), dt) for s, dt in specs]
        for plats, kind, impl in self._impls:
            if kind == "jax":
                return [(tuple(s.shape), _torch_dtype(s.dtype)) for s in _jax_out_avals(self.name, impl, tensors, attrs)]
        raise ValueError(f"torch_tpu kernel '{self.name}': give out_shape (no JAX implementation to infer it from)")

    def _fake(self, args, attrs):
        specs = self._specs(args, _decode(attrs))
        dev = args[0].device if args else torch.device("cpu")
        return [torch.empty(s, dtype=d, device=dev) for s, d in specs]

    def _run_cpu(self, args, attrs):
        kw = _decode(attrs)
        if self.reference is not None:
            return _as_list(self.reference(*args, **kw))
        for plats, kind, impl in self._impls:
            if kind == "jax":  # JAX's own CPU runtime: the tensors are on the host already
                import jax
                import numpy as np

                out = jax.jit(_bind(impl, kw), keep_unused=True)(*[np.asarray(a) for a in args])
                return [torch.from_numpy(np.array(o)) for o in _flat(out)]
        raise NotImplementedError(f"torch_tpu kernel '{self.name}' has no implementation for the CPU "
                                  "(give it a reference)")

    def _choose(self):
        plat = _platform()
        for plats, kind, impl in self._impls:
            if plats is None or plat in plats:
                return kind, impl
        return None, None

    def _run_tpu(self, args, attrs):
        kw = _decode(attrs)
        kind, impl = self._choose()
        if kind is None:
            if self.reference is None:
                raise NotImplementedError(f"torch_tpu kernel '{self.name}' has no implementation for the "
                                          f"'{_platform()}' plugin and no reference")
            _counts[self.name]["reference"] += 1
            return _as_list(self.reference(*args, **kw))
        key = self._key(kind, impl, args, kw, attrs)
        _counts[self.name][kind] += 1
        if kind == "ffi":
            return torch.ops.tpu.ffi_call(args, key)
        return torch.ops.tpu.stablehlo_call(args, key)

    def _key(self, kind, impl, args, kw, attrs) -> str:
        sig = (kind, id(impl), tuple((t.dtype, tuple(t.shape)) for t in args), attrs)
        key = self._keys.get(sig)
        if key is not None:
            return key
        with _lock:
            key = self._keys.get(sig)
            if key is not None:
                return key
            params = [_type_of(t.shape, t.dtype) for t in args]
            specs = self._specs(args, kw) if (self.out_shape is not None or kind == "ffi") else None
            if kind == "ffi":
                if kw:
                    raise TypeError(f"torch_tpu kernel '{self.name}': FFI kernels take no attributes here; "
                                    "pass values as tensors")
                key = f"{self.name}/ffi:{impl}/{len(self._keys)}"
                _C._register_ffi_kernel(key, self.name, impl, params, [_type_of(s, d) for s, d in specs])
                self._keys[sig] = key
                return key
            if kind == "jax":
                text, results = _lower_jax(self.name, impl, args, kw)
                if specs is not None:
                    _check_rule(self.name, specs, results)
                funcs, entry = _embeddable(text, self.name)
            else:  # StableHLO text
                text, entry = impl
                if callable(text):
                    text = text(*args, **kw)
                if specs is None:
                    raise ValueError(f"torch_tpu kernel '{self.name}': a StableHLO kernel needs out_shape")
                results = [_type_of(s, d) for s, d in specs]
                funcs, entry = _embeddable(text, self.name, entry)
            key = f"{self.name}/{entry}/{len(self._keys)}"
            _C._register_stablehlo_kernel(key, self.name, entry, funcs, params, results)
            self._keys[sig] = key
            return key

    # -- autograd

    def _register_autograd(self):
        torch.library.register_autograd(f"{NAMESPACE}::{self.name}", self._backward_fn,
                                        setup_context=self._setup_context, lib=_library())

    @staticmethod
    def _setup_context(ctx, inputs, output):
        args, attrs = inputs
        ctx.save_for_backward(*args)
        ctx.attrs = attrs
        ctx.out_specs = [(o.shape, o.dtype) for o in output]

    def _backward_fn(self, ctx, grads):
        args = list(ctx.saved_tensors)
        grads = [g if g is not None else torch.zeros(s, dtype=d, device=args[0].device)
                 for g, (s, d) in zip(grads, ctx.out_specs)]
        diff = [i for i, a in enumerate(args) if a.is_floating_point() or a.is_complex()]
        attrs = ctx.attrs
        if self._backward[0] == "vjp":  # the vjp kernel tells primals from cotangents by count
            attrs = _encode({**_decode(attrs), "_n_primals": len(args)})
        out = self._grad_kernel().op(args + grads, attrs)
        if len(out) != len(diff):
            raise RuntimeError(f"torch_tpu kernel '{self.name}': its backward returned {len(out)} gradients "
                               f"for {len(diff)} floating-point inputs")
        result = [None] * len(args)
        for i, g in zip(diff, out):
            result[i] = g
        return result, None

    def _grad_kernel(self) -> "Kernel":
        name = self.name + "_backward"
        with _lock:
            if name in _kernels:
                return _kernels[name]
            kind, fn = self._backward
            jax_impls = [(plats, impl) for plats, k, impl in self._impls if k == "jax"]
            if kind == "vjp":
                if not jax_impls:
                    raise RuntimeError(f"torch_tpu kernel '{self.name}': vjp needs a JAX implementation")
                g = Kernel(name)
                for plats, impl in jax_impls:
                    g.add_jax(_vjp_of(impl), platforms=plats)
                return g
            if jax_impls:
                return Kernel(name).add_jax(fn)
            return Kernel(name, out_shape=lambda *a, **kw: [(tuple(t.shape), t.dtype) for t in fn(*a, **kw)],
                          reference=fn)


def _vjp_of(fn):
    def vjp(*args, **kw):
        import jax

        n = kw.pop("_n_primals")
        primals, cts = args[:n], args[n:]
        diff = [i for i, p in enumerate(primals) if jax.numpy.issubdtype(p.dtype, jax.numpy.inexact)]

        def f(*d):
            full = list(primals)
            for i, v in zip(diff, d):
                full[i] = v
            return fn(*full, **kw)

        out, pullback = jax.vjp(f, *[primals[i] for i in diff])
        cts = tuple(cts) if isinstance(out, (tuple, list)) else cts[0]
        return tuple(pullback(cts))

    return vjp


# ----------------------------------------------------------------------------- JAX


def _import_jax(kernel: str):
    try:
        import jax  # noqa: F401
    except ImportError as e:
        raise ModuleNotFoundError(f"torch_tpu kernel '{kernel}' is a JAX kernel, and JAX is not installed: "
                                  "pip install jax") from e


def _torch_dtype(jdt) -> torch.dtype:
    import numpy as np

    name = np.dtype(jdt).name
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"torch_tpu kernels: no PyTorch dtype for JAX's {name}")
    return dt


def _jax_specs(tensors):
    import jax
    import jax.numpy as jnp

    return [jax.ShapeDtypeStruct(tuple(t.shape), jnp.dtype(str(t.dtype).removeprefix("torch."))) for t in tensors]


def _wide(tensors) -> bool:
    return any(t.dtype in (torch.float64, torch.int64, torch.uint64, torch.complex128) for t in tensors)


def _bind(fn, kw):
    if not kw:
        return fn
    return lambda *a: fn(*a, **kw)


def _jax_out_avals(kernel, fn, tensors, kw):
    import jax

    with jax.enable_x64(_wide(tensors)):
        try:
            out = jax.eval_shape(_bind(fn, kw), *_jax_specs(tensors))
        except Exception as e:
            raise RuntimeError(f"torch_tpu kernel '{kernel}': JAX could not trace it: {e}") from e
    return _flat(out)


def _lower_jax(kernel, fn, tensors, kw):
    """(module text in MLIR's generic form, result types) of `fn` for these inputs, checked
    against the StableHLO versions the plugin accepts."""
    import jax

    # For the running plugin's platform, which need not be JAX's own: on this CPU-only host a
    # Pallas kernel lowers for "tpu" to a Mosaic custom call, for "cuda" to a Mosaic GPU one.
    platform = _platform()  # PJRT and JAX name platforms alike: cpu, cuda, rocm, tpu
    with jax.enable_x64(_wide(tensors)):
        try:
            traced = jax.jit(_bind(fn, kw), keep_unused=True).trace(*_jax_specs(tensors))
            lowered = traced.lower(lowering_platforms=(platform,))
        except Exception as e:
            raise RuntimeError(f"torch_tpu kernel '{kernel}': JAX could not lower it: {e}") from e
    module = lowered.compiler_ir("stablehlo")
    results = [_type_of(a.shape, _torch_dtype(a.dtype)) for a in _flat(lowered.out_info)]
    _check_version(kernel, module)
    text = module.operation.get_asm(print_generic_op_form=True, enable_debug_info=False)
    return text, results


def _check_version(kernel, module):
    from jax._src.lib.mlir.dialects import hlo

    _, current = plugin_stablehlo_versions()
    if current is None or _version(current) >= _version(hlo.get_current_version()):
        return
    try:  # the module serialised for the plugin's version: fails if it uses anything newer
        hlo.serialize_portable_artifact_str(str(module), current)
    except Exception as e:
        raise RuntimeError(f"torch_tpu kernel '{kernel}': its StableHLO (JAX emits version "
                           f"{hlo.get_current_version()}) cannot be expressed in version {current}, the newest "
                           f"the plugin accepts: {e}") from e


def _check_rule(kernel, specs, results):
    want = [_type_of(s, d) for s, d in specs]
    if want != [(d, list(s)) for d, s in results]:
        show = lambda ts: ", ".join(f"{d}{list(s)}" for d, s in ts)  # noqa: E731
        raise ValueError(f"torch_tpu kernel '{kernel}': the JAX function returns {show(results)}, its out_shape "
                         f"rule says {show(want)}")


# ----------------------------------------------------------------------------- helpers


def _flat(out):
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


def _as_list(out):
    return [o.contiguous() for o in _flat(out)]


def _encode(attrs: dict) -> str:
    # Plain string operations, which Dynamo traces (json.dumps would break the graph).
    return ";".join(k + "=" + repr(attrs[k]) for k in sorted(attrs))


def _decode(attrs: str) -> dict:
    out = {}
    for item in attrs.split(";") if attrs else ():
        k, _, v = item.partition("=")
        out[k] = ast.literal_eval(v)
    return out


# ----------------------------------------------------------------------------- decorators


def jax_op(fn: Optional[Callable] = None, *, name: Optional[str] = None, out_shape: Optional[Callable] = None,
           backward="vjp", reference: Optional[Callable] = None, platforms: Optional[Sequence[str]] = None):
    """Makes a JAX function of arrays a PyTorch op on tpu (``@jax_op`` or ``@jax_op(...)``).

    ``backward``: "vjp" (``jax.vjp`` of the function), a JAX function
    ``(*inputs, *grad_outputs, **attrs) -> gradients of the floating-point inputs``, or None.
    ``out_shape(*tensors, **attrs)``: ``(shape, dtype)`` or a list of them; checked against what
    the JAX function returns. Keyword arguments of the op are compile-time attributes passed to
    the function."""

    def make(f):
        k = Kernel(name or f.__name__, out_shape=out_shape, reference=reference)
        k.add_jax(f, platforms=platforms)
        if backward == "vjp":
            k.backward(vjp=True)
        elif backward is not None:
            k.backward(backward)
        return k

    return make(fn) if fn is not None else make


def stablehlo_op(name: str, text, *, out_shape: Callable, entry: str = "main", backward: Optional[Callable] = None,
                 reference: Optional[Callable] = None, platforms: Optional[Sequence[str]] = None) -> Kernel:
    """A PyTorch op from StableHLO module text (or a function of the inputs returning it); its
    entry function takes the op's tensors and returns what ``out_shape`` says. ``backward``:
    PyTorch ops ``(*inputs, *grad_outputs) -> gradients of the floating-point inputs``."""
    k = Kernel(name, out_shape=out_shape, reference=reference).add_stablehlo(text, entry=entry, platforms=platforms)
    if backward is not None:
        k.backward(backward)
    return k


def ffi_op(name: str, target: str, *, out_shape: Callable, platform: str = "cpu", library: Optional[str] = None,
           symbol: Optional[str] = None, backward: Optional[Callable] = None,
           reference: Optional[Callable] = None) -> Kernel:
    """A PyTorch op from an XLA FFI handler (C++, or CUDA on a GPU plugin) run as custom call
    `target` on `platform`; elsewhere the `reference` (PyTorch ops) runs."""
    k = Kernel(name, out_shape=out_shape, reference=reference).add_ffi(target, platform=platform, library=library,
                                                                      symbol=symbol)
    if backward is not None:
        k.backward(backward)
    return k
