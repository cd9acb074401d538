"""Read llama.cpp's GGUF metadata into mlx-lm config values, each bad value a one-line ModelError."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from akunu.errors import ModelError
from akunu.models.gguf_file import GGUFFile


def required(gguf_file: GGUFFile, key: str) -> Any:
    value = gguf_file.arch_value(key)
    if value is None:
        raise ModelError(f"{gguf_file.path.name} lacks metadata key {gguf_file.architecture}.{key}")
    return value


def number(gguf_file: GGUFFile, key: str, default: float | None = None) -> float:
    """A finite scalar metadata value; a text, array or NaN is a one-line ModelError."""
    value = gguf_file.arch_value(key, default) if default is not None else required(gguf_file, key)
    full_key = f"{gguf_file.architecture}.{key}"
    if isinstance(value, (list, np.ndarray)):
        raise ModelError(f"{gguf_file.path.name}: per-layer values for {full_key} are not supported")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelError(f"{gguf_file.path.name}: metadata {full_key} should be a number, not {value!r:.40}")
    return value


def integer(gguf_file: GGUFFile, key: str, default: int | None = None, *, minimum: int = 1) -> int:
    """A whole-number metadata value of at least `minimum` (sizes and counts are never 0)."""
    value = number(gguf_file, key, default)
    if value != int(value) or value < minimum:
        full_key = f"{gguf_file.architecture}.{key}"
        raise ModelError(f"{gguf_file.path.name}: metadata {full_key} = {value} is out of range")
    return int(value)


def vocab_size(gguf_file: GGUFFile) -> int:
    embedding = gguf_file.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise ModelError(f"{gguf_file.path.name} has no token_embd.weight matrix")
    return embedding.shape[0]


def rope_scaling(gguf_file: GGUFFile) -> dict[str, Any] | None:
    kind = gguf_file.arch_value("rope.scaling.type")
    factor = number(gguf_file, "rope.scaling.factor", 1.0)
    if kind in (None, "none") or factor in (0, 1):
        return None
    if kind != "linear":
        raise ModelError(
            f"{gguf_file.path.name} uses rope scaling {str(kind)[:40]!r}, which akunu does not support yet"
        )
    return {"rope_type": "linear", "factor": float(factor)}


def common_config(gguf_file: GGUFFile, *, ffn_up_factor: int = 1) -> dict[str, Any]:
    """The config keys every family shares; `ffn_up_factor` 2 where ffn_up holds gate and up stacked."""
    heads = integer(gguf_file, "attention.head_count")
    hidden = integer(gguf_file, "embedding_length")
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": integer(gguf_file, "block_count"),
        "intermediate_size": integer(gguf_file, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": integer(gguf_file, "attention.head_count_kv", heads),
        "head_dim": integer(gguf_file, "attention.key_length", max(hidden // heads, 1)),
        "rms_norm_eps": float(number(gguf_file, "attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab_size(gguf_file),
        "max_position_embeddings": integer(gguf_file, "context_length", 4096),
        "rope_scaling": rope_scaling(gguf_file),
    }
    check_against_tensors(gguf_file, config, ffn_up_factor)
    return config


def check_against_tensors(gguf_file: GGUFFile, config: dict[str, Any], ffn_up_factor: int = 1) -> None:
    """Sizes the tensors must agree with before a model is built (a huge block_count would build forever)."""
    layers = {int(n.split(".")[1]) for n in gguf_file.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    if len(layers) != config["num_hidden_layers"] or layers != set(range(len(layers))):
        inconsistent(
            gguf_file, f"block_count is {config['num_hidden_layers']}, but tensors exist for {len(layers)} layers"
        )
    if heads % kv_heads:
        inconsistent(gguf_file, f"{heads} attention heads cannot share {kv_heads} KV heads")
    if config["rms_norm_eps"] < 0:
        inconsistent(gguf_file, f"layer_norm_rms_epsilon is negative ({config['rms_norm_eps']})")
    expected_rows = {
        "token_embd.weight": (1, config["hidden_size"], "embedding_length"),
        "blk.0.attn_q.weight": (0, heads * head_dim, "head_count x key_length"),
        "blk.0.attn_k.weight": (0, kv_heads * head_dim, "head_count_kv x key_length"),
        "blk.0.ffn_up.weight": (0, ffn_up_factor * config["intermediate_size"], "feed_forward_length"),
    }
    for tensor, (axis, size, what) in expected_rows.items():
        shape = gguf_file.tensors[tensor].shape if tensor in gguf_file.tensors else None
        if shape is not None and (len(shape) != 2 or shape[axis] != size):
            inconsistent(gguf_file, f"{what} is {size}, but {tensor} has shape {shape}")


def inconsistent(gguf_file: GGUFFile, fault: str) -> None:
    raise ModelError(f"{gguf_file.path.name}: inconsistent metadata: {fault}")


def llama3_rope_scaling(gguf_file: GGUFFile, head_dim: int, base: float) -> dict[str, Any] | None:
    """Llama 3.1+ GGUFs store per-frequency rope divisors (`rope_freqs`); recover mlx-lm's llama3 config.

    The converter derives them from (factor, low 1, high 4, original context); we take the
    factor from the tensor and refuse files whose divisors those defaults do not reproduce.
    """
    info = gguf_file.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    stored = gguf_file.tensor_bytes(info).view(np.float32) if info.ggml_type.name == "F32" else np.empty(0)
    scaling = {
        "rope_type": "llama3",
        "factor": float(stored.max()) if stored.size else 1.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": integer(gguf_file, "rope.scaling.original_context_length", 8192),
    }
    expected = llama3_rope_divisors(head_dim, base, scaling)
    if stored.size != expected.size or not np.allclose(stored, expected, rtol=1e-3):
        raise ModelError(f"{gguf_file.path.name} has rope frequency factors akunu cannot map onto llama3 rope scaling")
    return scaling


def llama3_rope_divisors(head_dim: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's `rope_freqs` values for a llama3 rope scaling config."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelengths = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (context / wavelengths - low) / (high - low)
    divisors = np.where(wavelengths < context / high, 1.0, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelengths > context / low, factor, divisors).astype(np.float32)
