"""``torch-tpu doctor``: what keeps a codebase on CUDA, found by reading its Python.

    torch-tpu doctor PATH...                  # files or folders; text to standard output
    torch-tpu doctor src --format sarif --output doctor.sarif
    torch-tpu doctor src --diff               # the safe rewrites as a unified diff
    torch-tpu doctor src --fix                # ... applied in place
    torch-tpu doctor --run train.py --steps 10  # run it on tpu: fallbacks, compiles, syncs

Every file is parsed with ``ast`` (never matched with regular expressions), so a "cuda" in a
comment or a docstring is not a finding, and each finding carries the exact span it is about.
The rewrites keep the code running on CUDA: a device string becomes an expression that names the
machine's accelerator (``--device``), ``torch.cuda.synchronize()`` becomes
``torch.accelerator.synchronize()``, and so on; only calls whose portable form takes the same
arguments are rewritten.

Exit status: 0 when nothing was found (or with ``--exit-zero``), 1 when something was, 2 when
a path cannot be read or parsed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import json
import os
import sys
from dataclasses import asdict, dataclass, field

# What the rewrites put where a device string was: on a CUDA machine this is "cuda", on a tpu
# machine "tpu", so the rewritten code runs on both.
DEFAULT_DEVICE_EXPR = "torch.accelerator.current_accelerator().type"

# The rules: id -> (name, default severity, what it means). Severities are SARIF's levels.
RULES = {
    "TPU001": ("hard-coded-cuda-device", "warning",
               "A device string names CUDA; on another accelerator the tensors go nowhere useful."),
    "TPU002": ("cuda-method", "warning", "`.cuda()` moves to CUDA only; `.to(device)` moves to any accelerator."),
    "TPU003": ("torch-cuda-api", "warning",
               "A `torch.cuda` call with a device-generic equivalent in `torch.accelerator` or "
               "`torch.get_device_module()`."),
    "TPU004": ("cuda-only-library", "error",
               "A library that ships CUDA kernels only: its ops do not run on a TPU."),
    "TPU005": ("cuda-extension", "error",
               "A C++/CUDA extension built from .cu sources: a CUDA kernel needs a port (an XLA FFI handler, "
               "or a JAX/Pallas kernel) or a PyTorch reference."),
    "TPU006": ("nccl-backend", "warning",
               "`nccl` named as the process group backend; without a name PyTorch picks the backend of "
               "each device (gloo for the CPU, nccl for CUDA, tpu_dist for tpu)."),
    "TPU007": ("cuda-numerics-flag", "note",
               "A cuDNN or TF32 switch: it changes nothing off CUDA; the portable knob is "
               "`torch.set_float32_matmul_precision`."),
    "TPU008": ("cuda-graphs-streams", "warning",
               "CUDA graphs or CUDA streams: `torch.compile` replays a whole graph as one program, and "
               "`torch.Stream`/`torch.Event` are the device-generic streams."),
    "TPU009": ("matrix-unit-padding", "note",
               "A layer width that is not a multiple of 128: a TPU's matrix units work on 128x128 tiles, "
               "so the remainder is padded and computed for nothing."),
    "TPU010": ("cuda-only-library-call", "error",
               "A call into a CUDA-only library: the place the rewrite goes (the import alone does not say "
               "where)."),
    "TPU011": ("triton-kernel", "error",
               "A Triton kernel: it compiles for NVIDIA and AMD GPUs only; a Pallas kernel through "
               "`torch_tpu.kernels`, or the PyTorch ops it fuses, runs on a TPU."),
    "TPU012": ("triton-launch", "error",
               "A Triton kernel launched (`kernel[grid](...)`): the call to replace with the ported op."),
    "TPU013": ("cpu-extension", "note",
               "A C++ extension with no CUDA sources: its ops run on the CPU, not on tpu, so their tensors "
               "go to the host and back."),
}
LEVELS = ("note", "warning", "error")

# Top-level packages whose kernels are CUDA only, and what to use instead.
CUDA_ONLY_LIBRARIES = {
    "flash_attn": "torch.nn.functional.scaled_dot_product_attention (runs natively on tpu)",
    "xformers": "torch.nn.functional.scaled_dot_product_attention",
    "bitsandbytes": "bf16 weights, or an XLA-side quantisation",
    "apex": "torch.amp and torch.optim (fused AdamW is native on tpu)",
    "triton": "a JAX/Pallas kernel, or the PyTorch ops the Triton kernel fuses",
    "cupy": "torch tensor ops",
    "pycuda": "torch tensor ops",
    "transformer_engine": "torch.autocast with bfloat16",
    "mamba_ssm": "its PyTorch reference implementation",
    "causal_conv1d": "its PyTorch reference implementation",
    "flashinfer": "torch.nn.functional.scaled_dot_product_attention",
    "liger_kernel": "the PyTorch modules it patches (leave them unpatched)",
}
# deepspeed is portable except its compiled ops.
CUDA_ONLY_SUBMODULES = {"deepspeed.ops": "torch.optim and torch.distributed"}
# The move for a call site, by library and the API's last name; other APIs get the library's line above.
# Triton is left out: its kernels are found by their definitions and launches (TPU011, TPU012), not
# by every tl.* call inside them.
PALLAS = "a Pallas kernel through torch_tpu.kernels.jax_op (with a PyTorch reference=)"
SDPA = f"torch.nn.functional.scaled_dot_product_attention (runs natively on tpu), or {PALLAS}"
API_MOVES = {
    "flash_attn": dict.fromkeys(
        ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
         "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
         "FlashSelfAttention", "FlashCrossAttention"), SDPA),
    "xformers": {"memory_efficient_attention": SDPA},
    "flashinfer": {"single_prefill_with_kv_cache": SDPA, "single_decode_with_kv_cache": SDPA},
    "apex": {
        "FusedLayerNorm": "torch.nn.LayerNorm", "MixedFusedLayerNorm": "torch.nn.LayerNorm",
        "FusedRMSNorm": "torch.nn.RMSNorm", "MixedFusedRMSNorm": "torch.nn.RMSNorm",
        "fused_layer_norm": "torch.nn.functional.layer_norm", "fused_rms_norm": "torch.nn.functional.rms_norm",
        "FusedAdam": "torch.optim.AdamW (torch.optim.Adam for adam_w_mode=False)",
        "FusedSGD": "torch.optim.SGD", "FusedLAMB": f"torch.optim.AdamW, or LAMB in PyTorch ops or {PALLAS}",
        "FusedNovoGrad": "torch.optim.AdamW, or NovoGrad in PyTorch ops",
        "initialize": "torch.autocast(device_type, dtype=torch.bfloat16) (no loss scaling needed in bf16)",
        "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
        "SyncBatchNorm": "torch.nn.SyncBatchNorm",
        "convert_syncbn_model": "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
    },
    "bitsandbytes": {
        "Adam8bit": "torch.optim.Adam", "AdamW8bit": "torch.optim.AdamW", "PagedAdamW8bit": "torch.optim.AdamW",
        "PagedAdamW": "torch.optim.AdamW", "SGD8bit": "torch.optim.SGD",
        "Linear8bitLt": "torch.nn.Linear with bf16 weights", "Linear4bit": "torch.nn.Linear with bf16 weights",
        "LinearFP4": "torch.nn.Linear with bf16 weights", "LinearNF4": "torch.nn.Linear with bf16 weights",
        "StableEmbedding": "torch.nn.Embedding followed by torch.nn.LayerNorm",
    },
    "transformer_engine": {
        "Linear": "torch.nn.Linear under torch.autocast(device_type, dtype=torch.bfloat16)",
        "LayerNorm": "torch.nn.LayerNorm", "RMSNorm": "torch.nn.RMSNorm",
        "fp8_autocast": "torch.autocast(device_type, dtype=torch.bfloat16)",
    },
    "mamba_ssm": {"selective_scan_fn": "selective_scan_ref from the same module (PyTorch ops)",
                  "mamba_inner_fn": "mamba_inner_ref from the same module (PyTorch ops)"},
    "causal_conv1d": {"causal_conv1d_fn": "causal_conv1d_ref (PyTorch ops: a padded torch.nn.functional.conv1d)"},
    "deepspeed": {"FusedAdam": "torch.optim.AdamW", "DeepSpeedCPUAdam": "torch.optim.AdamW",
                  "FusedLamb": "torch.optim.AdamW, or LAMB in PyTorch ops"},
}

# Triton: the decorators that make a kernel (also stacked: @triton.autotune(...) over @triton.jit).
TRITON_DECORATORS = {"triton.jit", "triton.autotune", "triton.heuristics", "triton.runtime.jit.jit",
                     "triton.runtime.autotune", "triton.runtime.heuristics", "triton.runtime.autotuner.autotune",
                     "triton.runtime.autotuner.heuristics"}
PORT_TRITON = (f"port it as {PALLAS}, or replace it with the PyTorch ops it fuses "
               "(torch.compile(backend=\"tpu\") fuses them into one program)")
# A name imported from these is never a Triton kernel, even in a file that imports triton.
NOT_KERNEL_MODULES = set(sys.stdlib_module_names) | {"torch", "numpy", "jax", "triton", "typing_extensions"}

# torch.utils.cpp_extension: what builds an extension, and the arguments that carry CUDA code.
CPP_EXTENSION = "torch.utils.cpp_extension"
EXTENSION_BUILDS = ("load", "load_inline", "CUDAExtension", "CppExtension")
CUDA_ARGUMENTS = ("cuda_sources", "extra_cuda_cflags")

# torch.cuda.X -> the portable call, where it takes the same arguments (rewritten by --fix).
SAME_ARGUMENTS = {
    "synchronize": "torch.accelerator.synchronize",
    "is_available": "torch.accelerator.is_available",
    "device_count": "torch.accelerator.device_count",
    "current_device": "torch.accelerator.current_device_index",
    "set_device": "torch.accelerator.set_device_index",
    "current_stream": "torch.accelerator.current_stream",
    "set_stream": "torch.accelerator.set_stream",
    "empty_cache": "torch.accelerator.empty_cache",
    "memory_allocated": "torch.accelerator.memory_allocated",
    "max_memory_allocated": "torch.accelerator.max_memory_allocated",
    "memory_reserved": "torch.accelerator.memory_reserved",
    "max_memory_reserved": "torch.accelerator.max_memory_reserved",
    "memory_stats": "torch.accelerator.memory_stats",
    "reset_peak_memory_stats": "torch.accelerator.reset_peak_memory_stats",
    "mem_get_info": "torch.accelerator.get_memory_info",
}
# torch.cuda.X -> advice only (the portable form takes other arguments or lives elsewhere).
ADVICE = {
    "manual_seed": "torch.manual_seed (seeds every device), or torch.get_device_module().manual_seed",
    "manual_seed_all": "torch.manual_seed, or torch.get_device_module().manual_seed_all",
    "get_device_name": "torch.get_device_module().get_device_name",
    "get_device_properties": "torch.get_device_module().get_device_properties",
    "get_device_capability": "torch.accelerator.get_device_capability",
    "is_bf16_supported": "torch.get_device_module().is_bf16_supported",
    "get_rng_state": "torch.get_device_module().get_rng_state",
    "set_rng_state": "torch.get_device_module().set_rng_state",
    "device": "torch.get_device_module().device, or torch.accelerator.device_index",
    "amp.autocast": "torch.autocast(device_type, ...)",
    "amp.GradScaler": "torch.amp.GradScaler(device_type)",
    "nvtx": "torch.profiler.record_function",
}
GRAPHS_STREAMS = {
    "CUDAGraph": "torch.compile (a compiled graph replays as one program)",
    "graph": "torch.compile",
    "make_graphed_callables": "torch.compile",
    "Stream": "torch.Stream(device)",
    "stream": "torch.accelerator.set_stream / a torch.Stream context",
    "Event": "torch.Event(device)",
    "ExternalStream": "torch.Stream",
}
PORT_KERNEL = ("give the op a PyTorch reference that runs on every device, and port the kernel itself "
               "(an XLA FFI handler keeps CUDA code as it is; Pallas for a TPU), both through torch_tpu.kernels")
PORT_CPU_EXTENSION = f"for tensor math that stays on tpu, use PyTorch ops or {PALLAS}"
LAYERS_IN_OUT = {"Linear": (0, 1), "Conv1d": (0, 1), "Conv2d": (0, 1), "Conv3d": (0, 1), "Embedding": (None, 1),
                 "Bilinear": (0, 2)}
TILE = 128


@dataclass
class Finding:
    rule: str
    path: str
    line: int
    column: int  # 1-based, as editors and SARIF count
    end_line: int
    end_column: int
    level: str
    message: str
    advice: str
    # The replacement of [line:column, end_line:end_column) that --fix makes, if it is safe.
    fix: str | None = None

    @property
    def name(self) -> str:
        return RULES[self.rule][0]


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    files: int = 0
    errors: list[str] = field(default_factory=list)  # unreadable or unparsable files


def _dotted(node: ast.AST) -> str | None:
    """'torch.cuda.synchronize' for that attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _cuda_string(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    v = node.value
    return v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit())


def _int_literal(node: ast.AST | None) -> int | None:
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def _source_lines(source: str) -> list:
    """The source's lines as ast numbers them: split at line feeds and carriage returns only
    (str.splitlines also splits at form feeds and other separators, shifting every later line)."""
    return io.StringIO(source, newline="").readlines()


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, source: str, device_expr: str):
        self.path = path
        self.lines = _source_lines(source)
        self.device_expr = device_expr
        self.findings: list[Finding] = []
        self.torch_cuda_aliases = {"torch.cuda"}  # names bound to the torch.cuda module
        self.docstrings: set[int] = set()
        self.seen: set[tuple[int, int, str]] = set()
        self.parents: dict[int, ast.AST] = {}
        # Filled before the visit (a kernel may be launched above its definition):
        self.imports: dict[str, str] = {}  # local name -> what it is bound to: fa -> flash_attn
        self.triton_kernels: set[str] = set()  # names of the file's Triton kernels
        self.triton_methods: set[str] = set()  # ... of those defined in a class body (self.k[grid])
        self.imports_triton = False
        self.decorators: set[int] = set()  # ids of the Triton decorators, reported with their def
        self.build_extension: list[ast.AST] = []  # BuildExtension references, reported in finish()

    # -- helpers
    def add(self, rule, node, message, advice, fix=None, level=None):
        key = (node.lineno, node.col_offset, rule)
        if key in self.seen:
            return
        self.seen.add(key)
        self.findings.append(Finding(rule, self.path, node.lineno, self.column(node.lineno, node.col_offset),
                                     node.end_lineno, self.column(node.end_lineno, node.end_col_offset),
                                     level or RULES[rule][1], message, advice, fix))

    def column(self, line: int, byte_offset: int) -> int:
        """ast counts UTF-8 bytes; editors, SARIF and the rewrites count characters (1-based)."""
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text.encode("utf-8")[:byte_offset].decode("utf-8", errors="replace")) + 1

    def device_fix(self, node: ast.Constant) -> str:
        index = node.value[5:] if ":" in node.value else ""
        return f'f"{{{self.device_expr}}}:{index}"' if index else self.device_expr

    def cuda_member(self, node: ast.AST) -> str | None:
        """'synchronize' for torch.cuda.synchronize (or an alias of torch.cuda), else None."""
        name = _dotted(node)
        if not name:
            return None
        for alias in self.torch_cuda_aliases:
            if name.startswith(alias + "."):
                return name[len(alias) + 1:]
        return None

    def qualified(self, node: ast.AST) -> str | None:
        """What a name or attribute chain is, through the file's imports: with `import flash_attn as
        fa`, fa.flash_attn_func -> 'flash_attn.flash_attn_func'; None for a name no import binds."""
        name = _dotted(node)
        if not name:
            return None
        head, dot, rest = name.partition(".")
        return self.imports[head] + dot + rest if head in self.imports else None

    def triton_decorator(self, node: ast.AST) -> str | None:
        """'triton.jit' for triton.jit, jit (from triton import jit), triton.autotune(...); else None."""
        if isinstance(node, ast.Call):
            node = node.func
        q = self.qualified(node)
        return q if q in TRITON_DECORATORS else None

    def extension_api(self, node: ast.AST) -> str | None:
        """'load_inline' for torch.utils.cpp_extension.load_inline however it was imported, else None."""
        q = self.qualified(node)
        if q and q.startswith(CPP_EXTENSION + "."):
            return q[len(CPP_EXTENSION) + 1:]
        # Unimported, but no other library's name: a setup.py helper that re-exports it.
        return "CUDAExtension" if _dotted(node) == "CUDAExtension" else None

    def _bind_names(self, tree: ast.Module):
        """The names the imports bind, anywhere in the file (imports inside try blocks and functions
        count); a def, class or assignment at module level after an import takes its name back."""
        events = []  # (line, local name, what it is bound to, or None where the import's binding ends)
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    # import a.b binds a; import a.b as c binds c to a.b
                    local, bound = (a.asname, a.name) if a.asname else ((a.name.split(".")[0],) * 2)
                    events.append((n.lineno, local, bound))
                    self.imports_triton |= a.name.split(".")[0] == "triton"
            elif isinstance(n, ast.ImportFrom):
                # from . import k -> .k; from .a import k -> .a.k (never a library's name)
                prefix = "." * n.level + (n.module + "." if n.module else "")
                self.imports_triton |= n.level == 0 and prefix.split(".")[0] == "triton"
                for a in n.names:
                    if a.name == "*" and n.module == CPP_EXTENSION and not n.level:
                        events += [(n.lineno, api, prefix + api) for api in (*EXTENSION_BUILDS, "BuildExtension")]
                    elif a.name != "*":
                        events.append((n.lineno, a.asname or a.name, prefix + a.name))
        for n in tree.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                events.append((n.lineno, n.name, None))
            elif isinstance(n, ast.Assign):
                events += [(n.lineno, t.id, None) for t in n.targets if isinstance(t, ast.Name)]
        for _, local, bound in sorted(events, key=lambda e: e[0]):
            if bound is None:
                self.imports.pop(local, None)
            else:
                self.imports[local] = bound

    def _find_triton_kernels(self, tree: ast.Module):
        """The file's Triton kernels by name, so that a launch is known wherever it stands."""
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                triton = [d for d in n.decorator_list if self.triton_decorator(d)]
                self.decorators |= {id(d) for d in triton}
                if triton:
                    self.triton_kernels.add(n.name)
                    if isinstance(self.parents.get(id(n)), ast.ClassDef):
                        self.triton_methods.add(n.name)
            elif isinstance(n, ast.Assign) and self._wraps_triton(n.value):  # k = triton.jit(f)
                self.triton_kernels |= {t.id for t in n.targets if isinstance(t, ast.Name)}

    def _wraps_triton(self, node: ast.AST) -> bool:
        """triton.jit(f), triton.autotune(configs, key)(triton.jit(f)): a call that makes a kernel."""
        while isinstance(node, ast.Call):
            if self.triton_decorator(node.func):
                return True
            node = node.func
        return False

    def finish(self):
        """What needs the whole file: BuildExtension builds CUDA code where the file's extensions do."""
        cuda = any(f.rule == "TPU005" for f in self.findings)
        for node in self.build_extension:
            if cuda:
                self.add("TPU005", node, "BuildExtension builds the CUDA extension(s) of this file", PORT_KERNEL)
            else:
                self.add("TPU013", node, "BuildExtension builds C++ extensions: they run on the CPU, not on tpu",
                         PORT_CPU_EXTENSION)

    # -- the visitors
    def visit_Module(self, node):
        for parent in ast.walk(node):
            for child in ast.iter_child_nodes(parent):
                self.parents[id(child)] = parent
        self._bind_names(node)
        self._find_triton_kernels(node)
        self._note_docstrings(node)
        self.generic_visit(node)

    def _note_docstrings(self, node):
        body = getattr(node, "body", None)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            self.docstrings.add(id(body[0].value))

    def visit_FunctionDef(self, node):
        self._note_docstrings(node)
        triton = [d for d in node.decorator_list if id(d) in self.decorators]
        if triton:  # one finding per kernel, at its first Triton decorator
            names = ", ".join("@" + self.triton_decorator(d) for d in triton)
            self.add("TPU011", triton[0], f"the Triton kernel {node.name} ({names})", PORT_TRITON)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._note_docstrings(node)
        self.generic_visit(node)

    def visit_Import(self, node):
        for a in node.names:
            self._library(node, a.name)
            if a.name == "torch.cuda" and a.asname:
                self.torch_cuda_aliases.add(a.asname)
            if a.name == "torch" and a.asname:  # import torch as th: th.cuda is torch.cuda
                self.torch_cuda_aliases.add(a.asname + ".cuda")
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        if node.module and node.level == 0:
            self._library(node, node.module)
            if node.module == "torch":
                for a in node.names:
                    if a.name == "cuda":
                        self.torch_cuda_aliases.add(a.asname or "cuda")
            if node.module == CPP_EXTENSION:
                for a in node.names:
                    if a.name == "CUDAExtension":
                        self.add("TPU005", node, "imports torch.utils.cpp_extension.CUDAExtension", PORT_KERNEL)
        self.generic_visit(node)

    def _library(self, node, module: str):
        top = module.split(".")[0]
        if top in CUDA_ONLY_LIBRARIES:
            self.add("TPU004", node, f"imports {module}, whose kernels run on CUDA only",
                     f"use {CUDA_ONLY_LIBRARIES[top]}")
        for sub, advice in CUDA_ONLY_SUBMODULES.items():
            if module == sub or module.startswith(sub + "."):
                self.add("TPU004", node, f"imports {module}, whose kernels run on CUDA only", f"use {advice}")

    def visit_Constant(self, node):
        if _cuda_string(node) and id(node) not in self.docstrings:
            # Rewritten only where an expression may stand: a call's argument or a comparison
            # (not a Literal["cuda"] annotation, a match pattern or a dict key).
            parent = self.parents.get(id(node))
            in_call = isinstance(parent, ast.Call) and node in parent.args
            in_keyword = isinstance(parent, ast.keyword) and isinstance(self.parents.get(id(parent)), ast.Call)
            if isinstance(parent, ast.Compare) and not any(_names_device(o) for o in [parent.left, *parent.comparators]):
                return  # a string compared with "cuda", not a device
            fixable = in_call or in_keyword or isinstance(parent, ast.Compare)
            self.add("TPU001", node, f'the device string "{node.value}"',
                     f"use a device chosen at run time ({self.device_expr}, or a --device option)",
                     fix=self.device_fix(node) if fixable else None)

    def visit_Attribute(self, node):
        member = self.cuda_member(node)
        if member and isinstance(node.ctx, ast.Load):
            head = member.split(".")[0]
            if head in GRAPHS_STREAMS:
                self.add("TPU008", node, f"torch.cuda.{head}", f"use {GRAPHS_STREAMS[head]}")
        name = _dotted(node)
        if name and (name.startswith("torch.backends.cudnn.") or name.startswith("torch.backends.cuda.matmul.")):
            self.add("TPU007", node, name, "torch.set_float32_matmul_precision('high') for TF32-like matmuls; "
                     "cuDNN switches have no effect off CUDA")
        self._note_build_extension(node)
        self.generic_visit(node)

    def visit_Name(self, node):
        self._note_build_extension(node)

    def _note_build_extension(self, node):
        # cmdclass={"build_ext": BuildExtension}: a reference, not a call
        if isinstance(node.ctx, ast.Load) and self.extension_api(node) == "BuildExtension":
            self.build_extension.append(node)

    def visit_Call(self, node):
        func = node.func
        # x.cuda() / x.cuda(n)
        if isinstance(func, ast.Attribute) and func.attr == "cuda" and _dotted(func) not in ("torch.cuda",):
            if not node.args and not node.keywords:
                self.add("TPU002", node, "`.cuda()`", f"use .to({self.device_expr})", fix=f".to({self.device_expr})")
                # The finding (and its fix) is the ".cuda()" after the receiver.
                self.findings[-1].line = func.value.end_lineno
                self.findings[-1].column = self.column(func.value.end_lineno, func.value.end_col_offset)
            else:
                self.add("TPU002", node, "`.cuda(...)` with arguments", "use .to(device, non_blocking=...)")
        member = self.cuda_member(func)
        if member is not None:
            if member in SAME_ARGUMENTS:
                target = SAME_ARGUMENTS[member]
                self.add("TPU003", func, f"torch.cuda.{member}", f"use {target}", fix=target)
            elif member in ADVICE:
                self.add("TPU003", func, f"torch.cuda.{member}", f"use {ADVICE[member]}")
        name = _dotted(func) or ""
        tail = name.rsplit(".", 1)[-1]
        if tail in ("init_process_group", "new_group"):
            backend = node.args[0] if tail == "init_process_group" and node.args else None
            for k in node.keywords:
                if k.arg == "backend":
                    backend = k.value
            if isinstance(backend, ast.Constant) and isinstance(backend.value, str) and "nccl" in backend.value:
                self.add("TPU006", backend, f'backend "{backend.value}"',
                         "leave the backend out (PyTorch then picks one per device) or name it from the device")
        self._extension_build(node)
        self._library_call(node)
        self._triton_call(node)
        if tail in LAYERS_IN_OUT and (name.startswith("nn.") or name.startswith("torch.nn.") or name == tail):
            self._padding(node, tail)
        self.generic_visit(node)

    def _extension_build(self, node):
        api = self.extension_api(node.func)
        if api not in EXTENSION_BUILDS:
            return
        if api == "CUDAExtension" or _builds_cuda(node, api):
            self.add("TPU005", node, f"{api}(...) builds a CUDA extension", PORT_KERNEL)
        else:
            self.add("TPU013", node, f"{api}(...) builds a C++ extension with no CUDA sources: it runs on the CPU, "
                     "not on tpu", PORT_CPU_EXTENSION)

    def _library_call(self, node):
        api = self.qualified(node.func)
        if not api:
            return
        top, last = api.split(".")[0], api.rsplit(".", 1)[-1]
        if top in CUDA_ONLY_LIBRARIES and top != "triton":  # triton: its kernels and launches, not tl.* calls
            default = CUDA_ONLY_LIBRARIES[top]
        else:
            default = next((a for sub, a in CUDA_ONLY_SUBMODULES.items() if api.startswith(sub + ".")), None)
            if default is None:
                return
        move = API_MOVES.get(top, {}).get(last, default)
        self.add("TPU010", node, f"calls {api}, which runs on CUDA only", f"use {move}")

    def _triton_call(self, node):
        func = node.func
        if isinstance(func, ast.Subscript):  # kernel[grid](...)
            k = func.value
            if (isinstance(k, ast.Name) and k.id in self.triton_kernels) or \
                    (isinstance(k, ast.Attribute) and k.attr in self.triton_methods) or self._imported_kernel(k):
                self.add("TPU012", node, f"launches the Triton kernel {_dotted(k)}",
                         "call the ported op (torch.ops.torch_tpu_kernels.<name> from torch_tpu.kernels) or "
                         "the PyTorch ops the kernel fuses")
        elif self._wraps_triton(node) and isinstance(self.parents.get(id(node)), ast.Assign):
            # k = triton.jit(f): a definition without a decorator (the outermost call only)
            target = ast.unparse(self.parents[id(node)].targets[0])
            self.add("TPU011", node, f"the Triton kernel {target}", PORT_TRITON)

    def _imported_kernel(self, node) -> bool:
        """A name imported from the project's own modules, in a file that imports triton."""
        q = self.qualified(node)
        return bool(self.imports_triton and q and q.split(".")[0] not in NOT_KERNEL_MODULES)

    def _padding(self, node, layer):
        i_in, i_out = LAYERS_IN_OUT[layer]
        dims = []
        for i in (i_in, i_out):
            if i is not None and i < len(node.args):
                v = _int_literal(node.args[i])
                if v is not None and v > 0:
                    dims.append(v)
        if len(dims) == 0:
            return
        bad = [d for d in dims if d % TILE]
        if not bad:
            return
        padded = 1
        real = 1
        for d in dims:
            padded *= -(-d // TILE) * TILE
            real *= d
        waste = padded / real - 1
        # A layer smaller than one tile costs nothing worth a finding; a remainder under 5% neither.
        if real < TILE * TILE or waste < 0.05:
            return
        self.add("TPU009", node, f"nn.{layer} with width {', '.join(map(str, dims))}: about {waste:.0%} of its "
                 f"matrix work is padding on 128x128 tiles",
                 f"round {' and '.join(map(str, bad))} up to a multiple of {TILE} where the model allows")


def _names_device(node) -> bool:
    """x.device, device, x.device.type, args.device: an operand that holds a device or its type."""
    name = _dotted(node) or ""
    return "device" in name.lower() or name.endswith(".type")


def _mentions_cu(node) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith((".cu", ".cuh")):
            return True
    return False


def _builds_cuda(call: ast.Call, api: str) -> bool:
    """Whether a cpp_extension build gets CUDA code: .cu sources, cuda_sources (load_inline's third
    argument), extra_cuda_cflags or with_cuda=True. Sources held in a variable are not seen."""
    if any(_mentions_cu(a) for a in call.args):
        return True
    if api == "load_inline" and len(call.args) > 2 and not _empty(call.args[2]):
        return True
    for k in call.keywords:
        if k.arg in CUDA_ARGUMENTS and not _empty(k.value):
            return True
        if k.arg == "with_cuda" and isinstance(k.value, ast.Constant) and k.value.value is True:
            return True
        if k.arg in ("sources", "cpp_sources") and _mentions_cu(k.value):
            return True
    return False


def _empty(node) -> bool:
    """None, "", [] or () written out."""
    if isinstance(node, ast.Constant):
        return not node.value
    return isinstance(node, (ast.List, ast.Tuple)) and not node.elts


def scan_source(source: str, path: str = "<string>", device_expr: str = DEFAULT_DEVICE_EXPR) -> list[Finding]:
    """The findings of one file's source; raises SyntaxError where it does not parse."""
    tree = ast.parse(source, filename=path)
    s = _Scanner(path, source, device_expr)
    s.visit(tree)
    s.finish()
    return sorted(s.findings, key=lambda f: (f.line, f.column, f.rule))


def python_files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "node_modules"))
                out += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"torch-tpu doctor: {p}: no such file or folder")
    return out


def scan(paths: list[str], device_expr: str = DEFAULT_DEVICE_EXPR) -> Report:
    report = Report()
    for f in python_files(paths):
        report.files += 1
        try:
            with open(f, encoding="utf-8") as fh:
                src = fh.read()
            report.findings += scan_source(src, f, device_expr)
        except (SyntaxError, UnicodeDecodeError, OSError) as e:
            report.errors.append(f"{f}: {type(e).__name__}: {e}")
    return report


def apply_fixes(source: str, findings: list[Finding]) -> str:
    """The source with every fixable finding's span replaced (spans never overlap: a device string
    inside a rewritten call is its own span, and edits go from the end of the file backwards)."""
    lines = _source_lines(source)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))

    def offset(line, col):  # col is 1-based, in characters
        return starts[line - 1] + col - 1

    edits = sorted(((offset(f.line, f.column), offset(f.end_line, f.end_column), f.fix) for f in findings
                    if f.fix is not None), reverse=True)
    out = source
    last_start = len(source) + 1
    for a, b, text in edits:
        if b > last_start:  # overlapping: keep the later edit only
            continue
        out = out[:a] + text + out[b:]
        last_start = a
    if out != source and "torch.accelerator" in out and not _imports_torch(out):
        out = _insert_import(out)
    return out


def _insert_import(source: str) -> str:
    """`import torch` after the module docstring and `from __future__` imports, which must come first."""
    tree = ast.parse(source)
    after = 0
    for i, node in enumerate(tree.body):
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and \
            isinstance(node.value.value, str)
        if docstring or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            after = node.end_lineno
        else:
            break
    lines = _source_lines(source)
    if after and not lines[after - 1].endswith("\n"):
        lines[after - 1] += "\n"
    return "".join(lines[:after] + ["import torch\n"] + lines[after:])


def _imports_torch(source: str) -> bool:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name == "torch" and not a.asname for a in n.names):
            return True
    return False


# -- output


def to_text(report: Report) -> str:
    out = []
    for f in report.findings:
        out.append(f"{f.path}:{f.line}:{f.column}: {f.level} {f.rule} {f.name}: {f.message} -- {f.advice}"
                   + (" [fixable]" if f.fix is not None else ""))
    for e in report.errors:
        out.append(f"error: {e}")
    by_rule = {}
    for f in report.findings:
        by_rule[f.rule] = by_rule.get(f.rule, 0) + 1
    summary = ", ".join(f"{r} {RULES[r][0]}: {n}" for r, n in sorted(by_rule.items()))
    fixable = sum(f.fix is not None for f in report.findings)
    out.append(f"{len(report.findings)} findings in {report.files} files ({fixable} fixable with --fix)"
               + (f"; {summary}" if summary else ""))
    return "\n".join(out) + "\n"


def to_json(report: Report) -> str:
    return json.dumps({"files": report.files, "errors": report.errors,
                       "findings": [dict(asdict(f), name=f.name) for f in report.findings]}, indent=1) + "\n"


def to_sarif(report: Report) -> str:
    from importlib import metadata

    try:
        version = metadata.version("torch_tpu")
    except metadata.PackageNotFoundError:
        version = "0"
    rule_ids = sorted(RULES)
    rules = [{"id": r, "name": RULES[r][0], "shortDescription": {"text": RULES[r][2]},
              "defaultConfiguration": {"level": RULES[r][1]}} for r in rule_ids]
    results = []
    for f in report.findings:
        results.append({
            "ruleId": f.rule,
            "ruleIndex": rule_ids.index(f.rule),
            "level": f.level,
            "message": {"text": f"{f.message}: {f.advice}"},
            "locations": [{"physicalLocation": {
                "artifactLocation": {"uri": _uri(f.path)},
                "region": {"startLine": f.line, "startColumn": f.column, "endLine": f.end_line,
                           "endColumn": f.end_column}}}],
        })
    notifications = [{"level": "error", "message": {"text": e}} for e in report.errors]
    run = {"tool": {"driver": {"name": "torch-tpu doctor", "version": version,
                               "informationUri": "https://github.com/torch-tpu/torch_tpu", "rules": rules}},
           "results": results,
           "invocations": [{"executionSuccessful": not report.errors, "toolExecutionNotifications": notifications}]}
    doc = {"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0", "runs": [run]}
    return json.dumps(doc, indent=1) + "\n"


def _uri(path: str) -> str:
    return path.replace(os.sep, "/") if not os.path.isabs(path) else "file://" + path.replace(os.sep, "/")


def run_script(command: list[str], timeout: float | None = None) -> tuple[dict, int]:
    """Runs `script args...` on tpu in a child process; its report and exit status. The report
    is kept when the script raises or exits non-zero."""
    import subprocess
    import tempfile

    script = command[0]
    if not os.path.isfile(script):
        raise FileNotFoundError(f"torch-tpu doctor: {script}: no such script")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "report.json")
        r = subprocess.run([sys.executable, "-m", "torch_tpu._doctor_run", out, *command], timeout=timeout)
        if not os.path.exists(out):
            return {"script": script, "exit": r.returncode, "error": {
                "type": "crash", "message": f"the process ended with status {r.returncode} before its report",
                "at": None}}, r.returncode
        with open(out) as f:
            return json.load(f), r.returncode


def run_to_text(rep: dict) -> str:
    lines = [f"torch-tpu doctor --run {rep['script']}: exit status {rep['exit']}"
             + (f", {rep['seconds']:.1f} s" if "seconds" in rep else "")]
    if rep.get("error"):
        e = rep["error"]
        lines.append(f"  the script raised {e['type']}: {e['message']}" + (f" (at {e['at']})" if e["at"] else ""))
    if "fallbacks" not in rep:
        return "\n".join(lines) + "\n"
    fb = rep["fallbacks"]
    lines.append(f"CPU fallbacks: {len(fb)} ops" + (" (each copies its inputs to the host and back)" if fb else ""))
    for f in fb:
        lines.append(f"  {f['op']}: {f['calls']} calls, first from {f['first_call'] or 'inside torch'}")
    c = rep["compiles"]
    lines.append(f"compiles: {c['count']} ({c['seconds']:.1f} s); programs loaded from the disk cache: "
                 f"{c['from_disk_cache']}")
    for op, n in list(c["by_op"].items())[:10]:
        lines.append(f"  {op}: {n}")
    for reason in c["reasons"][-5:]:
        lines.append(f"  recompiled: {reason}")
    h = rep["host_reads"]
    lines.append(f"host reads (each waits for the device): {h['count']} ({h['bytes']} bytes)")
    lines.append(f"graph breaks (torch.compile): {sum(b['count'] for b in rep['graph_breaks'])}")
    for b in rep["graph_breaks"][:10]:
        lines.append(f"  {b['count']}x {b['reason']}")
    if rep["top_ops"]:
        lines.append("ops by time (host side, self):")
        for o in rep["top_ops"][:10]:
            lines.append(f"  {o['op']}: {o['self_ms']:.1f} ms in {o['calls']} calls")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = None
    if "--run" in argv:  # everything after --run is the script and its arguments
        i = argv.index("--run")
        argv, command = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="torch-tpu doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*" if command is not None else "+",
                    help="Python files or folders (every .py file under them)")
    ap.add_argument("--run", dest="_run", metavar="SCRIPT ARGS", help="run the script on tpu and report what a port "
                    "needs to know (CPU fallbacks, compiles, host reads, graph breaks, slowest ops)")
    ap.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    ap.add_argument("--output", help="write the report here instead of standard output")
    ap.add_argument("--fix", action="store_true", help="apply the safe rewrites in place")
    ap.add_argument("--diff", action="store_true", help="print the safe rewrites as a unified diff, change nothing")
    ap.add_argument("--device", default=DEFAULT_DEVICE_EXPR,
                    help="the Python expression the rewrites use for the device (default: %(default)s)")
    ap.add_argument("--exit-zero", action="store_true", help="exit 0 even when something was found")
    args = ap.parse_args(argv)
    if command is not None:
        if not command:
            ap.error("--run needs a script")
        if args.format == "sarif":
            ap.error("--run reports as text or json; SARIF is for the scan of files")
        try:
            rep, status = run_script(command)
        except FileNotFoundError as e:
            print(e, file=sys.stderr)
            return 2
        text = run_to_text(rep) if args.format == "text" else json.dumps(rep, indent=1) + "\n"
        if args.output:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text)
        else:
            sys.stdout.write(text)
        return status
    try:
        report = scan(args.paths, args.device)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    if args.fix or args.diff:
        by_file: dict[str, list[Finding]] = {}
        for f in report.findings:
            by_file.setdefault(f.path, []).append(f)
        for path, fs in by_file.items():
            with open(path, encoding="utf-8") as fh:
                src = fh.read()
            new = apply_fixes(src, fs)
            if new == src:
                continue
            if args.diff:
                sys.stdout.writelines(difflib.unified_diff(src.splitlines(keepends=True),
                                                           new.splitlines(keepends=True), path, path))
            if args.fix:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(new)
        if args.diff and not args.output:
            return 0 if args.exit_zero or not report.findings else 1
    text = {"text": to_text, "json": to_json, "sarif": to_sarif}[args.format](report)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    elif not args.diff:
        sys.stdout.write(text)
    if report.errors:
        for e in report.errors:
            print(f"torch-tpu doctor: {e}", file=sys.stderr)
        return 2
    return 0 if args.exit_zero or not report.findings else 1


if __name__ == "__main__":
    sys.exit(main())
