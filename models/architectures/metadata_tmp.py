"""Map GGUF architectures onto mlx-lm model configs and parameter names.

The model code is mlx-lm's; this only translates llama.cpp's metadata keys and tensor
names (`blk.N.attn_q`, ...) into an mlx-lm `config.json`-style dict and module paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from akunu.errors import ModelError
from akunu.models.gguf_file import GGUFFile

# GGUF tensor stems shared by the llama-like families -> mlx-lm module paths.
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp stores that mlx-lm recomputes (llama3 rope factors: read into the config).
_IGNORED = {"rope_freqs"}


@dataclass(frozen=True)
class Architecture:
    gguf_name: str
    layer_names: dict[str, str]
    build_config: Callable[[GGUFFile], dict[str, Any]]
    adjust: Callable[[str, mx.array], mx.array] = lambda name, array: array

    def mlx_name(self, gguf_name: str) -> str | None:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None to drop."""
        stem, _, suffix = gguf_name.rpartition(".")
        if stem.startswith("blk."):
            _, index, rest = (stem.split(".", 2) + ["", ""])[:3]
            if rest not in self.layer_names or not index.isdigit():
                raise ModelError(f"unexpected tensor {gguf_name} in a {self.gguf_name} GGUF file")
            return f"model.layers.{index}.{self.layer_names[rest]}.{suffix}"
        if stem in _IGNORED:
            return None
        if stem not in _TOP_LEVEL:
            raise ModelError(f"unexpected tensor {gguf_name} in a {self.gguf_name} GGUF file")
        return f"{_TOP_LEVEL[stem]}.{suffix}"

    def check_names(self, gguf_names) -> None:
        """Refuse a file with a tensor this architecture has no place for, before reading any weight."""
        for name in gguf_names:
            if not name.endswith((".weight", ".bias")):
                raise ModelError(f"unexpected tensor {name!r:.80} in a {self.gguf_name} GGUF file")
            self.mlx_name(name)

    def map_weights(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        mapped = {}
        for name, array in weights.items():
            target = self.mlx_name(name)
            if target is not None:
                mapped[target] = self.adjust(target, array)
        return mapped


def _required(gguf_file: GGUFFile, key: str) -> Any:
    value = gguf_file.arch_value(key)
    if value is None:
        raise ModelError(f"{gguf_file.path.name} lacks metadata key {gguf_file.architecture}.{key}")
    return value


def _number(gguf_file: GGUFFile, key: str, default: float | None = None) -> float:
    """A finite scalar metadata value; a text, array or NaN is a one-line ModelError."""
    value = gguf_file.arch_value(key, default) if default is not None else _required(gguf_file, key)
    full_key = f"{gguf_file.architecture}.{key}"
    if isinstance(value, (list, np.ndarray)):
        raise ModelError(f"{gguf_file.path.name}: per-layer values for {full_key} are not supported")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelError(f"{gguf_file.path.name}: metadata {full_key} should be a number, not {value!r:.40}")
    return value


def _int(gguf_file: GGUFFile, key: str, default: int | None = None, *, minimum: int = 1) -> int:
    """A whole-number metadata value of at least `minimum` (sizes and counts are never 0)."""
    value = _number(gguf_file, key, default)
    if value != int(value) or value < minimum:
        full_key = f"{gguf_file.architecture}.{key}"
        raise ModelError(f"{gguf_file.path.name}: metadata {full_key} = {value} is out of range")
    return int(value)


def _vocab_size(gguf_file: GGUFFile) -> int:
    embedding = gguf_file.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise ModelError(f"{gguf_file.path.name} has no token_embd.weight matrix")
    return embedding.shape[0]


def _rope_scaling(gguf_file: GGUFFile) -> dict[str, Any] | None:
    kind = gguf_file.arch_value("rope.scaling.type")
    factor = _number(gguf_file, "rope.scaling.factor", 1.0)
    if kind in (None, "none") or factor in (0, 1):
        return None
    if kind != "linear":
        raise ModelError(f"{gguf_file.path.name} uses rope scaling {str(kind)[:40]!r}, which akunu does not support yet")
    return {"rope_type": "linear", "factor": float(factor)}


def _common_config(gguf_file: GGUFFile) -> dict[str, Any]:
    heads = _int(gguf_file, "attention.head_count")
    hidden = _int(gguf_file, "embedding_length")
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": _int(gguf_file, "block_count"),
        "intermediate_size": _int(gguf_file, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(gguf_file, "attention.head_count_kv", heads),
        "head_dim": _int(gguf_file, "attention.key_length", max(hidden // heads, 1)),
        "rms_norm_eps": float(_number(gguf_file, "attention.layer_norm_rms_epsilon")),
        "vocab_size": _vocab_size(gguf_file),
        "max_position_embeddings": _int(gguf_file, "context_length", 4096),
        "rope_scaling": _rope_scaling(gguf_file),
    }
    _check_against_tensors(gguf_file, config)
    return config


def _check_against_tensors(gguf_file: GGUFFile, config: dict[str, Any]) -> None:
    """Sizes the tensors must agree with before a model is built (a huge block_count would build forever)."""
    layers = {int(n.split(".")[1]) for n in gguf_file.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    if len(layers) != config["num_hidden_layers"] or layers != set(range(len(layers))):
        _inconsistent(gguf_file, f"block_count is {config['num_hidden_layers']}, but tensors exist for {len(layers)} layers")
    if heads % kv_heads:
        _inconsistent(gguf_file, f"{heads} attention heads cannot share {kv_heads} KV heads")
    if config["rms_norm_eps"] < 0:
        _inconsistent(gguf_file, f"layer_norm_rms_epsilon is negative ({config['rms_norm_eps']})")
    expected_rows = {"token_embd.weight": (1, config["hidden_size"], "embedding_length"),
                     "blk.0.attn_q.weight": (0, heads * head_dim, "head_count x key_length"),
                     "blk.0.attn_k.weight": (0, kv_heads * head_dim, "head_count_kv x key_length"),
                     "blk.0.ffn_up.weight": (0, config["intermediate_size"], "feed_forward_length")}
    for tensor, (axis, size, what) in expected_rows.items():
        shape = gguf_file.tensors[tensor].shape if tensor in gguf_file.tensors else None
        if shape is not None and (len(shape) != 2 or shape[axis] != size):
            _inconsistent(gguf_file, f"{what} is {size}, but {tensor} has shape {shape}")


def _inconsistent(gguf_file: GGUFFile, fault: str) -> None:
    raise ModelError(f"{gguf_file.path.name}: inconsistent metadata: {fault}")


def _llama3_rope_scaling(gguf_file: GGUFFile, head_dim: int, base: float) -> dict[str, Any] | None:
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
        "original_max_position_embeddings": _int(gguf_file, "rope.scaling.original_context_length", 8192),
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


def _llama_config(gguf_file: GGUFFile) -> dict[str, Any]:
    common = _common_config(gguf_file)
    base = float(_number(gguf_file, "rope.freq_base", 10000.0))
    return {
        "model_type": "llama",
        **common,
        "rope_scaling": _llama3_rope_scaling(gguf_file, common["head_dim"], base) or common["rope_scaling"],
        "rope_theta": base,
        # llama.cpp's converter permutes Q/K rows into the interleaved (GPT-J) rope layout.
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf_file.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gguf_file.tensors,
    }


def _gemma3_config(gguf_file: GGUFFile) -> dict[str, Any]:
    common = _common_config(gguf_file)
    return {
        "model_type": "gemma3_text",
        **common,
        "rope_theta": float(_number(gguf_file, "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": common["head_dim"],
        "sliding_window": _int(gguf_file, "attention.sliding_window", 512),
        "sliding_window_pattern": 6,
    }


def _gemma_norm_adjust(name: str, array: mx.array) -> mx.array:
    # llama.cpp stores Gemma's RMSNorm weight as (1 + w); mlx-lm adds the 1 itself.
    return array - 1.0 if name.endswith("norm.weight") else array


LLAMA = Architecture(
    gguf_name="llama",
    layer_names={**_PROJECTIONS, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    build_config=_llama_config,
)

GEMMA3 = Architecture(
    gguf_name="gemma3",
    layer_names={
        **_PROJECTIONS,
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    build_config=_gemma3_config,
    adjust=_gemma_norm_adjust,
)

SUPPORTED = {arch.gguf_name: arch for arch in (LLAMA, GEMMA3)}


def architecture_of(gguf_file: GGUFFile) -> Architecture:
    name = gguf_file.architecture
    if name not in SUPPORTED:
        shown = name or "(none)"
        raise ModelError(
            f"{gguf_file.path.name} is a '{shown}' model; akunu supports the GGUF architectures: "
            + ", ".join(sorted(SUPPORTED))
        )
    return SUPPORTED[name]
