"""akunu's fused CPU kernels (kernels.cpp): attention, SwiGLU, RMSNorm and the split of q|k|v into rotated heads, one MLX primitive each.

They are built on first use, the way MLX builds its own compiled CPU kernels: g++ against the MLX
and nanobind installed beside akunu, for this machine's CPU, into a cache keyed by all of those
(a build takes seconds to a minute, once per toolchain). Without a compiler, Python's headers or a nanobind that shares
MLX's binding ABI, `load()` returns None, `unavailable()` says why, and the step keeps MLX's ops.
AKUNU_KERNELS=0 turns them off; AKUNU_KERNEL_CACHE moves the cache (default ~/.cache/akunu/kernels:
it depends on the toolchain only, not on a model home).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from akunu.backends.cpu import blas

ENV_SWITCH = "AKUNU_KERNELS"
SOURCE = Path(__file__).with_name("kernels.cpp")
MODULE_NAME = "akunu_cpu_kernels"
_why_not: list[str] = []


def cache_dir() -> Path:
    if configured := os.environ.get("AKUNU_KERNEL_CACHE"):
        return Path(configured).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root).expanduser() / "akunu" / "kernels"


def describe() -> str:
    """For a run's header: whether decode steps run the fused kernels, and if not, why."""
    return "fused" if load() else f"MLX's ops ({unavailable()})"


def unavailable() -> str | None:
    """Why the kernels are not in use (None once `load()` succeeded or before it ran)."""
    return _why_not[0] if _why_not else None


@cache
def load() -> ModuleType | None:
    """The kernels' module, built first if this toolchain has none yet; None where they cannot run."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return _give_up(f"{ENV_SWITCH}=0")
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return _give_up("the fused kernels are built for Linux CPUs only")
    try:
        import nanobind
    except ImportError:
        return _give_up("nanobind is not installed")
    try:
        module = build_and_import(SOURCE, MODULE_NAME, nanobind, ("-march=native", "-ffp-contract=off"))
    except BuildError as error:
        return _give_up(str(error))
    blas.share_threads(module.pool_runner_address())  # one set of helper threads for every CPU kernel
    try:
        _check(module)
    except Exception as error:  # noqa: BLE001 - a module that does not load or check out is not used
        return _give_up(f"the built kernels do not work here: {error}")
    _why_not.clear()
    return module


class BuildError(Exception):
    """A kernel source that could not be built or imported here (one line saying why)."""


def build_and_import(
    source: Path, module_name: str, nanobind: ModuleType, flags: tuple[str, ...] = ("-march=native",)
) -> ModuleType:
    """The nanobind module `module_name` built from `source` with the compiler's `flags` (the instruction set),
    from the cache or compiled now."""
    key = _build_key(nanobind.__version__, source, flags)
    target = cache_dir() / key / (module_name + sysconfig.get_config_var("EXT_SUFFIX"))
    if not target.exists():
        try:
            _build(target, nanobind, source, flags)
        except (OSError, subprocess.SubprocessError) as error:
            lines = str(error).strip().splitlines() or [type(error).__name__]
            first_error = next((line for line in lines if "error" in line), lines[-1])  # g++ ends on context lines
            raise BuildError(f"building {source.name} failed: {first_error.strip()[:200]}") from None
    try:
        spec = importlib.util.spec_from_file_location(module_name, target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - a module that does not load is not used
        raise BuildError(f"the built {source.name} does not load here: {error}") from None
    return module


def _give_up(reason: str) -> None:
    _why_not[:] = [reason]
    return None


def _build_key(nanobind_version: str, source: Path = SOURCE, flags: tuple[str, ...] = ()) -> str:
    """What the binary depends on: the source and the headers beside it, the flags, MLX, nanobind, Python and this
    CPU's features."""
    parts = [
        " ".join(flags).encode(),
        source.read_bytes(),
        *(header.read_bytes() for header in sorted(source.parent.glob("*.h"))),
        mx.__version__.encode(),
        nanobind_version.encode(),
        sys.version.encode(),
        _cpu_flags(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()


def _build(target: Path, nanobind: ModuleType, source: Path, flags: tuple[str, ...]) -> None:
    """Compile into `target` (atomically; another process building the same key waits for it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return
        mlx_dir = Path(mx.__file__).parent
        partial = target.with_suffix(".partial")
        command = [
            os.environ.get("CXX", "g++"), "-O3", *flags, "-std=c++20", "-shared", "-fPIC",
            "-fvisibility=hidden", "-fno-strict-aliasing", "-fopenmp", "-DNDEBUG", "-DNB_DOMAIN=mlx",
            f"-I{sysconfig.get_paths()['include']}", f"-I{nanobind.include_dir()}",
            f"-I{Path(nanobind.source_dir()).parent / 'ext' / 'robin_map' / 'include'}", f"-I{mlx_dir / 'include'}",
            str(Path(nanobind.source_dir()) / "nb_combined.cpp"), str(source),
            f"-L{mlx_dir / 'lib'}", "-lmlx", "-ldl", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(partial),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise subprocess.SubprocessError(result.stderr or f"{command[0]} exited with {result.returncode}")
        partial.replace(target)


def _check(module: ModuleType) -> None:
    """The kernels against MLX's own ops on a small case, so a bad build is never used."""
    q, k, v = (
        mx.random.normal(shape, key=mx.random.key(i))
        for i, shape in enumerate([(1, 4, 3, 16), (1, 2, 5, 16), (1, 2, 5, 16)])
    )
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mx.arange(2, 5)[:, None] >= mx.arange(5))
    gate, x = q[0, 0], q[0, 1]
    product = q.reshape(3, 64)  # one token's q|k|v rows for 2 query heads and 1 KV head of 16, 3 tokens
    cos, sin = mx.cos(k[0, 0, :3]), mx.sin(k[0, 0, :3])
    split = module.split_heads(product, cos, sin, 1, 2, 1, True)
    heads = product.reshape(1, 3, 4, 16).transpose(0, 2, 1, 3)
    partner = heads[..., [i ^ 1 for i in range(16)]]
    buffer_k, buffer_v = mx.pad(k, [(0, 0), (0, 0), (0, 3), (0, 0)]), mx.pad(v, [(0, 0), (0, 0), (0, 3), (0, 0)])
    first, second = mx.split(product, 2, axis=-1)  # a gate|up product's halves
    half_k, half_v = (a.astype(mx.float16) for a in (buffer_k, buffer_v))  # a CPU cache's buffers
    expected_half = mx.fast.scaled_dot_product_attention(q, k.astype(mx.float16).astype(mx.float32),
                                                         v.astype(mx.float16).astype(mx.float32), scale=0.3,
                                                         mask=mx.arange(2, 5)[:, None] >= mx.arange(5))  # fmt: skip
    checks = [
        (module.attention(q, k, v, 0.3, True), expected),
        (module.attention(q, buffer_k, buffer_v, 0.3, True, 5, True), expected.transpose(0, 2, 1, 3).reshape(3, 64)),
        (module.attention(q, half_k, half_v, 0.3, True, 5), expected_half),
        (module.swiglu_halves(product), first * mx.sigmoid(first) * second),
        (module.swiglu(gate, x), gate * mx.sigmoid(gate) * x),
        (module.rms_norm(q, k[0, 0, 0], 1e-5), mx.fast.rms_norm(q, k[0, 0, 0], 1e-5)),
        (mx.concatenate(split, axis=1), mx.concatenate([(heads * cos + partner * sin)[:, :3], heads[:, 3:]], axis=1)),
    ]
    for got, want in checks:
        if not mx.allclose(got, want, rtol=1e-4, atol=1e-5).item():
            raise ValueError("the fused kernels disagree with MLX's ops")
