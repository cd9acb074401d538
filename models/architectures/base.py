"""An Architecture: llama.cpp's tensor names onto one mlx-lm model class, and the layout fixes between them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from akunu.errors import ModelError
from akunu.models.gguf_file import GGUFFile

Config = dict[str, Any]
Weights = dict[str, mx.array]

# GGUF tensor stems most families share -> mlx-lm module paths.
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Tensors llama.cpp stores that mlx-lm recomputes (llama3 rope factors: read into the config).
IGNORED = frozenset({"rope_freqs"})


def unchanged(weights: Weights, config: Config) -> Weights:
    return weights


@dataclass(frozen=True)
class Architecture:
    gguf_name: str
    layer_names: dict[str, str]
    build_config: Callable[[GGUFFile], Config]
    # Layout fixes after renaming (un-permuting rows, norm offsets), given the built config.
    fix_layout: Callable[[Weights, Config], Weights] = unchanged
    top_level: dict[str, str] = field(default_factory=lambda: dict(TOP_LEVEL))
    # Layer tensors llama.cpp names without a `.weight` suffix (qwen35's `blk.N.ssm_a`).
    bare_tensors: frozenset[str] = frozenset()

    def mlx_name(self, gguf_name: str) -> str | None:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None to drop."""
        stem, _, suffix = gguf_name.rpartition(".")
        if suffix in self.bare_tensors:
            stem, suffix = gguf_name, ""
        if stem.startswith("blk."):
            _, index, rest = (stem.split(".", 2) + ["", ""])[:3]
            if rest not in self.layer_names or not index.isdigit():
                raise ModelError(f"unexpected tensor {gguf_name} in a {self.gguf_name} GGUF file")
            return f"model.layers.{index}.{self.layer_names[rest]}" + (f".{suffix}" if suffix else "")
        if stem in IGNORED:
            return None
        if stem not in self.top_level:
            raise ModelError(f"unexpected tensor {gguf_name} in a {self.gguf_name} GGUF file")
        return f"{self.top_level[stem]}.{suffix}"

    def check_names(self, gguf_names) -> None:
        """Refuse a file with a tensor this architecture has no place for, before reading any weight."""
        for name in gguf_names:
            if not name.endswith((".weight", ".bias")) and name.rpartition(".")[2] not in self.bare_tensors:
                raise ModelError(f"unexpected tensor {name!r:.80} in a {self.gguf_name} GGUF file")
            self.mlx_name(name)

    def map_weights(self, weights: Weights, config: Config) -> Weights:
        mapped = {}
        for name, array in weights.items():
            target = self.mlx_name(name)
            if target is not None:
                mapped[target] = array
        return self.fix_layout(mapped, config)


def gemma_norms(weights: Weights, config: Config) -> Weights:
    """llama.cpp stores Gemma's RMSNorm weight as (1 + w); mlx-lm's Gemma norms add the 1 themselves."""
    return {name: array - 1.0 if name.endswith("norm.weight") else array for name, array in weights.items()}


def unpermute_qk(weights: Weights, config: Config) -> Weights:
    """Undo the row permutation convert_hf_to_gguf applies to llama-family Q/K (interleaved rope pairs),
    for mlx-lm classes that rotate halves (NeoX style). Rows move whole, so packed triples move too."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    fixed = dict(weights)
    for name, array in weights.items():
        projection = name.split(".")[-2]
        if ".self_attn." in name and projection in heads:
            fixed[name] = _unpermute_rows(array, heads[projection])
    return fixed


def _unpermute_rows(array: mx.array, heads: int) -> mx.array:
    rows = array.shape[0]
    shaped = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
    return mx.swapaxes(shaped, 1, 2).reshape(array.shape)
