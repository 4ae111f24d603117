"""torch-tpu doctor past the imports: every call into a CUDA-only library (TPU010), every Triton
kernel and launch (TPU011, TPU012), every C++/CUDA extension build (TPU005, TPU013 without CUDA
sources), however the names were imported; and look-alikes that are none of them."""

import textwrap

from torch_tpu import doctor


def found(src):
    """(rule, line) of every finding, in order."""
    return [(f.rule, f.line) for f in doctor.scan_source(textwrap.dedent(src))]


def only(src, rule):
    return [f for f in doctor.scan_source(textwrap.dedent(src)) if f.rule == rule]


def test_library_calls_through_every_kind_of_import():
    src = """\
        import flash_attn as fa
        import apex.normalization
        import deepspeed
        from apex import optimizers
        from flash_attn import flash_attn_func as attn
        from bitsandbytes.optim import AdamW8bit
        fa.flash_attn_func(q, k, v)
        attn(q, k, v)
        apex.normalization.FusedRMSNorm(8)
        optimizers.FusedLAMB(params)
        AdamW8bit(params)
        deepspeed.ops.adam.FusedAdam(params)
        deepspeed.initialize(model=m)
        fa.flash_attn_func(q, k, v).float()
        """
    assert found(src) == [("TPU004", 1), ("TPU004", 2), ("TPU004", 4), ("TPU004", 5), ("TPU004", 6),
                          ("TPU010", 7), ("TPU010", 8), ("TPU010", 9), ("TPU010", 10), ("TPU010", 11),
                          ("TPU010", 12), ("TPU010", 14)]
    moves = {f.line: (f.message, f.advice) for f in only(src, "TPU010")}
    assert "flash_attn.flash_attn_func" in moves[8][0]  # the API by its name, not the alias
    assert "scaled_dot_product_attention" in moves[8][1] and "torch_tpu.kernels" in moves[8][1]
    assert "apex.normalization.FusedRMSNorm" in moves[9][0] and "torch.nn.RMSNorm" in moves[9][1]
    assert "torch.optim.AdamW" in moves[11][1] and "torch.optim.AdamW" in moves[12][1]
    # An API with no move of its own gets its library's.
    (f,) = only("import xformers.ops as xops\nxops.fmha.BlockDiagonalMask.from_seqlens([2])\n", "TPU010")
    assert f.advice == "use " + doctor.CUDA_ONLY_LIBRARIES["xformers"]


def test_a_guarded_import_still_binds_and_a_module_level_def_takes_the_name_back():
    src = """\
        try:
            from apex.normalization import FusedLayerNorm
        except ImportError:
            FusedLayerNorm = None
        FusedLayerNorm(8)
        """
    assert found(src) == [("TPU004", 2), ("TPU010", 5)]
    src = """\
        from triton import jit
        def jit(fn):
            return fn
        @jit
        def k(x):
            pass
        k[(1,)](x)
        """
    assert found(src) == [("TPU004", 1)]


def test_triton_kernels_and_launches():
    src = """\
        import triton
        import triton.language as tl
        from triton import heuristics

        def run(x):
            k[(triton.cdiv(x.numel(), 128),)](x)
            tuned[(1,)](x)

        @heuristics({"EVEN": lambda a: a["n"] % 128 == 0})
        @triton.jit
        def k(x_ptr):
            tl.store(x_ptr, tl.load(x_ptr))

        @triton.autotune(configs=[], key=[])
        def tuned(x_ptr):
            pass

        wrapped = triton.autotune(configs=[], key=[])(triton.jit(run))
        wrapped[(1,)](x)
        """
    # tl.load, triton.cdiv: inside the kernel and its grid, not findings of their own
    assert found(src) == [("TPU004", 1), ("TPU004", 2), ("TPU004", 3), ("TPU012", 6), ("TPU012", 7),
                          ("TPU011", 9), ("TPU011", 14), ("TPU011", 18), ("TPU012", 19)]
    k = only(src, "TPU011")[0]
    assert "k (@triton.heuristics, @triton.jit)" in k.message and "torch_tpu.kernels" in k.advice
    assert all(f.level == "error" and f.fix is None for f in doctor.scan_source(textwrap.dedent(src)))


def test_a_launch_of_an_imported_kernel_needs_triton_in_the_file():
    src = """\
        import triton
        from typing import Callable
        from .ops import fused
        from . import ops
        fused[(1,)](x)
        ops.other[(1,)](x)
        Callable[[int], int]
        """
    assert only(src, "TPU012") and [f.line for f in only(src, "TPU012")] == [5, 6]
    assert found("from .ops import fused\nfused[(1,)](x)\n") == []


def test_extension_builds_however_imported():
    src = """\
        import torch
        from torch.utils import cpp_extension
        from torch.utils.cpp_extension import *
        cpp_extension.load_inline("a", "", "__global__ void a() {}")
        cpp_extension.load("b", ["b.cpp"], extra_cuda_cflags=["-O3"])
        torch.utils.cpp_extension.load("c", ["c.cpp"], with_cuda=True)
        load("d", sources=["d.cpp"])
        load_inline("e", cpp_sources="", cuda_sources=None)
        CppExtension("f", ["f.cpp"])
        CUDAExtension("g", ["g.cpp"])
        setup(cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)})
        cpp_extension.include_paths()
        """
    assert found(src) == [("TPU005", 4), ("TPU005", 5), ("TPU005", 6), ("TPU013", 7), ("TPU013", 8),
                          ("TPU013", 9), ("TPU005", 10), ("TPU005", 11)]
    notes = only(src, "TPU013")
    assert all(f.level == "note" and "on the CPU, not on tpu" in f.message for f in notes)
    # Without a CUDA build in the file, BuildExtension builds CPU code only.
    src = "from torch.utils.cpp_extension import BuildExtension, CppExtension\n" \
          "CppExtension('f', ['f.cpp'])\nsetup(cmdclass={'build_ext': BuildExtension})\n"
    assert found(src) == [("TPU013", 2), ("TPU013", 3)]


def test_look_alikes_are_not_findings():
    src = """\
        import json
        import pickle
        import torch
        from json import load as json_load
        import torch.utils.cpp_extension as ext

        def jit(fn):
            return fn

        @jit
        def step(x):
            return x

        table = {(1,): step}
        grid = (1,)
        table[grid](1)
        step[grid]
        json.load(f)
        json_load(f)
        pickle.load(f)
        torch.load("m.pt")
        ext.include_paths()
        """
    assert found(src) == []
    # An unrelated name that happens to be `load` in a file that also imports cpp_extension.
    assert found("from torch.utils.cpp_extension import load_inline\nfrom yaml import load\nload(f)\n") == []
