"""--dtype auto on the CPU backend: chosen by timing the model's decode products, once per machine."""

import json

import mlx.core as mx
import pytest
from gguf import GGMLQuantizationType as Q

from akunu import backends
from akunu.models import dtype_measure, dtype_policy, load_model
from akunu.models.dtype_measure import Product
from akunu.models.dtype_policy import choose_dtype
from akunu.models.gguf_file import read_gguf
from akunu.models.gguf_weights import decode_products
from tests.tiny_gguf import FFN, HIDDEN, LAYERS, VOCAB, write_tiny_gguf

BIG = [Product(4096, 4096, 4, 24)]  # 1.5 GiB in float32: measured


@pytest.fixture
def cpu_with_kernel(monkeypatch, isolated_home):
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(backends, "quantized_kernel_available", lambda: True)
    return isolated_home


@pytest.fixture
def timings(monkeypatch):
    """Injected seconds per step; `timings.calls` counts the measurements made."""

    class Timings:
        seconds = {"float32": 1.0, "quantized": 1.0}
        calls = 0

    def fake(products):
        Timings.calls += 1
        return dict(Timings.seconds)

    monkeypatch.setattr(dtype_measure, "seconds_per_step", fake)
    monkeypatch.setattr(dtype_measure.cached_seconds, "__defaults__", (fake,))
    monkeypatch.setattr(dtype_measure, "machine_busy", lambda: False)
    return Timings


@pytest.mark.parametrize("faster", ["float32", "quantized"])
def test_auto_picks_the_form_measured_faster_and_says_so(cpu_with_kernel, timings, faster):
    slower = "quantized" if faster == "float32" else "float32"
    timings.seconds = {faster: 0.01, slower: 0.025}
    choice = choose_dtype("auto", products=BIG)
    assert choice.dtype == faster
    assert "2.5x faster than " + slower in choice.reason and "measured now" in choice.reason


def test_the_measurement_is_kept_per_machine_and_backend_revision(cpu_with_kernel, timings, monkeypatch):
    timings.seconds = {"float32": 0.03, "quantized": 0.01}
    assert choose_dtype("auto", products=BIG).dtype == "quantized"
    timings.seconds = {"float32": 0.01, "quantized": 0.03}  # a second timing would flip it: the cache must not
    again = choose_dtype("auto", products=BIG)
    assert (again.dtype, timings.calls) == ("quantized", 1) and "measured before" in again.reason
    assert json.loads(dtype_measure.cache_path().read_text())  # under the isolated AKUNU_HOME
    other_shapes = [Product(4096, 4096, 8, 24)]
    assert choose_dtype("auto", products=other_shapes).dtype == "float32" and timings.calls == 2
    monkeypatch.setattr(backends, "revision", lambda: "cpu-a-new-kernel")
    assert choose_dtype("auto", products=BIG).dtype == "float32" and timings.calls == 3


def test_a_measurement_on_a_busy_machine_is_used_but_not_kept(cpu_with_kernel, timings, monkeypatch):
    timings.seconds = {"float32": 0.03, "quantized": 0.01, "spread": 0.6}
    choice = choose_dtype("auto", products=BIG)
    assert choice.dtype == "quantized" and "not kept" in choice.reason
    monkeypatch.setattr(dtype_measure, "machine_busy", lambda: True)  # other work running: not kept either
    timings.seconds = {"float32": 0.03, "quantized": 0.01, "spread": 0.0}
    assert "not kept" in choose_dtype("auto", products=BIG).reason and timings.calls == 2
    monkeypatch.setattr(dtype_measure, "machine_busy", lambda: False)
    timings.seconds = {"float32": 0.01, "quantized": 0.03, "spread": 0.1}
    assert choose_dtype("auto", products=BIG).dtype == "float32" and timings.calls == 3
    assert choose_dtype("auto", products=BIG).dtype == "float32" and timings.calls == 3


def test_a_corrupt_record_is_measured_again(cpu_with_kernel, timings):
    dtype_measure.cache_path().parent.mkdir(parents=True)
    dtype_measure.cache_path().write_text("[not json")
    timings.seconds = {"float32": 0.03, "quantized": 0.01}
    assert choose_dtype("auto", products=BIG).dtype == "quantized" and timings.calls == 1
    key = dtype_measure.cache_key(BIG)
    dtype_measure.cache_path().write_text(json.dumps({key: {"float32": 0, "quantized": "fast"}}))
    assert choose_dtype("auto", products=BIG).dtype == "quantized" and timings.calls == 2


def test_forced_metal_and_tiny_models_are_not_measured(cpu_with_kernel, timings, monkeypatch):
    timings.seconds = {"float32": 0.01, "quantized": 0.03}
    assert choose_dtype("quantized", products=BIG).reason == "requested"
    assert choose_dtype("auto", products=[Product(64, 64, 4, 2)]).dtype == "quantized"  # cache-sized
    monkeypatch.setattr(backends, "quantized_kernel_available", lambda: False)
    assert choose_dtype("auto", products=BIG).reason.startswith("CPU backend with")
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert choose_dtype("auto", products=BIG).reason.startswith("Metal")
    assert timings.calls == 0


def test_a_real_measurement_times_both_forms(cpu_with_kernel, monkeypatch):
    monkeypatch.setattr(dtype_measure, "WORKING_SET", 1)  # one copy of each product: quick
    seconds = dtype_measure.seconds_per_step([Product(256, 512, 4, 3), Product(128, 512, None, 1)])
    assert set(seconds) == {"float32", "quantized", "spread"}
    assert 0 < seconds["float32"] < 1 and 0 < seconds["quantized"] < 1 and seconds["spread"] >= 0


def test_decode_products_are_the_gguf_matrices_at_their_held_widths(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, matrix_type=Q.Q4_0, embedding_type=Q.Q8_0, tie=True)
    products = decode_products(read_gguf(path))
    head = [p for p in products if p.rows == VOCAB]
    assert head == [Product(VOCAB, HIDDEN, 8, 1)]  # tied: the embedding is the output product
    assert {p.bits for p in products if p.rows != VOCAB} == {4}
    assert sum(p.count for p in products if (p.rows, p.cols) == (HIDDEN, FFN)) == LAYERS  # ffn_down per layer
    write_tiny_gguf(path, matrix_type=Q.Q8_0, embedding_type=Q.Q8_0, tie=False)
    products = decode_products(read_gguf(path))
    assert [p.rows for p in products].count(VOCAB) == 1  # the output only; the embedding is looked up


def test_load_model_follows_the_measurement(cpu_with_kernel, timings, monkeypatch, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, matrix_type=Q.Q8_0)
    monkeypatch.setattr(dtype_policy, "MIN_MEASURED_BYTES", 0)
    timings.seconds = {"float32": 0.01, "quantized": 0.02}
    loaded = load_model(str(path))
    assert loaded.dtype == "float32" and loaded.dtype_reason.startswith("auto:")
    assert load_model(str(path), dtype="quantized").dtype == "quantized" and timings.calls == 1
