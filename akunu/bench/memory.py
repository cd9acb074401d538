"""Resident memory of loading a model and a short greedy generate, stage by stage (`akunu bench memory`).

The peak is the process's own (getrusage), so one run measures one model.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

PROMPT = "# Fibonacci numbers, three ways\n\ndef fib_recursive(n):\n"
MIB = 2**20


@dataclass(frozen=True)
class Stage:
    name: str
    resident_mib: float | None  # None where the system does not say (no /proc)
    peak_mib: float


def resident_mib() -> float | None:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def peak_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def stage(name: str) -> Stage:
    resident = resident_mib()
    return Stage(name, resident, max(peak_mib(), resident or 0.0))  # the two are read apart


def weights_mib(model) -> float:
    from mlx.utils import tree_flatten

    return sum(array.nbytes for _, array in tree_flatten(model.parameters())) / MIB


def file_mib(path: Path) -> float | None:
    """The model's size on disk: its file, or the files of its folder; None if it is neither."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size / MIB
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MIB
    return None


def plain_generate(loaded, max_tokens: int):
    """A greedy generate of `max_tokens` from PROMPT without speculation; its stats."""
    from akunu.generate import GenerationConfig, SpecConfig, generate

    config = GenerationConfig(max_tokens=max_tokens, spec=SpecConfig(enabled=False))
    return generate(loaded.model, loaded.tokenizer, loaded.tokenizer.encode(PROMPT), config)[2]
