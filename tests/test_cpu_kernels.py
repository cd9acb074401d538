"""akunu's fused CPU kernels (akunu/backends/cpu/kernels.cpp): right against MLX's ops, a row's bits
independent of the rows computed with it, in use where they can be built, and skipped cleanly where not."""

import platform
import re
import shutil
import sys

import mlx.core as mx
import numpy as np
import pytest

from akunu.backends.cpu import kernels as cpu_kernels

BUILDABLE = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64") and shutil.which("g++")


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels.load()
    if module is None and not BUILDABLE:
        pytest.skip(f"no fused kernels here: {cpu_kernels.unavailable()}")
    assert module is not None, f"the fused kernels should build on this machine: {cpu_kernels.unavailable()}"
    return module


def _attention_inputs(L, S, heads=6, kv_heads=2, dims=32, seed=0):
    q = mx.random.normal((1, heads, L, dims), key=mx.random.key(seed))
    k = mx.random.normal((1, kv_heads, S, dims), key=mx.random.key(seed + 1))
    v = mx.random.normal((1, kv_heads, S, dims), key=mx.random.key(seed + 2))
    return q, k, v


@pytest.mark.parametrize("L, S", [(1, 1), (1, 37), (5, 5), (5, 70), (17, 300), (33, 33), (1, 700), (9, 1100)])
def test_attention_matches_mlx(kernels, L, S):
    q, k, v = _attention_inputs(L, S)
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=causal)
    assert mx.allclose(kernels.attention(q, k, v, 0.2, True), expected, rtol=1e-5, atol=1e-6).item()
    unmasked = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2)
    assert mx.allclose(kernels.attention(q, k, v, 0.2, False), unmasked, rtol=1e-5, atol=1e-6).item()


def test_attention_reads_strided_caches_and_queries(kernels):
    """Keys and values are slices of a preallocated cache, queries a transposed view."""
    _, k, v = _attention_inputs(4, 40)
    q_view = mx.random.normal((1, 4, 6, 32), key=mx.random.key(9)).transpose(0, 2, 1, 3)  # (B, H, L, D), strided
    q = q_view * 1.0  # the same values, contiguous
    buffer_k, buffer_v = mx.pad(k, [(0, 0), (0, 0), (0, 24), (0, 0)]), mx.pad(v, [(0, 0), (0, 0), (0, 24), (0, 0)])
    k_cols = mx.stack([k, -k], axis=-1).reshape(1, 2, 40, 64)[..., ::2]  # k again, strided along the head dimension
    got = kernels.attention(q_view, buffer_k[:, :, :40], buffer_v[:, :, :40], 0.3, True)
    assert mx.array_equal(got, kernels.attention(q, k, v, 0.3, True)).item()
    assert mx.array_equal(kernels.attention(q, k_cols, v, 0.3, True), kernels.attention(q, k, v, 0.3, True)).item()


@pytest.mark.parametrize("S", [20, 265, 300, 700])
def test_attention_row_is_independent_of_the_pass(kernels, S):
    """Row j of a causal pass is bit for bit a 1-row call over the keys it may see: a verification
    pass gives a position exactly what a plain step gives it."""
    L = 17
    q, k, v = _attention_inputs(L, S, seed=3)
    wide = kernels.attention(q, k, v, 0.125, True)
    for j in range(L):
        end = S - L + j + 1
        alone = kernels.attention(q[:, :, j : j + 1], k[:, :, :end], v[:, :, :end], 0.125, False)
        assert mx.array_equal(wide[:, :, j : j + 1], alone).item(), j


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("S", [16, 41, 529])
def test_grouped_rows_of_a_wide_pass_have_the_bits_of_each_row_alone(kernels, dtype, S):
    """Seven query heads per KV head and 16 positions share each block of keys and values (a float16 cache's widened
    once for all of them): each row still gets the bits it gets alone, causal or not."""
    L = 16
    q = mx.random.normal((1, 14, L, 64), key=mx.random.key(11))
    k, v = (mx.random.normal((1, 2, S + 5, 64), key=mx.random.key(12 + i)).astype(dtype) for i in range(2))
    wide = kernels.attention(q, k, v, 0.125, True, S)
    unmasked = kernels.attention(q, k, v, 0.125, False, S)
    for j in range(L):
        end = S - L + j + 1
        alone = kernels.attention(q[:, :, j : j + 1], k, v, 0.125, True, end)
        assert mx.array_equal(wide[:, :, j : j + 1], alone).item(), j
        for head in (0, 6, 13):
            kv = slice(head // 7, head // 7 + 1)
            single = kernels.attention(q[:, head : head + 1, j : j + 1], k[:, kv], v[:, kv], 0.125, False, S)
            assert mx.array_equal(unmasked[:, head : head + 1, j : j + 1], single).item(), (j, head)


def test_attention_reads_a_cache_buffer_up_to_its_fill_into_projection_rows(kernels):
    """The fused attention layer hands the kernel the cache's whole buffers and how far they are filled, and
    takes (B * L, H * Dv) rows for the output projection: the same bits as slicing, then transposing."""
    L, S = 5, 70
    q, k, v = _attention_inputs(L, S, seed=4)
    stale = mx.random.normal((1, 2, 30, 32), key=mx.random.key(8)) * 50  # what a rolled-back pass left behind
    buffer_k, buffer_v = mx.concatenate([k, stale], axis=2), mx.concatenate([v, -stale], axis=2)
    expected = kernels.attention(q, k, v, 0.2, True)
    assert mx.array_equal(kernels.attention(q, buffer_k, buffer_v, 0.2, True, keys=S), expected).item()
    rows = kernels.attention(q, buffer_k, buffer_v, 0.2, True, keys=S, rows=True)
    assert rows.shape == (L, 6 * 32)
    assert mx.array_equal(rows, expected.transpose(0, 2, 1, 3).reshape(L, -1)).item()
    with pytest.raises(ValueError, match="keys <= S"):
        kernels.attention(q, k, v, 0.2, True, keys=S + 1)
    with pytest.raises(ValueError, match="L <= keys"):
        kernels.attention(q, k, v, 0.2, True, keys=L - 1)


@pytest.mark.parametrize("rows, n", [(7, 100), (1, 4864), (3, 2049)])  # the wide ones run in chunks on the pool
def test_swiglu_of_a_whole_gate_up_product_is_swiglu_of_its_halves(kernels, rows, n):
    product = mx.random.normal((rows, 2 * n), key=mx.random.key(6)) * 6
    gate, up = mx.split(product, 2, axis=-1)
    assert mx.array_equal(kernels.swiglu_halves(product), kernels.swiglu(gate, up)).item()
    assert mx.array_equal(kernels.swiglu_halves(product[::-1]), kernels.swiglu(gate, up)[::-1]).item()  # strided rows
    with pytest.raises(ValueError, match="2n"):
        kernels.swiglu_halves(product[:, :199])


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "values",
    [
        [1, NAN, 3],
        [NAN, 1, 3],
        [3, 1, NAN],
        [NAN, NAN],
        [1, 3, 3],
        [-INF, -INF],
        [INF, NAN, INF],
        [-0.0, 0.0],
        [0.0, -0.0],
        [2],
    ],
)
def test_argmax_picks_what_mlx_picks_among_ties_nans_and_infinities(kernels, values):
    x = mx.array(values, mx.float32)
    assert kernels.argmax(x).item() == mx.argmax(x).item()
    assert kernels.argmax(x).dtype == mx.uint32


@pytest.mark.parametrize("shape", [(1, 151936), (9, 49152), (3, 17), (2, 70001), (5, 32768)])
def test_argmax_of_long_rows_in_chunks_on_both_threads_is_mlxs(kernels, shape):
    x = mx.round(mx.random.normal(shape, key=mx.random.key(shape[1])) * 3)  # many ties, across chunks too
    assert mx.array_equal(kernels.argmax(x), mx.argmax(x, axis=-1).astype(mx.uint32)).item()
    strided = mx.random.normal(shape[::-1], key=mx.random.key(1)).T
    assert mx.array_equal(kernels.argmax(strided), mx.argmax(strided, axis=-1).astype(mx.uint32)).item()
    assert (np.asarray(kernels.argmax(mx.zeros(shape))) == 0).all()  # a tie in every chunk: the first chunk's
    late_nan = mx.concatenate([x[:, :-1], mx.full((shape[0], 1), NAN)], axis=1)  # in the last chunk
    assert (np.asarray(kernels.argmax(late_nan)) == shape[1] - 1).all()
    with pytest.raises(ValueError, match="float32"):
        kernels.argmax(x.astype(mx.float16))


@pytest.mark.parametrize("shape", [(1, 151936), (5, 49152), (3, 17)])
@pytest.mark.parametrize("k", [1, 8])
def test_top_k_is_the_stable_sorts_first_k_among_ties_and_nans(kernels, shape, k):
    x = mx.round(mx.random.normal(shape, key=mx.random.key(shape[1])) * 3)  # many ties
    x = mx.where(mx.random.uniform(shape=shape, key=mx.random.key(3)) < 0.01, NAN, x)  # NaNs are never chosen
    values = np.nan_to_num(np.asarray(x), nan=-np.inf)
    expected = np.argsort(-values, axis=-1, kind="stable")[:, :k]
    got = kernels.top_k(x, k)
    assert got.dtype == mx.int32 and (np.asarray(got) == expected).all()
    strided = mx.random.normal(shape[::-1], key=mx.random.key(1)).T
    assert (
        np.asarray(kernels.top_k(strided, k)) == np.argsort(-np.asarray(strided), axis=-1, kind="stable")[:, :k]
    ).all()
    with pytest.raises(ValueError, match="top_k"):
        kernels.top_k(x, shape[1] + 1)


def test_the_backends_argmax_is_mlxs_for_every_dtype():
    from akunu import backends

    x = mx.round(mx.random.normal((4, 3000), key=mx.random.key(2)) * 2)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        assert mx.array_equal(backends.argmax(x.astype(dtype)), mx.argmax(x.astype(dtype), axis=-1)).item()
        assert backends.argmax(x.astype(dtype)).dtype == mx.uint32


def test_swiglu_matches_and_is_elementwise(kernels):
    stacked = mx.random.normal((1, 9, 2 * 100), key=mx.random.key(5)) * 6
    gate, x = mx.split(stacked, 2, axis=-1)  # views into the gate|up product, as the fused MLP passes them
    ours = kernels.swiglu(gate, x)
    assert mx.allclose(ours, gate * mx.sigmoid(gate) * x, rtol=1e-6, atol=1e-6).item()
    assert mx.array_equal(kernels.swiglu(gate[:, :3], x[:, :3]), ours[:, :3]).item()
    huge = mx.array([[-200.0, -90.0, 0.0, 90.0, 200.0]])
    assert mx.allclose(kernels.swiglu(huge, mx.ones_like(huge)), mx.array([[0.0, 0.0, 0.0, 90.0, 200.0]])).item()


def test_rms_norm_matches_and_is_per_row(kernels):
    x, weight = mx.random.normal((2, 7, 96), key=mx.random.key(6)), mx.random.normal((96,), key=mx.random.key(7))
    ours = kernels.rms_norm(x, weight, 1e-5)
    assert mx.allclose(ours, mx.fast.rms_norm(x, weight, 1e-5), rtol=1e-6, atol=1e-6).item()
    assert mx.array_equal(kernels.rms_norm(x[:, 2:3], weight, 1e-5), ours[:, 2:3]).item()


def test_bad_inputs_are_refused_when_the_graph_is_built(kernels):
    q, k, v = _attention_inputs(2, 8)
    with pytest.raises(ValueError, match="float32"):
        kernels.attention(q.astype(mx.float16), k, v, 0.1, True)
    with pytest.raises(ValueError, match="multiples of 16"):
        kernels.attention(q[..., :24], k[..., :24], v[..., :24], 0.1, True)
    with pytest.raises(ValueError, match="one shape"):
        kernels.swiglu(q, k)


def test_a_fresh_cache_builds_and_a_missing_compiler_falls_back(kernels, tmp_path, monkeypatch):
    """What a new machine does on first use: build into the cache, then load from it; without a
    compiler, no kernels and a reason."""
    monkeypatch.setenv("AKUNU_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
        assert len(list((tmp_path / "cache").glob("*/akunu_cpu_kernels*"))) == 1
        monkeypatch.setenv("AKUNU_KERNEL_CACHE", str(tmp_path / "empty"))
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is None
        assert "building kernels.cpp failed" in cpu_kernels.unavailable()
        assert "no-such-compiler" in cpu_kernels.unavailable()  # the reason names what went wrong
        monkeypatch.setenv("AKUNU_KERNELS", "0")
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is None and cpu_kernels.unavailable() == "AKUNU_KERNELS=0"
    finally:
        monkeypatch.undo()
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is not None and cpu_kernels.unavailable() is None


def test_the_fast_step_runs_the_kernels(kernels):
    """A decode step of a tiny llama goes through them, as one layer-stack node: the graph holds akunu's primitives."""
    from akunu.backends.cpu import compiled_pass, fast_step
    from akunu.kv_cache import make_cache
    from tests.tiny import tiny_llama

    model = tiny_llama(hidden=64, seed=2)  # heads of 16 dimensions, as the kernel requires
    fast_step.enable(model)
    cache = make_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache), [c.state for c in cache])
    with compiled_pass.unqueued():
        out = model(mx.array([[4]]), cache=cache)
    dot = _graph_text(out)  # the step's graph alone
    # Every layer in one node, writing keys and values into the cache's buffers itself: no slices or cache
    # updates, and no reshapes or transposes but the pass's own.
    nodes = re.findall(r'label ="(\w+)"', dot)
    assert nodes.count("AkunuLayerStack") == 1 and nodes.count("AkunuRMSNorm") == 1, nodes
    assert nodes.count("Slice") == nodes.count("SliceUpdate") == nodes.count("Add") == 0, nodes
    assert len(nodes) <= 10, nodes  # the embedding, final norm and an untied output head


def test_exact_mode_keeps_one_kernel_call_per_layer(kernels):
    """Exact mode's dispatcher wraps the module's attention; the layers still hand the kernel the whole pass
    and the cache's buffers (it computes each row alone: the bits of exact mode's per-row calls), and the
    default mode keeps that path once the dispatcher is installed."""
    from akunu.backends.cpu import compiled_pass, fast_step
    from akunu.exact import exact_model
    from akunu.kv_cache import make_cache
    from tests.tiny import tiny_llama

    model = tiny_llama(hidden=64, seed=2)
    fast_step.enable(model)
    exact, cache = exact_model(model, 3), make_cache(model)
    mx.eval(exact(mx.array([[1, 2, 3, 4, 5]]), cache=cache), [c.state for c in cache])
    for run in (exact, model):
        with compiled_pass.unqueued():
            out = run(mx.array([[6]]), cache=cache)
        nodes = re.findall(r'label ="(Akunu(?:Attention\w*|LayerStack))"', _graph_text(out))
        assert nodes == ["AkunuLayerStack"], nodes  # per-row calls would be attention nodes, 4 a layer
        mx.eval(out, [c.state for c in cache])  # so the next graph holds its own pass alone


def _graph_text(out: mx.array) -> str:
    import io

    buffer = io.StringIO()
    mx.export_to_dot(buffer, out)
    return buffer.getvalue()


@pytest.mark.parametrize("width", [2, 5, 17])
def test_default_mode_passes_give_each_position_a_step_s_bits(kernels, width):
    """With the decode matmuls and these kernels every op of a pass is row-independent, so on the CPU
    a verification pass's logits equal 1-token steps' bit for bit without exact mode's padding."""
    from akunu.backends.cpu import blas, fast_step
    from akunu.kv_cache import make_cache, rewind
    from tests.tiny import tiny_llama

    if not blas.matvec_path:
        pytest.skip("needs akunu's decode matmuls (akunu/backends/cpu/_matvec.c)")
    model = tiny_llama(hidden=64, seed=1)
    fast_step.enable(model)
    cache = make_cache(model)
    model(mx.array([list(range(1, 40))]), cache=cache)
    tokens = [(7 * i + 3) % 64 for i in range(width)]
    wide = model(mx.array([tokens]), cache=cache)[0]
    rewind(cache, width)
    steps = mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in tokens])
    assert mx.array_equal(wide, steps).item()


def _layer_weights(D, H, KV, hd, inter, seed=9):
    """A norm weight and a llama layer's stacked products, transposed as the fused layers hold them."""
    keys = iter(mx.random.split(mx.random.key(seed), 5))
    norm = 1 + 0.1 * mx.random.normal((D,), key=next(keys))
    wqkv, wo = (mx.random.normal(shape, key=next(keys)) / 8 for shape in (((H + 2 * KV) * hd, D), (D, H * hd)))
    wgu, wdown = (mx.random.normal(shape, key=next(keys)) / 8 for shape in ((2 * inter, D), (D, inter)))
    return norm, wqkv.T, wo.T, wgu.T, wdown.T


@pytest.mark.parametrize("stored", [mx.float32, mx.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("batch, length, offset", [(1, 1, 0), (1, 5, 17), (2, 17, 230)])
def test_a_layer_s_halves_give_the_bits_of_the_nodes_they_replace(kernels, traditional, batch, length, offset, stored):
    """A compiled pass's two nodes a layer: the eager fused path's norm, products, split, attention, SwiGLU and
    residual adds, bit for bit. The attention half writes the pass's keys and values into the cache buffers in
    place at the offset (nothing else in them changes; into float16 buffers as astype rounds them), its tables read
    from the offset's row."""
    from akunu.backends.cpu import rope as cpu_rope

    D, H, KV, hd, S, inter = 64, 6, 2, 16, 256, 96
    norm, wqkv, wo, wgu, wdown = _layer_weights(D, H, KV, hd, inter)
    x = mx.random.normal((batch * length, D), key=mx.random.key(3))
    keys, values = (mx.random.normal((batch, KV, S, hd), key=mx.random.key(i)).astype(stored) for i in (1, 2))
    before = [mx.array(np.array(a)) for a in (keys, values)]  # copies: the kernel writes the buffers themselves
    tables = cpu_rope.head_tables(S, 0, hd, 1e4, 1.0, traditional, mx.float32)  # rows for every position
    position = mx.array([offset], mx.int32)
    half = kernels.attention_half(
        x, norm, 1e-5, wqkv, wo, *tables, keys, values, position, batch, H, KV, traditional, 0.3
    )
    mx.eval(half)

    pass_tables = cpu_rope.head_tables(length, offset, hd, 1e4, 1.0, traditional, mx.float32)
    q, k, v = kernels.split_heads(kernels.rms_norm(x, norm, 1e-5) @ wqkv, *pass_tables, batch, H, KV, traditional)
    for buffer, old, written in ((keys, before[0], k), (values, before[1], v)):
        assert mx.array_equal(buffer[:, :, offset : offset + length], written.astype(stored)).item()
        assert mx.array_equal(buffer[:, :, :offset], old[:, :, :offset]).item()
        assert mx.array_equal(buffer[:, :, offset + length :], old[:, :, offset + length :]).item()
    attended = kernels.attention(q, keys, values, 0.3, True, offset + length, True)
    assert mx.array_equal(half, mx.addmm(x, attended, wo)).item()

    # weights as the fused layers hold them (transposed views), plain row-major, and a strided view MLX copies first
    strided = mx.concatenate([wgu, wgu], axis=0)[::2]
    mx.eval(strided)
    for gate_up in (wgu, mx.contiguous(wgu), strided):
        mlp = kernels.mlp_half(x, norm, 1e-5, gate_up, wdown)
        expected = mx.addmm(x, kernels.swiglu_halves(kernels.rms_norm(x, norm, 1e-5) @ gate_up), wdown)
        assert mx.array_equal(mlp, expected).item()


def test_an_attention_half_past_the_buffers_writes_nothing(kernels):
    """An offset past the buffers' room (never passed: compiled_pass.has_room checks first) gives NaN rows and
    leaves the buffers alone, rather than writing past them; bad shapes are refused when the node is built."""
    norm, wqkv, wo, _, _ = _layer_weights(32, 2, 1, 16, 32)
    x, tables = mx.random.normal((2, 32)), (mx.ones((8, 16)), mx.zeros((8, 16)))
    keys, values = mx.zeros((1, 1, 8, 16)), mx.zeros((1, 1, 8, 16))
    out = kernels.attention_half(
        x, norm, 1e-5, wqkv, wo, *tables, keys, values, mx.array([7], mx.int32), 1, 2, 1, False, 0.3
    )
    assert mx.isnan(out).all().item() and not keys.any().item() and not values.any().item()
    with pytest.raises(ValueError, match="offset must be one int32"):
        kernels.attention_half(x, norm, 1e-5, wqkv, wo, *tables, keys, values, mx.array([0.0]), 1, 2, 1, False, 0.3)
    with pytest.raises(ValueError, match="q\\|k\\|v weight"):
        kernels.attention_half(
            x, norm, 1e-5, wqkv[:16], wo, *tables, keys, values, mx.array([0], mx.int32), 1, 2, 1, False, 0.3
        )


def _quantized_operand(w: mx.array, widths: tuple[int, ...], bias: mx.array | None = None, centered: int = -1):
    """w (outs, ins) cut along its outputs into parts quantized at `widths`, float16 scales as GGUF's, part
    `centered` with its zero point at mid-range and no biases (as Q8_0's reach the kernel): the arrays a layer
    half takes, its bit widths, and the same product as separate nodes (the eager fused path's)."""
    from akunu.backends.cpu import quantized

    arrays, bits, pieces = [], list(widths), []
    for part, (rows, width) in enumerate(zip(np.array_split(np.arange(w.shape[0]), len(widths)), widths)):
        packed, scales, biases = mx.quantize(w[int(rows[0]) : int(rows[-1]) + 1].astype(mx.float16), 32, width)
        if part == centered:
            biases = quantized.kernel_biases(scales, scales * -(2 ** (width - 1)), width)
        arrays += [packed, scales, biases]
        pieces.append((packed, scales, biases, width))

    def nodes(x):
        out = mx.concatenate([quantized.load().quantized_product(x, *piece) for piece in pieces], axis=1)
        return out if bias is None else out + bias

    return arrays + ([bias] if bias is not None else []), bits, nodes


@pytest.mark.parametrize("batch, length, offset", [(1, 1, 0), (1, 5, 17), (2, 17, 230)])
def test_quantized_layer_halves_give_the_bits_of_the_nodes_they_replace(kernels, batch, length, offset):
    """Quantized products (parts at two widths, with and without a bias, one centered) inside the two nodes of a
    layer: the bits of the eager path's products, bias and residual adds around akunu's attention and SwiGLU nodes."""
    from akunu.backends.cpu import quantized
    from akunu.backends.cpu import rope as cpu_rope

    if quantized.load() is None:
        pytest.skip(f"no quantized kernel here: {quantized.unavailable()}")
    D, H, KV, hd, S, inter = 64, 6, 2, 16, 256, 96
    norm, wqkv, wo, wgu, wdown = _layer_weights(D, H, KV, hd, inter)
    qkv_bias = mx.random.normal(((H + 2 * KV) * hd,), key=mx.random.key(5)) / 4
    qkv, qkv_bits, qkv_nodes = _quantized_operand(wqkv.T, (4, 8), qkv_bias)
    o, o_bits, o_nodes = _quantized_operand(wo.T, (5,), mx.random.normal((D,), key=mx.random.key(6)))
    gate_up, gate_up_bits, gate_up_nodes = _quantized_operand(wgu.T, (4,))
    down, down_bits, down_nodes = _quantized_operand(wdown.T, (8, 6), centered=0)
    x = mx.random.normal((batch * length, D), key=mx.random.key(3))
    keys, values = (mx.random.normal((batch, KV, S, hd), key=mx.random.key(i)) for i in (1, 2))
    expected_keys, expected_values = (mx.array(np.array(a)) for a in (keys, values))  # the nodes write these
    tables = cpu_rope.head_tables(S, 0, hd, 1e4, 1.0, False, mx.float32)
    position = mx.array([offset], mx.int32)
    shape = (batch, H, KV, False, 0.3)

    half = kernels.attention_half_quantized(
        x, norm, 1e-5, qkv, qkv_bits, o, o_bits, *tables, keys, values, position, *shape
    )
    mx.eval(half)
    normed = kernels.rms_norm(x, norm, 1e-5)
    attended = kernels.attention_rows(qkv_nodes(normed), *tables, expected_keys, expected_values, position, *shape)
    assert mx.array_equal(half, x + o_nodes(attended)).item()
    assert mx.array_equal(keys, expected_keys).item() and mx.array_equal(values, expected_values).item()

    mlp = kernels.mlp_half_quantized(x, norm, 1e-5, gate_up, gate_up_bits, down, down_bits)
    expected = x + down_nodes(kernels.swiglu_halves(gate_up_nodes(normed)))
    assert mx.array_equal(mlp, expected).item()

    with pytest.raises(ValueError, match="packed, scales, biases"):
        kernels.mlp_half_quantized(x, norm, 1e-5, gate_up[:2], gate_up_bits, down, down_bits)
    with pytest.raises(ValueError, match="groups of 32"):
        kernels.mlp_half_quantized(x, norm, 1e-5, gate_up, [8], down, down_bits)


@pytest.mark.parametrize("quantized_layers", [False, True])
def test_a_layer_stack_gives_the_bits_of_its_halves_as_nodes(kernels, quantized_layers):
    """Two layers as one layer_stack node (halves made once, weights held): the bits and cache writes of the four
    half nodes it replaces, float32 or quantized; what it cannot run is refused when the node is built."""
    from akunu.backends.cpu import quantized
    from akunu.backends.cpu import rope as cpu_rope

    if quantized_layers and quantized.load() is None:
        pytest.skip(f"no quantized kernel here: {quantized.unavailable()}")
    D, H, KV, hd, S, inter, batch, length, offset = 64, 6, 2, 16, 64, 96, 2, 3, 20
    layers = []
    for seed in (9, 10):
        norm, wqkv, wo, wgu, wdown = _layer_weights(D, H, KV, hd, inter, seed=seed)
        if quantized_layers:
            (qkv, qkv_bits, _), (o, o_bits, _) = _quantized_operand(wqkv.T, (4, 8)), _quantized_operand(wo.T, (5,))
            (gate_up, gate_up_bits, _), (down, down_bits, _) = (
                _quantized_operand(wgu.T, (4,)),
                _quantized_operand(wdown.T, (8,), centered=0),
            )
        else:
            (qkv, qkv_bits), (o, o_bits), (gate_up, gate_up_bits), (down, down_bits) = (
                ([w], []) for w in (wqkv, wo, wgu, wdown)
            )
        mx.eval(norm, qkv, o, gate_up, down)
        layers.append((norm, qkv, qkv_bits, o, o_bits, gate_up, gate_up_bits, down, down_bits))
    x = mx.random.normal((batch * length, D), key=mx.random.key(3))
    buffers = [mx.random.normal((batch, KV, S, hd), key=mx.random.key(i)) for i in range(4)]
    copies = [mx.array(np.array(a)) for a in buffers]  # the half nodes write these
    tables = cpu_rope.head_tables(S, 0, hd, 1e4, 1.0, False, mx.float32)
    position, shape = mx.array([offset], mx.int32), (batch, H, KV, False, 0.3)

    halves, expected = [], x
    for i, (norm, qkv, qkv_bits, o, o_bits, gate_up, gate_up_bits, down, down_bits) in enumerate(layers):
        halves.append(kernels.attention_half_spec(norm, 1e-5, qkv, qkv_bits, o, o_bits, H, KV, False, 0.3))
        halves.append(kernels.mlp_half_spec(norm, 1e-5, gate_up, gate_up_bits, down, down_bits))
        keys, values = copies[2 * i : 2 * i + 2]
        if quantized_layers:
            expected = kernels.attention_half_quantized(
                expected, norm, 1e-5, qkv, qkv_bits, o, o_bits, *tables, keys, values, position, *shape
            )
            expected = kernels.mlp_half_quantized(expected, norm, 1e-5, gate_up, gate_up_bits, down, down_bits)
        else:
            expected = kernels.attention_half(
                expected, norm, 1e-5, qkv[0], o[0], *tables, keys, values, position, *shape
            )
            expected = kernels.mlp_half(expected, norm, 1e-5, gate_up[0], down[0])
        mx.eval(expected)
    stack = kernels.layers(halves)
    out = kernels.layer_stack(x, position, stack, [*tables, *buffers[:2], *tables, *buffers[2:]], batch)
    mx.eval(out)
    assert mx.array_equal(out, expected).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(buffers, copies))

    with pytest.raises(ValueError, match="cos, sin, keys, values per attention half"):
        kernels.layer_stack(x, position, stack, [*tables, *buffers[:2]], batch)
    with pytest.raises(ValueError, match="norm weight must match"):
        kernels.layer_stack(x[:, :32], position, stack, [*tables, *buffers[:2], *tables, *buffers[2:]], batch)
    norm, qkv, qkv_bits, o, o_bits, *_ = layers[0]
    with pytest.raises(ValueError, match="evaluated first"):
        kernels.attention_half_spec(norm * 2, 1e-5, qkv, qkv_bits, o, o_bits, H, KV, False, 0.3)
    with pytest.raises(ValueError, match="whole heads"):
        kernels.attention_half_spec(norm, 1e-5, qkv, qkv_bits, o, o_bits, H + 2, KV, False, 0.3)


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("batch, length, offset", [(1, 1, 0), (1, 5, 17), (2, 17, 1500)])
def test_split_heads_rotates_as_mx_fast_rope_bit_for_bit(kernels, traditional, batch, length, offset):
    """The q|k|v product's rows become rotated queries and keys and plain values, the same bits as
    mlx's RoPE on the split views (and so as the fast step's path without the kernel)."""
    from akunu.backends.cpu import rope as cpu_rope

    H, KV, D = 6, 2, 32
    product = mx.random.normal((batch * length, (H + 2 * KV) * D), key=mx.random.key(8))
    cos, sin = cpu_rope.head_tables(length, offset, D, 10_000.0, 1.0, traditional, mx.float32)
    q, k, v = kernels.split_heads(product, cos, sin, batch, H, KV, traditional)
    heads = product.reshape(batch, length, H + 2 * KV, D).transpose(0, 2, 1, 3)
    rotated = mx.fast.rope(heads[:, : H + KV], D, traditional=traditional, base=10_000.0, scale=1.0, offset=offset)
    assert mx.array_equal(q, rotated[:, :H]).item() and mx.array_equal(k, rotated[:, H:]).item()
    assert mx.array_equal(v, heads[:, H + KV :]).item()
