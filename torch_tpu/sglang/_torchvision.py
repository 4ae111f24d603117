"""A stand-in for torchvision in the SGLang environment (.venv-sglang), which
scripts/setup_sglang.sh installs as the package `torchvision` there.

SGLang 0.5.21 and transformers 5.12.1 import torchvision at start (SGLang's
multimodal configs, transformers' AutoImageProcessor), and PyPI's torchvision
for torch 2.13 links CUDA libraries: its ops fail to register on a CPU torch.
This module has the names those imports bind (the interpolation and read
modes, the functional modules) and no image operation: calling one raises.
Text models, all that torch_tpu's SGLang platform serves, use none of them.
"""
import enum
import sys
import types

__version__ = "0.28.0"  # the torchvision release of torch 2.13, which the importers check


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def _module(name: str, **names) -> types.ModuleType:
    """A submodule whose other attributes are functions that raise."""
    mod = types.ModuleType(f"torchvision.{name}")

    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):
            raise NotImplementedError(
                f"torchvision.{name}.{attr}: this environment's torchvision is torch_tpu's stand-in "
                "(no image operations; PyPI's torchvision for torch 2.13 needs CUDA)"
            )

        return unavailable

    mod.__getattr__ = missing
    mod.__dict__.update(names)
    sys.modules[mod.__name__] = mod
    return mod


io = _module("io", ImageReadMode=ImageReadMode)
ops = _module("ops")
transforms = _module("transforms", InterpolationMode=InterpolationMode)
transforms.functional = _module("transforms.functional", InterpolationMode=InterpolationMode)
transforms.v2 = _module("transforms.v2", InterpolationMode=InterpolationMode)
transforms.v2.functional = _module("transforms.v2.functional", InterpolationMode=InterpolationMode)
