"""`akunu bench kernel`: the product kernels timed by rows of x, on one layer's weights and one repetition."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from akunu.backends.cpu import quantized
from akunu.bench import kernel_rows
from tests.fakes import ANSI, invoke

needs_kernel = pytest.mark.skipif(quantized.load() is None, reason="akunu's quantized kernel is not built here")


@pytest.fixture(autouse=True)
def small_copy(monkeypatch):
    monkeypatch.setattr(kernel_rows, "COPY_MEGABYTES", 8)


def table_rows(output: str) -> list[list[str]]:
    return [
        cells
        for line in ANSI.sub("", output).splitlines()
        if len(cells := re.findall(r"│\s*([^│]+?)\s*(?=│)", line)) >= 5
    ]


@needs_kernel
def test_the_table_has_a_row_per_layout_and_row_count():
    result = invoke(
        "bench", "kernel", "--bits", "4", "--rows", "1,3", "--layers", "1", "--reps", "1", "--float32", "--mlx"
    )
    assert result.exit_code == 0, result.output
    rows = table_rows(result.output)
    assert [row[:2] for row in rows] == [["4-bit", "1"], ["4-bit", "3"], ["float32", "1"], ["float32", "3"]]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows)  # ms, GB/s
    assert rows[0][4] == rows[2][4] == "1.00" and float(rows[1][4]) > 0  # relative to one row
    assert rows[0][5] != "–" and rows[2][5] == "–"  # MLX's quantized_matmul: quantized weights only
    assert re.search(r"copy bandwidth \d+\.\d GB/s", result.output)


@needs_kernel
@pytest.mark.parametrize("rows, centered", [(2, True), (quantized.MAX_ROWS + 1, False)], ids=["kernel", "dequantized"])
def test_the_timed_product_is_x_times_w_transposed(rows, centered):
    """What is timed is the layer's product, by the kernel or (past its rows) dequantized: MLX's own result, but
    for the kernel's int8 rounding of x."""
    weights = kernel_rows.quantized_weights(5, 1, centered=centered)
    inputs, arrays = weights.products[0]
    x = mx.random.normal((rows, inputs), key=mx.random.key(1))
    ours, theirs = kernel_rows.akunu_product(x, arrays, 5), kernel_rows.mlx_product(x, arrays, 5)
    assert mx.abs(ours - theirs).max().item() < 0.02 * mx.abs(theirs).max().item()
    assert weights.name == ("5-bit centered" if centered else "5-bit") and (arrays[2].size == 0) == centered


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bits", "4,x"], "Invalid value for '--bits': '4,x' is not a comma-separated list of whole numbers"),
        (["--rows", "0"], "Invalid value for '--rows': '0': every number must be at least 1"),
        (["--bits", "7"], "7-bit weights: the kernel reads 2, 3, 4, 5, 6, 8 bits"),
        (["--bits", ""], "nothing to time: give --bits or --float32"),
    ],
)
def test_bad_options_are_one_line(args, message):
    result = invoke("bench", "kernel", *args)
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1


def test_without_the_quantized_kernel_it_says_why(monkeypatch):
    monkeypatch.setattr(quantized, "load", lambda: None)
    monkeypatch.setattr(quantized, "unavailable", lambda: "AKUNU_QUANTIZED_KERNEL=0")
    result = invoke("bench", "kernel")
    assert result.exit_code == 1
    assert result.output.strip() == "error: akunu's quantized kernel is unavailable here: AKUNU_QUANTIZED_KERNEL=0"
