"""Builds the C++ extension torch_tpu._C with CMake + Ninja (ccache when
present) and packages it. The CMake build folder is ./build, so a rebuild
after a one-file change only recompiles that file (`ninja -C build`)."""

import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("TORCH_TPU_BUILD_DIR", os.path.join(ROOT, "build"))
        os.makedirs(build_dir, exist_ok=True)
        if not os.path.exists(os.path.join(build_dir, "build.ninja")):
            subprocess.check_call(
                ["cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython3_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "_C"])
        # CMake writes the module into the source package; copy it where
        # setuptools expects it for a (non-editable) wheel.
        built = [f for f in os.listdir(os.path.join(ROOT, "torch_tpu")) if f.startswith("_C") and f.endswith(".so")]
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        src = os.path.join(ROOT, "torch_tpu", built[0])
        if os.path.abspath(src) != os.path.abspath(target):
            self.copy_file(src, target)


setup(ext_modules=[Extension("torch_tpu._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
