"""Build the example AdamW FFI handler without CMake.

    python examples/kernels/ffi_adamw/build.py OUTDIR

runs

    c++ -O2 -std=c++17 -shared -fPIC -isystem <torch_tpu.kernels.ffi_include_dir()> \
        adamw.cc -o OUTDIR/libtorch_tpu_adamw.so

and prints the path of the library. The compile is skipped when the library
is already newer than adamw.cc. Set CXX to use another compiler.
"""

import os
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "adamw.cc")
LIB_NAME = "libtorch_tpu_adamw.so"


def ffi_include_dir():
    """Directory holding xla/ffi/api/ffi.h in the FFI API version the torch_tpu plugin runs
    (torch_tpu.kernels.ffi_include_dir()); without torch_tpu, jaxlib's own (for JAX)."""
    try:
        from torch_tpu.kernels import ffi_include_dir as torch_tpu_headers
    except ImportError:
        import jax.ffi

        return jax.ffi.include_dir()
    return torch_tpu_headers()


def build(out_dir, include_dir=None):
    """Compile adamw.cc into out_dir/libtorch_tpu_adamw.so against the FFI headers in
    `include_dir` (default: ffi_include_dir()); return its path."""
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.abspath(os.path.join(out_dir, LIB_NAME))
    if os.path.exists(lib) and os.path.getmtime(lib) > os.path.getmtime(SOURCE):
        return lib

    # Compile to a temporary name and rename, so a concurrent reader never
    # loads a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=".libtorch_tpu_adamw.", suffix=".so",
                               dir=os.path.dirname(lib))
    os.close(fd)
    cmd = shlex.split(os.environ.get("CXX", "c++")) + [
        "-O2", "-std=c++17", "-shared", "-fPIC",
        # -isystem rather than -I: same search path, but GCC stays quiet about
        # warnings inside the XLA headers themselves.
        "-isystem", include_dir or ffi_include_dir(),
        SOURCE, "-o", tmp,
    ]
    try:
        subprocess.run(cmd, check=True)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUTDIR")
    print(build(sys.argv[1]))
