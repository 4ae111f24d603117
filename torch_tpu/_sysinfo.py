"""Facts about the host that reports and benchmarks record."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else what platform knows, else ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
