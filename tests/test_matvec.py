"""akunu's cblas_sgemm router (akunu/backends/cpu/_matvec.c): every product it takes is right, and it is in use.

MLX calls cblas_sgemm for every float32 matmul on the CPU, so these drive it through MLX with
the shapes and layouts MLX produces: Linear layers (x @ W.T), transposed and strided operands,
batched attention products, single rows and single columns.
"""

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from akunu.backends.cpu import blas

linux_with_openblas = pytest.mark.skipif(
    sys.platform != "linux" or blas.loaded_path is None, reason="the router sits in front of OpenBLAS on Linux"
)


def reference(a: mx.array, b: mx.array) -> np.ndarray:
    return np.matmul(np.array(a, dtype=np.float64), np.array(b, dtype=np.float64))


@linux_with_openblas
def test_the_router_is_built_and_loaded_where_a_compiler_exists():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: the package installs without the router")
    assert blas.matvec_path is not None, (
        "akunu/backends/cpu/_matvec.c was not built or not loaded (pip install -e . builds it)"
    )
    assert "decode matmuls" in blas.describe()


@linux_with_openblas
def test_importing_akunu_after_mlx_warns_that_the_fast_blas_was_missed():
    def run(code: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "AKUNU_BLAS"}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    late = run("import mlx.core, akunu.backends.cpu.blas as blas; assert blas.loaded_path is None")
    assert late.returncode == 0 and "imported after mlx.core" in late.stderr and "40x slower" in late.stderr
    in_order = run(
        "import warnings; warnings.simplefilter('error'); import akunu, mlx.core, akunu.backends.cpu.blas as blas; assert blas.loaded_path"
    )
    assert in_order.returncode == 0 and "imported after" not in in_order.stderr, in_order.stderr


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 40, 129])
@pytest.mark.parametrize("inner", [64, 576, 100])  # 100: not a multiple of 16, so OpenBLAS's path
@pytest.mark.parametrize("a_transposed", [False, True])
@pytest.mark.parametrize("b_transposed", [False, True])
def test_every_layout_and_row_count_matches_a_float64_reference(rows, inner, a_transposed, b_transposed):
    mx.random.seed(rows * 1000 + inner)
    cols = 298 + rows % 4  # 298-301: W's last tile holds 1-4 rows (the tile before fetches that many)
    a = mx.random.normal((inner, rows)).T if a_transposed else mx.random.normal((rows, inner))
    b = mx.random.normal((cols, inner)).T if b_transposed else mx.random.normal((inner, cols))
    np.testing.assert_allclose(np.array(a @ b), reference(a, b), rtol=0, atol=1e-4 * inner**0.5)
    column = b[:, :1]  # one output column: the sgemv path
    np.testing.assert_allclose(np.array(a @ column), reference(a, column), rtol=0, atol=1e-4 * inner**0.5)


def test_batched_and_strided_operands_as_attention_makes_them():
    mx.random.seed(3)
    q = mx.random.normal((1, 9, 3, 64))
    keys = mx.random.normal((1, 9, 40, 64 * 2))[..., ::2]  # a strided view
    values = mx.random.normal((1, 9, 40, 64))
    scores = q @ keys.swapaxes(-1, -2)
    out = mx.softmax(scores, axis=-1) @ values
    ref_scores = np.einsum("bhqd,bhkd->bhqk", np.array(q, np.float64), np.array(keys, np.float64))
    np.testing.assert_allclose(np.array(scores), ref_scores, atol=1e-4)
    ref_weights = np.exp(ref_scores - ref_scores.max(-1, keepdims=True))
    ref_weights /= ref_weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.array(out), ref_weights @ np.array(values, np.float64), atol=1e-4)


@linux_with_openblas
@pytest.mark.parametrize("layout", ["x @ W.T (Linear)", "w @ V (attention)"])
def test_a_rows_result_does_not_depend_on_how_many_rows_share_its_pass(layout):
    """What the kernels guarantee for up to 128 rows (a verification pass's rows times its attention
    heads): a row is bit-identical alone or batched, whichever register tile it lands in."""
    if blas.matvec_path is None:
        pytest.skip("the router is not built here")
    mx.random.seed(5)
    matrix = mx.random.normal((1536, 576)).T if layout.startswith("x") else mx.random.normal((576, 100))
    rows = mx.random.normal((128, 576))
    alone = mx.concatenate([rows[i : i + 1] @ matrix for i in range(128)])
    for width in [*range(2, 10), 16, 33, 63, 128]:
        together = rows[:width] @ matrix
        assert mx.array_equal(together, alone[:width]).item(), f"{width} rows"


@linux_with_openblas
def test_a_rows_result_does_not_depend_on_where_its_array_starts():
    """The kernel copies rows of x that do not start on a 64-byte line (MLX's seldom do) before using
    them: the same numbers in the same order, so the bits cannot depend on the address."""
    if blas.matvec_path is None:
        pytest.skip("the router is not built here")
    mx.random.seed(7)
    matrix, flat = mx.random.normal((1536, 576)).T, mx.random.normal((17 * 576 + 16,))
    for shift in range(16):  # every offset within a 64-byte line: one of them starts on a line, unlike `fresh`
        rows = flat[shift : shift + 17 * 576].reshape(17, 576)
        fresh = mx.array(np.array(rows))
        for width in (1, 2, 5, 17):
            assert mx.array_equal(rows[:width] @ matrix, fresh[:width] @ matrix).item(), f"shift {shift}, {width} rows"


@linux_with_openblas
def test_addmm_adds_the_residual_with_a_separate_add_s_bits():
    """The fused layers add the residual in the product (addmm, beta = 1): the kernels' sum plus what the
    output held, rounded once, so the same bits as the product then an add, and still row-independent."""
    if blas.matvec_path is None:
        pytest.skip("the router is not built here")
    mx.random.seed(6)
    matrix = mx.random.normal((1536, 576)).T
    rows, residual = mx.random.normal((33, 576)), mx.random.normal((33, 1536))
    for width in (1, 2, 5, 16, 33):
        fused = mx.addmm(residual[:width], rows[:width], matrix)
        assert mx.array_equal(fused, residual[:width] + rows[:width] @ matrix).item(), f"{width} rows"
        assert mx.array_equal(fused, mx.addmm(residual, rows, matrix)[:width]).item(), f"{width} rows"


def test_output_buffers_holding_nans_do_not_leak_into_results():
    """sgemv with beta = 0 may scale what the output held; MLX's fresh buffers can hold anything."""
    for _ in range(20):
        garbage = mx.full((4096,), float("nan"))
        mx.eval(garbage)
        del garbage  # its memory goes back to MLX's allocator for the next output to reuse
        x, w = mx.ones((1, 64)), mx.ones((4096, 64))
        assert mx.all(x @ w.T == 64).item()
        assert mx.all(w @ x.T == 64).item()
