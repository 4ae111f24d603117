"""Shared pytest setup: make the repository importable and register the tpu device."""

from __future__ import annotations

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

import torch_tpu  # noqa: E402,F401  (registers the "tpu" device)


def assert_tpu_close(out, ref, **tol):
    """`out`, computed on tpu, equals `ref`, computed on the CPU, by PyTorch's
    tolerances (torch.testing.assert_close, which also checks dtype and shape):
    tuples and lists element by element, other values exactly."""
    if isinstance(ref, (tuple, list)):
        assert len(out) == len(ref)
        for o, r in zip(out, ref):
            assert_tpu_close(o, r, **tol)
        return
    if isinstance(ref, torch.Tensor):
        assert out.device.type == "tpu", f"result is on {out.device}"
        torch.testing.assert_close(out.cpu(), ref, **tol)
    else:
        assert out == ref


def check_against_cpu(fn, *args, **tol):
    """fn on the CPU arguments, then on their tpu copies: the results agree."""
    ref = fn(*args)
    out = fn(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
    assert_tpu_close(out, ref, **tol)


@pytest.fixture
def tpu() -> torch.device:
    return torch.device("tpu")


@pytest.fixture
def repo_root() -> str:
    return REPO_ROOT


@pytest.fixture
def fallback_error():
    """Runs the test with CPU fallback turned into an error and fresh metrics;
    restores the previous policy ("warn" unless TORCH_TPU_FALLBACK=error) after."""
    previous = "error" if torch_tpu._C._fallback_is_error() else "warn"
    torch_tpu.reset_metrics()
    torch_tpu.set_fallback("error")
    try:
        yield
    finally:
        torch_tpu.set_fallback(previous)
