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
