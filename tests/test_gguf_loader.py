"""GGUF -> mlx-lm loading on tiny files written with gguf.GGUFWriter (random weights, no real model)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q

import akunu  # noqa: F401  (must precede mlx)
from akunu.errors import ModelError, OptionsError
from akunu.models import catalogue, load_model, load_tokenizer
from akunu.models.architectures import llama3_rope_divisors
from akunu.models.dtype_policy import choose_dtype
from akunu.models.gguf_file import read_gguf
from akunu.models.gguf_model import Float32Lookup, load_gguf_model
from akunu.models.gguf_weights import requantize_bits, to_float32
from tests.tiny_gguf import (
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    gpt2_byte_alphabet,
    write_tiny_gguf,
)  # fmt: skip


def _param(model: nn.Module, path: str) -> nn.Module:
    module = model
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def _dense_weight(module: nn.Module) -> np.ndarray:
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        scales, biases = (a.astype(mx.float32) for a in (module.scales, module.biases))  # as the kernel reads them
        return np.asarray(mx.dequantize(module.weight, scales, biases, module.group_size, module.bits))
    return np.asarray(module.weight)


# Mapping -------------------------------------------------------------------------------------


@pytest.mark.parametrize("matrix_type", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_1])
def test_llama_weights_map_exactly_in_float32(tmp_path, matrix_type):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, matrix_type=matrix_type, tie=False)
    model, config = load_gguf_model(read_gguf(path), quantized=False)
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == VOCAB
    pairs = {
        "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj",
        "blk.1.ffn_norm.weight": "model.layers.1.post_attention_layernorm",
        "token_embd.weight": "model.embed_tokens",
        "output.weight": "lm_head",
    }
    for gguf_name, module_path in pairs.items():
        module = _param(model, module_path)
        assert module.weight.dtype == mx.float32
        np.testing.assert_allclose(_dense_weight(module), expected[gguf_name], atol=1e-6, err_msg=gguf_name)


@pytest.mark.parametrize(("matrix_type", "bits"), [(Q.Q8_0, 8), (Q.Q4_0, 4), (Q.Q4_1, 4)])
def test_mx_load_types_stay_quantized_exactly(tmp_path, matrix_type, bits):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, matrix_type=matrix_type, embedding_type=Q.Q8_0)
    model, config = load_gguf_model(read_gguf(path), quantized=True)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == bits and q_proj.group_size == 32
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and model.model.embed_tokens.bits == 8
    np.testing.assert_allclose(_dense_weight(q_proj), expected["blk.0.attn_q.weight"], atol=1e-3)
    assert config["tie_word_embeddings"] is True and not hasattr(model, "lm_head") or "lm_head" not in model


def test_mixed_k_quant_file_follows_the_policy(tmp_path):
    path = tmp_path / "tiny.gguf"
    # K-quants need 256-wide rows: only ffn_down (in = FFN) can hold them.
    types = {"blk.0.ffn_down.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q4_K}
    expected = write_tiny_gguf(path, matrix_type=Q.Q5_0, embedding_type=Q.Q8_0, types_by_name=types)
    model, _ = load_gguf_model(read_gguf(path), quantized=True)
    layers = model.model.layers
    bits = (layers[1].mlp.down_proj.bits, layers[0].mlp.gate_proj.bits, model.model.embed_tokens.bits)
    assert bits == (4, 5, 8)
    for module, name in [
        (layers[1].mlp.down_proj, "blk.1.ffn_down.weight"),
        (layers[0].mlp.gate_proj, "blk.0.ffn_gate.weight"),
        (model.model.embed_tokens, "token_embd.weight"),
    ]:
        np.testing.assert_array_equal(_dense_weight(module), expected[name], err_msg=name)
    # Q6_K has no MLX form: re-quantized to 6 bits, to within one 6-bit step.
    down = model.model.layers[0].mlp.down_proj
    assert down.bits == 6
    reference = expected["blk.0.ffn_down.weight"].reshape(-1, 32)
    error = np.abs(_dense_weight(down).reshape(-1, 32) - reference).max(axis=-1)
    assert np.all(error <= np.ptp(reference, axis=-1) / 63 + 1e-6)
    full, _ = load_gguf_model(read_gguf(path), quantized=False)
    for name, module in [
        ("blk.0.ffn_down.weight", full.model.layers[0].mlp.down_proj),
        ("blk.1.ffn_down.weight", full.model.layers[1].mlp.down_proj),
        ("token_embd.weight", full.model.embed_tokens),
    ]:
        assert module.weight.dtype == mx.float32
        np.testing.assert_allclose(_dense_weight(module), expected[name], atol=1e-6, err_msg=name)


EXACT_IN_BOTH_MODES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]


@pytest.mark.parametrize("ggml_type", EXACT_IN_BOTH_MODES + [Q.Q2_K, Q.Q3_K, Q.Q6_K], ids=lambda t: t.name)
def test_each_quantization_type_loads_exactly(tmp_path, ggml_type):
    """ffn_down is the one matrix whose rows (FFN wide) fit a 256-weight K-quant block."""
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, matrix_type=Q.Q8_0, types_by_name={"blk.1.ffn_down.weight": ggml_type})
    reference = expected["blk.1.ffn_down.weight"]
    for quantized in (False, True):
        model, _ = load_gguf_model(read_gguf(path), quantized=quantized)
        down = model.model.layers[1].mlp.down_proj
        assert isinstance(down, nn.QuantizedLinear) == quantized
        if quantized and ggml_type not in EXACT_IN_BOTH_MODES:  # re-quantized: within one step of its grid
            step = np.ptp(reference.reshape(-1, 32), axis=-1) / (2**down.bits - 1)
            assert np.all(np.abs(_dense_weight(down) - reference).reshape(-1, 32).max(axis=-1) <= step + 1e-6)
        else:
            np.testing.assert_array_equal(_dense_weight(down), reference)


def test_gemma3_config_and_norm_offset(tmp_path):
    path = tmp_path / "gemma.gguf"
    expected = write_tiny_gguf(path, arch="gemma3", matrix_type=Q.Q8_0)
    model, config = load_gguf_model(read_gguf(path), quantized=False)
    assert config["model_type"] == "gemma3_text"
    assert (config["head_dim"], config["query_pre_attn_scalar"], config["sliding_window"]) == (HEAD_DIM, HEAD_DIM, 32)
    assert config["sliding_window_pattern"] == 6 and config["rope_local_base_freq"] == 10_000.0
    layer = model.model.layers[1]
    for module, gguf_name in [
        (layer.pre_feedforward_layernorm, "blk.1.ffn_norm.weight"),
        (layer.post_feedforward_layernorm, "blk.1.post_ffw_norm.weight"),
        (layer.self_attn.k_norm, "blk.1.attn_k_norm.weight"),
        (model.model.norm, "output_norm.weight"),
    ]:
        np.testing.assert_allclose(np.asarray(module.weight), expected[gguf_name] - 1.0, atol=1e-6)
    assert model.tie_word_embeddings  # no output.weight: logits come from the embedding


def test_llama3_rope_factors_become_rope_scaling(tmp_path):
    from mlx_lm.models.rope_utils import Llama3RoPE

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    divisors = llama3_rope_divisors(HEAD_DIM, 10000.0, scaling)
    assert {1.0, 8.0} < set(divisors.tolist())  # plain, scaled and smoothed frequencies all occur
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, extra_f32={"rope_freqs.weight": divisors})
    model, config = load_gguf_model(read_gguf(path), quantized=True)
    assert config["rope_scaling"] == scaling
    assert isinstance(model.model.layers[0].self_attn.rope, Llama3RoPE)
    write_tiny_gguf(path, extra_f32={"rope_freqs.weight": divisors * 1.5})
    with pytest.raises(ModelError, match="rope frequency factors"):
        load_gguf_model(read_gguf(path), quantized=True)


def test_quantized_and_float32_models_agree(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, matrix_type=Q.Q8_0)
    tokens = mx.array([[1, 5, 9, 200]])
    quantized, _ = load_gguf_model(read_gguf(path), quantized=True)
    full, _ = load_gguf_model(read_gguf(path), quantized=False)
    a, b = quantized(tokens), full(tokens)
    assert a.shape == (1, 4, VOCAB)
    np.testing.assert_allclose(np.asarray(a.astype(mx.float32)), np.asarray(b), atol=5e-2)


def test_load_model_returns_a_described_model(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    loaded = load_model(str(path), dtype="quantized")
    assert loaded.architecture == "llama" and loaded.dtype == "quantized" and loaded.context_length == 256
    assert loaded.path == path and loaded.name == str(path)
    assert loaded.tokenizer.vocab_size == VOCAB
    assert "llama" in loaded.describe() and "quantized" in loaded.describe()
    logits = loaded.model(mx.array([loaded.tokenizer.encode("hi")]))
    assert logits.shape[-1] == VOCAB


def _write_mlx_folder(folder: Path, *, quantize_bits: int | None, dtype=mx.float16) -> None:
    """A tiny mlx-community style folder: config.json, model.safetensors, tokenizer.json."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    }
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    if quantize_bits:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {token: i for i, token in enumerate(gpt2_byte_alphabet())}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize(
    ("bits", "dtype", "expected"),
    [(4, "auto", None), (4, "float32", "float32"), (4, "quantized", "quantized"), (None, "quantized", "float16")],
)
def test_mlx_folder_loads_through_mlx_lm(tmp_path, bits, dtype, expected):
    folder = tmp_path / "tiny-mlx"
    _write_mlx_folder(folder, quantize_bits=bits)
    loaded = load_model(str(folder), dtype=dtype)
    assert loaded.architecture == "llama" and loaded.context_length == 512 and loaded.path == folder
    assert loaded.dtype == (expected or choose_dtype("auto").dtype)
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) == (loaded.dtype == "quantized")
    if loaded.dtype == "float32":
        assert q_proj.weight.dtype == mx.float32
    assert loaded.model(mx.array([loaded.tokenizer.encode("hi")])).shape[-1] == VOCAB


def test_load_tokenizer_reads_the_tokenizer_a_load_gives_without_the_weights(tmp_path, monkeypatch):
    import akunu.models.gguf_model

    gguf, folder = tmp_path / "tiny.gguf", tmp_path / "tiny-mlx"
    write_tiny_gguf(gguf)
    _write_mlx_folder(folder, quantize_bits=None)
    loaded = {spec: load_model(spec) for spec in (str(gguf), str(folder))}

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(akunu.models.gguf_model, "load_gguf_model", no_weights)
    monkeypatch.setattr("mlx_lm.utils.load_model", no_weights)
    for spec, model in loaded.items():
        tokenizer = load_tokenizer(spec)
        texts = [tokenizer.token_text(i) for i in range(tokenizer.vocab_size)]
        assert texts == [model.tokenizer.token_text(i) for i in range(model.tokenizer.vocab_size)]
        assert tokenizer.encode("hi there") == model.tokenizer.encode("hi there")


# Failures a user can cause -------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelError, match="no such model file"):
        load_model(str(tmp_path / "absent.gguf"))


def test_garbage_bytes(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelError, match="not a GGUF model file"):
        load_model(str(path))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelError, match="not a GGUF model file"):
        load_model(str(path))


@pytest.mark.parametrize("keep_fraction", [0.003, 0.05, 0.5, 0.999])
def test_truncated_file(tmp_path, keep_fraction):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ModelError, match="truncated|corrupt|not a GGUF"):
        load_model(str(path))


def test_garbled_header(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = bytearray(path.read_bytes())
    data[24:32] = b"\xff" * 8  # the first key's length becomes absurd
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="corrupt"):
        read_gguf(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, arch="mamba")
    with pytest.raises(ModelError, match="'mamba'.*supports.*gemma3, gemma4, .*llama, olmo2, phi3, qwen2, qwen3"):
        load_model(str(path))


def test_unsupported_quantization_type(tmp_path):
    path = tmp_path / "tiny.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    raw = rng.integers(0, 256, size=(64, 2 * GGML_QUANT_SIZES[Q.Q8_1][1]), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=Q.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="quantization type Q8_1"):
        load_gguf_model(read_gguf(path), quantized=True)


def test_unknown_catalogue_name_suggests():
    with pytest.raises(ModelError, match="unknown model 'smollm-135m'.*smollm2-135m"):
        load_model("smollm-135m")
    assert catalogue.suggest("gemma-270m") == ["gemma3-270m"]


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelError, match="without config.json"):
        load_model(str(tmp_path))


def test_hub_without_network_is_one_line(monkeypatch):
    import huggingface_hub

    def offline(repo, *args, **kwargs):
        raise ConnectionError(f"Max retries exceeded with url: /api/models/{repo}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelError, match="^no network to fetch mlx-community/Some-Model from the Hugging Face hub$"):
        load_model("mlx-community/Some-Model")


# dtype policy --------------------------------------------------------------------------------


def test_dtype_policy(monkeypatch):
    from akunu import backends
    from akunu.backends.cpu import blas

    assert choose_dtype("float32").dtype == "float32"
    assert choose_dtype("quantized").reason == "requested"
    with pytest.raises(OptionsError):
        choose_dtype("int3")
    with pytest.raises(OptionsError):
        load_model("smollm2-135m", dtype="float64")  # before any fetch
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr(blas, "loaded_path", "/usr/lib/libopenblas.so.0")
    monkeypatch.setattr(backends, "quantized_kernel_available", lambda: True)
    assert choose_dtype("auto").reason.startswith("CPU backend with akunu's quantized kernel")
    monkeypatch.setattr(backends, "quantized_kernel_available", lambda: False)
    assert choose_dtype("auto").dtype == "float32"
    assert choose_dtype("auto", float32_bytes=1 << 60).dtype == "quantized"
    monkeypatch.setattr(blas, "loaded_path", None)
    assert choose_dtype("auto").dtype == "quantized"
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert choose_dtype("auto").dtype == "quantized"
    assert choose_dtype("auto").describe().startswith("weights: quantized (")


def test_float32_dequantizes_a_large_triple_in_blocks_of_rows_to_the_same_bits():
    """MLX's 5-bit dequantize takes about 6x its output while it runs; block by block a load stays near 2x."""
    packed, scales, biases = mx.quantize(mx.random.normal((16384, 1024), key=mx.random.key(0)), group_size=32, bits=5)
    expected = mx.dequantize(packed, scales, biases, group_size=32, bits=5)
    mx.eval(expected, packed, scales, biases)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    got = to_float32({"w.weight": packed, "w.scales": scales, "w.biases": biases})["w.weight"]
    mx.eval(got)
    assert mx.get_peak_memory() - before < 3 * expected.nbytes
    assert got.dtype == mx.float32 and mx.array_equal(got, expected).item()


def test_requantize_bits():
    assert [requantize_bits(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q3_K, Q.Q5_0, Q.Q6_K, Q.Q8_0)] == [
        4,
        4,
        4,
        4,
        6,
        6,
        8,
    ]


@pytest.mark.parametrize(
    ("matrix_type", "centered"), [(Q.Q4_0, True), (Q.Q5_0, True), (Q.Q8_0, True), (Q.Q4_1, False), (Q.Q5_1, False)]
)
def test_symmetric_types_reach_the_kernel_as_centered_weights(tmp_path, matrix_type, centered):
    """Each bias of a symmetric type is exactly -2^(bits-1) times its scale, so the kernel skips reading them."""
    from akunu.backends.cpu import quantized

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, matrix_type=matrix_type, tie=False)
    model, _ = load_gguf_model(read_gguf(path), quantized=True)
    for module in (model.model.layers[0].mlp.gate_proj, model.lm_head):
        assert (quantized.kernel_biases(module.scales, module.biases, module.bits).size == 0) == centered


def test_exact_float16_scales_are_held_as_float16_where_the_kernel_reads_them(tmp_path, monkeypatch):
    from akunu import backends

    path = tmp_path / "tiny.gguf"
    types = {"blk.0.ffn_down.weight": Q.Q6_K}
    expected = write_tiny_gguf(path, matrix_type=Q.Q5_0, embedding_type=Q.Q8_0, tie=False, types_by_name=types)
    monkeypatch.setattr(backends, "quantized_kernel_reads_float16_scales", lambda: True)
    model, _ = load_gguf_model(read_gguf(path), quantized=True)
    layers = model.model.layers
    assert layers[0].mlp.gate_proj.scales.dtype == layers[0].mlp.gate_proj.biases.dtype == mx.float16  # Q5_0
    assert model.lm_head.scales.dtype == mx.float16  # Q8_0
    down = layers[0].mlp.down_proj  # Q6_K re-quantized onto a float16 grid, still within one step of the file's values
    assert down.scales.dtype == down.biases.dtype == mx.float16
    reference = expected["blk.0.ffn_down.weight"].reshape(-1, 32)
    error = np.abs(_dense_weight(down).reshape(-1, 32) - reference).max(axis=-1)
    assert np.all(error <= np.ptp(reference, axis=-1) / 63 + 1e-6)
    for module, name in [(layers[0].mlp.gate_proj, "blk.0.ffn_gate.weight"), (model.lm_head, "output.weight")]:
        np.testing.assert_array_equal(_dense_weight(module), expected[name], err_msg=name)
    # Only looked up (untied): float16 scales too, its rows looked up in float32, exactly.
    embedding = model.model.embed_tokens
    assert embedding.scales.dtype == mx.float16 and type(embedding) is Float32Lookup
    rows = embedding(mx.array([[0, 5, VOCAB - 1]]))
    assert rows.dtype == mx.float32
    np.testing.assert_array_equal(np.asarray(rows[0]), expected["token_embd.weight"][[0, 5, VOCAB - 1]])
    write_tiny_gguf(path, matrix_type=Q.Q5_0, embedding_type=Q.Q8_0, tie=True, types_by_name=types)
    tied, _ = load_gguf_model(read_gguf(path), quantized=True)  # also the output product: float32 scales
    assert tied.model.embed_tokens.scales.dtype == mx.float32 and type(tied.model.embed_tokens) is nn.QuantizedEmbedding
    monkeypatch.setattr(backends, "quantized_kernel_reads_float16_scales", lambda: False)
    model, _ = load_gguf_model(read_gguf(path), quantized=True)
    assert model.model.layers[0].mlp.gate_proj.scales.dtype == mx.float32
