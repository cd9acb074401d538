"""gemma2, gemma3 and gemma4 (text): rope on halves, soft-capped (gemma2) or local/global (gemma3, gemma4) attention.
Gemma 2/3 GGUFs store norms as 1 + w; Gemma 4 stores them as they are."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from akunu.errors import ModelError
from akunu.models.architectures.base import PROJECTIONS, QK_NORMS, Architecture, Config, Weights, gemma_norms
from akunu.models.architectures.metadata import (
    check_against_tensors,
    common_config,
    integer,
    number,
    rope_scaling,
    vocab_size,
)
from akunu.models.gguf_file import GGUFFile

GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA2_27B_LAYERS = 46


def gemma2_config(gguf_file: GGUFFile) -> Config:
    common = common_config(gguf_file)
    # llama.cpp scales queries by hidden / heads for the 27B (46 layers), by head_dim otherwise.
    wide = common["num_hidden_layers"] == GEMMA2_27B_LAYERS
    return {
        "model_type": "gemma2",
        **common,
        "rope_theta": float(number(gguf_file, "rope.freq_base", 10_000.0)),
        "attn_logit_softcapping": float(number(gguf_file, "attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(number(gguf_file, "final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": common["hidden_size"] / common["num_attention_heads"] if wide else common["head_dim"],
    }


def gemma3_config(gguf_file: GGUFFile) -> Config:
    common = common_config(gguf_file)
    return {
        "model_type": "gemma3_text",
        **common,
        "rope_theta": float(number(gguf_file, "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": common["head_dim"],
        "sliding_window": integer(gguf_file, "attention.sliding_window", 512),
        "sliding_window_pattern": 6,
    }


GEMMA2 = Architecture("gemma2", {**PROJECTIONS, **GEMMA_NORMS}, gemma2_config, fix_layout=gemma_norms)
GEMMA3 = Architecture("gemma3", {**PROJECTIONS, **GEMMA_NORMS, **QK_NORMS}, gemma3_config, fix_layout=gemma_norms)


def gemma4_config(gguf_file: GGUFFile) -> Config:
    """Gemma 4 keeps two head sizes: `key_length` for full-attention layers, `key_length_swa` for sliding ones."""
    sliding = _sliding_layers(gguf_file)
    heads, hidden = integer(gguf_file, "attention.head_count"), integer(gguf_file, "embedding_length")
    config = {
        "model_type": "gemma4_text",
        "hidden_size": hidden,
        "num_hidden_layers": len(sliding),
        "intermediate_size": integer(gguf_file, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": integer(gguf_file, "attention.head_count_kv", heads),
        "head_dim": integer(gguf_file, "attention.key_length_swa"),
        "global_head_dim": integer(gguf_file, "attention.key_length"),
        "rms_norm_eps": float(number(gguf_file, "attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab_size(gguf_file),
        "max_position_embeddings": integer(gguf_file, "context_length", 131072),
        "sliding_window": integer(gguf_file, "attention.sliding_window"),
        "layer_types": ["sliding_attention" if swa else "full_attention" for swa in sliding],
        "rope_parameters": _gemma4_rope(gguf_file, sliding),
        "final_logit_softcapping": _softcap(gguf_file),
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
    }
    _refuse_gemma4_variants(gguf_file, config)
    first_dim = config["head_dim"] if sliding[0] else config["global_head_dim"]
    check_against_tensors(gguf_file, {**config, "head_dim": first_dim})
    return config


def _sliding_layers(gguf_file: GGUFFile) -> list[bool]:
    pattern = gguf_file.arch_value("attention.sliding_window_pattern")
    if not isinstance(pattern, (list, np.ndarray)) or len(pattern) == 0:
        raise ModelError(
            f"{gguf_file.path.name} lacks a per-layer {gguf_file.architecture}.attention.sliding_window_pattern"
        )
    if len(pattern) != integer(gguf_file, "block_count"):
        raise ModelError(f"{gguf_file.path.name}: sliding_window_pattern has {len(pattern)} entries, not one per block")
    return [bool(swa) for swa in pattern]


def _gemma4_rope(gguf_file: GGUFFile, sliding: list[bool]) -> dict:
    """Full layers rotate a fraction of each head; llama.cpp marks the rest with frequency divisors of 1e30."""
    if rope_scaling(gguf_file) is not None:
        raise ModelError(f"{gguf_file.path.name}: rope scaling on a gemma4 model is not supported")
    swa_dim = integer(gguf_file, "attention.key_length_swa")
    if integer(gguf_file, "rope.dimension_count_swa", swa_dim) != swa_dim:
        raise ModelError(f"{gguf_file.path.name}: partial rope on gemma4 sliding layers is not supported")
    full_dim = integer(gguf_file, "attention.key_length")
    rotated = full_dim
    info = gguf_file.tensors.get("rope_freqs.weight")
    if info is not None:
        divisors = gguf_file.tensor_bytes(info).view(np.float32) if info.ggml_type.name == "F32" else np.empty(0)
        rotated = 2 * int(np.sum(divisors == 1.0))
        if divisors.size != full_dim // 2 or not np.all((divisors == 1.0) | (divisors >= 1e29)):
            raise ModelError(f"{gguf_file.path.name} has rope frequency factors akunu cannot map onto gemma4's rope")
    return {
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": rotated / full_dim,
            "rope_theta": float(number(gguf_file, "rope.freq_base", 1_000_000.0)),
        },
        "sliding_attention": {
            "rope_type": "default",
            "partial_rotary_factor": 1.0,
            "rope_theta": float(number(gguf_file, "rope.freq_base_swa", 10_000.0)),
        },
    }


def _softcap(gguf_file: GGUFFile) -> float | None:
    cap = float(number(gguf_file, "final_logit_softcapping", 0.0))
    return cap or None


def _refuse_gemma4_variants(gguf_file: GGUFFile, config: Config) -> None:
    """Per-layer embeddings (E2B/E4B), shared KV layers and experts (26B-A4B) are not mapped yet."""
    unsupported = {
        "per-layer embeddings": integer(gguf_file, "embedding_length_per_layer_input", 0, minimum=0) > 0,
        "shared KV layers": integer(gguf_file, "attention.shared_kv_layers", 0, minimum=0) > 0,
        "experts": "blk.0.ffn_gate_inp.weight" in gguf_file.tensors,
        "K as V attention": any(
            f"blk.{i}.attn_v.weight" not in gguf_file.tensors for i in range(config["num_hidden_layers"])
        ),
    }
    for what, present in unsupported.items():
        if present:
            raise ModelError(f"{gguf_file.path.name}: gemma4 with {what} is not supported yet")


def gemma4_layer_scalars(weights: Weights, config: Config) -> Weights:
    """llama.cpp's `layer_output_scale.weight` is mlx-lm's bare `layer_scalar` array (ones when absent)."""
    fixed = {
        name.removesuffix(".weight") if name.endswith(".layer_scalar.weight") else name: array
        for name, array in weights.items()
    }
    for layer in range(config["num_hidden_layers"]):
        fixed.setdefault(f"model.layers.{layer}.layer_scalar", mx.ones((1,)))
    return fixed


GEMMA4 = Architecture(
    "gemma4",
    {**PROJECTIONS, **GEMMA_NORMS, **QK_NORMS, "layer_output_scale": "layer_scalar"},
    gemma4_config,
    fix_layout=gemma4_layer_scalars,
)
