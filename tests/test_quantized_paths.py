"""Each instruction set's build of the quantized kernel gives the scalar reference's bits (quantized_core.h), on every
machine that can run it: an AVX-512 machine tests its AVX2 and scalar builds too."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from akunu.backends.cpu import kernels, quantized

CPU_DIR = Path(quantized.__file__).parent
X86 = platform.machine() == "x86_64"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
HAS = {
    "scalar": True,
    "avx2": X86 and {"avx2", "fma", "f16c", "bmi2"} <= FLAGS,
    "avxvnni": X86 and {"avx2", "fma", "f16c", "bmi2", "avx_vnni"} <= FLAGS,
    "avx512": X86 and {"avx512vbmi", "avx512_vnni", "avx512bw", "avx512vl"} <= FLAGS,
}
RUNNABLE = [isa for isa, here in HAS.items() if here]


@pytest.fixture(scope="module", params=RUNNABLE)
def build(request):
    if kernels.load() is None:
        pytest.skip(f"no kernel toolchain here: {kernels.unavailable()}")
    native = quantized.load()
    # the default build already is this instruction set's path where the CPU's best is it: no second build
    module = native if native is not None and native.path == request.param else quantized.build(request.param)
    assert module.path == request.param
    return module


def _weights(bits: int, shape, dtype, seed: int):
    w = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype) * 0.1
    return mx.quantize(w, group_size=32, bits=bits)


@pytest.mark.parametrize("bits", quantized.BITS)
def test_each_build_gives_the_scalar_references_bits(build, bits):
    # 37 outputs (a partial block of 4), 9 and 129 groups (partial chunks), every scale type, centered weights
    for columns, dtype in ((288, mx.float16), (4128, mx.bfloat16), (288, mx.float32)):
        packed, scales, biases = _weights(bits, (37, columns), dtype, seed=bits)
        for held in (biases, quantized.kernel_biases(scales, scales * -(2 ** (bits - 1)), bits)):
            for rows in (1, 2, 5, 33):
                x = mx.random.normal((rows, columns), key=mx.random.key(rows))
                got = build.quantized_product(x, packed, scales, held, bits)
                want = build.scalar_product(x, packed, scales, held, bits)
                assert mx.array_equal(got, want).item(), (build.path, columns, dtype, rows, held.size)


def test_builds_agree_with_each_other_across_a_threaded_product(build):
    """1030 x 288 weights are shared among the pool's threads: the same bits as the reference computed on one thread."""
    packed, scales, biases = _weights(4, (1030, 288), mx.float16, seed=3)
    x = mx.random.normal((3, 288), key=mx.random.key(4))
    reference = np.asarray(build.scalar_product(x, packed, scales, biases, 4))
    np.testing.assert_array_equal(np.asarray(build.quantized_product(x, packed, scales, biases, 4)), reference)
    if build is not quantized.load() and quantized.load() is not None:
        np.testing.assert_array_equal(
            np.asarray(quantized.load().quantized_product(x, packed, scales, biases, 4)), reference
        )


@pytest.mark.skipif(not (X86 and HAS["avx2"] and shutil.which("g++")), reason="needs g++ on an AVX2 CPU")
def test_the_standalone_check_passes_every_case_on_this_cpus_paths(tmp_path):
    """quantized_check.cpp (no MLX) over 1,296 cases per path: widths, scale types, zero points, shapes, rows."""
    targets = {"avx2": ["-march=x86-64-v3"], "avxvnni": ["-march=x86-64-v3", "-mavxvnni"], "avx512": ["-march=native"]}
    for isa in (isa for isa in targets if HAS[isa]):
        binary = tmp_path / f"check-{isa}"
        command = ["g++", "-O2", "-std=c++20", *targets[isa], "-ffp-contract=off", "quantized_check.cpp", "-o", str(binary)]  # fmt: skip
        subprocess.run(command, cwd=CPU_DIR, check=True, capture_output=True, timeout=300)
        run = subprocess.run([binary], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout
        assert run.stdout.strip().endswith("1296 of 1296 cases equal the reference bit for bit"), run.stdout
        assert run.stdout.startswith(f"{isa}:")


def test_a_named_instruction_set_the_compiler_cannot_target_is_refused():
    if kernels.load() is None:
        pytest.skip(f"no kernel toolchain here: {kernels.unavailable()}")
    with pytest.raises(kernels.BuildError):
        quantized.build("neon" if X86 else "avx2")


SHOW_KERNEL = "from akunu.backends.cpu import quantized; print(quantized.load(), quantized.unavailable())"


def test_an_unknown_instruction_set_is_one_line():
    run = subprocess.run(
        [sys.executable, "-c", SHOW_KERNEL],
        capture_output=True,
        text=True,
        env={**os.environ, quantized.ISA_SWITCH: "sse9"},
        timeout=300,
    )
    assert run.stdout.strip() == "None AKUNU_CPU_ISA=sse9 is not one of native, avx512, avxvnni, avx2, neon, scalar"
