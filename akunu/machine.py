"""The machine akunu runs on: CPU, backend, BLAS and library versions (for bench records and dtype choices)."""

from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "missing"


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo on Linux, else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(model_name: str = "", dtype: str = "", dtype_reason: str = "") -> dict[str, str | int]:
    """What a measurement ran on, with the model and dtype measured."""
    import mlx.core as mx

    from akunu import backends

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cores": os.cpu_count() or 0,
        "backend": str(mx.default_device()),
        **backends.describe(),  # "blas", "cpu_kernels"
        "python": sys.version.split()[0],
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "model": model_name,
        "dtype": dtype,
        "dtype_reason": dtype_reason,
    }
