"""The ARM64 paths of the quantized product (NEON sdot; smmla where i8mm is targeted) give the scalar reference's bits,
checked on any machine with a cross compiler and qemu-user: quantized_check.cpp (no MLX) built for aarch64 and run
under qemu-aarch64."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CPU_DIR = Path(__file__).resolve().parent.parent / "akunu" / "backends" / "cpu"
COMPILER, EMULATOR = "aarch64-linux-gnu-g++", "qemu-aarch64"
TARGETS = {"sdot": "-march=armv8.2-a+dotprod", "i8mm": "-march=armv8.6-a+dotprod+i8mm"}
ALL_EQUAL = "neon: 1296 of 1296 cases equal the reference bit for bit"
# A fused multiply-add of add_chunk as a multiply then an add: one rounding more, which the check must catch.
FUSED = "vfmaq_f32(acc, vcvtq_f32_s32(dots), factors)"
UNFUSED = "vaddq_f32(acc, vmulq_f32(vcvtq_f32_s32(dots), factors))"


@pytest.fixture
def tools():
    missing = [tool for tool in (COMPILER, EMULATOR) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not on PATH (apt-get install g++-aarch64-linux-gnu qemu-user)")


def _check(source_dir: Path, binary: Path, target: str, optimize: str) -> subprocess.CompletedProcess:
    """quantized_check.cpp of source_dir built static for `target` (-O1 or -O3), run under qemu."""
    build = [COMPILER, optimize, "-std=c++20", TARGETS[target], "-ffp-contract=off", "-static", "quantized_check.cpp", "-o", str(binary)]  # fmt: skip
    built = subprocess.run(build, cwd=source_dir, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return subprocess.run([EMULATOR, "-cpu", "max", str(binary)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("target", TARGETS)
def test_the_neon_path_equals_the_reference_bit_for_bit(tools, tmp_path, target):
    run = _check(CPU_DIR, tmp_path / f"check-{target}", target, "-O3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1] == ALL_EQUAL, run.stdout


def test_the_check_catches_a_neon_path_that_rounds_once_more(tools, tmp_path):
    """The same check over a copy of the sdot path with one multiply-add unfused (-O1: it only has to build and run)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("quantized_check.cpp", "quantized_core.h"):
        shutil.copy(CPU_DIR / name, broken / name)
    header = (CPU_DIR / "quantized_neon.h").read_text()
    assert header.count(FUSED) == 1, "add_chunk's fused multiply-add moved: update FUSED"
    (broken / "quantized_neon.h").write_text(header.replace(FUSED, UNFUSED))
    run = _check(broken, tmp_path / "check-broken", "sdot", "-O1")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "MISMATCH" in run.stdout and ALL_EQUAL not in run.stdout, run.stdout
