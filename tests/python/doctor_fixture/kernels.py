# A fixture for test_doctor.py: the places a port rewrites, past the imports: calls into CUDA-only
# libraries, Triton kernels and their launches, C++/CUDA extension builds; each on a line the test names.
import apex  # TPU004
import flash_attn as fa  # TPU004
import torch
import torch.utils.cpp_extension as ext
import triton  # TPU004
import triton.language as tl  # TPU004
from apex.normalization import FusedLayerNorm  # TPU004
from flash_attn import flash_attn_func  # TPU004
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # TPU005
from triton import jit  # TPU004

from .triton_ops import fused_kernel  # a kernel of the project's own, launched below


def launch_all(x, y):
    # Launched above its definition: kernels are collected before the scan.
    grid = lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)  # noqa: E731
    out = torch.empty_like(x)
    add_kernel[grid](x, y, out, x.numel())  # TPU012
    scale_kernel[(1,)](out, out.numel())  # TPU012
    relu_kernel[grid](out, out.numel())  # TPU012
    fused_kernel[grid](out)  # TPU012
    return out


@triton.autotune(configs=[triton.Config({"BLOCK": 128})], key=["n"])  # TPU011
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@jit  # TPU011
def scale_kernel(x_ptr, n):
    tl.store(x_ptr, tl.load(x_ptr) * 2)


def _relu(x_ptr, n):
    tl.store(x_ptr, tl.maximum(tl.load(x_ptr), 0))


relu_kernel = triton.jit(_relu)  # TPU011


class Ops:
    @staticmethod
    @triton.jit(do_not_specialize=["n"])  # TPU011
    def copy_kernel(x_ptr, n):
        tl.store(x_ptr, tl.load(x_ptr))

    def run(self, x):
        self.copy_kernel[(1,)](x, x.numel())  # TPU012


def attention(q, k, v):
    o = fa.flash_attn_func(q, k, v, causal=True)  # TPU010
    o = flash_attn_func(q, k, v)  # TPU010
    norm = FusedLayerNorm(o.shape[-1])  # TPU010
    opt = apex.optimizers.FusedAdam(norm.parameters())  # TPU010
    return norm(o), opt


def build():
    a = ext.load("a", sources=["a.cpp", "a_kernel.cu"])  # TPU005
    b = ext.load_inline("b", cpp_sources="int f() { return 1; }", functions=["f"])  # TPU013
    c = torch.utils.cpp_extension.load_inline("c", "", cuda_sources="__global__ void c() {}")  # TPU005
    modules = [CUDAExtension("d", ["d.cpp", "d_kernel.cu"]),  # TPU005
               CppExtension("e", ["e.cpp", "e_kernel.cu"]),  # TPU005
               CppExtension("f", ["f.cpp"])]  # TPU013
    return a, b, c, modules


setup_args = {"cmdclass": {"build_ext": BuildExtension}}  # TPU005
