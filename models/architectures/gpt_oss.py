"""gpt-oss: rope on halves with yarn scaling, attention sinks, biased projections, and experts with biases
(llama.cpp stores gate and up separately, as mlx-lm's sanitized layout does)."""

from __future__ import annotations

from typing import Any

from akunu.errors import ModelError
from akunu.models.architectures.base import Architecture, Config, Weights
from akunu.models.architectures.metadata import check_against_tensors, integer, number, vocab_size
from akunu.models.gguf_file import GGUFFile

GPT_OSS_LAYER = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def gpt_oss_config(gguf_file: GGUFFile) -> Config:
    heads, hidden = integer(gguf_file, "attention.head_count"), integer(gguf_file, "embedding_length")
    layers = integer(gguf_file, "block_count")
    config = {
        "model_type": "gpt_oss",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": integer(gguf_file, "expert_feed_forward_length"),
        "num_local_experts": integer(gguf_file, "expert_count"),
        "num_experts_per_tok": integer(gguf_file, "expert_used_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": integer(gguf_file, "attention.head_count_kv", heads),
        "head_dim": integer(gguf_file, "attention.key_length", max(hidden // heads, 1)),
        "rms_norm_eps": float(number(gguf_file, "attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab_size(gguf_file),
        "max_position_embeddings": integer(gguf_file, "context_length", 131072),
        "sliding_window": integer(gguf_file, "attention.sliding_window"),
        "rope_theta": float(number(gguf_file, "rope.freq_base", 150_000.0)),
        "rope_scaling": _yarn(gguf_file),
        # llama.cpp's gpt-oss alternates sliding and full attention, sliding first.
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }
    if layers < 2:
        raise ModelError(f"{gguf_file.path.name}: a gpt-oss model needs both a sliding and a full attention layer")
    check_against_tensors(gguf_file, config)
    return config


def _yarn(gguf_file: GGUFFile) -> dict[str, Any] | None:
    kind = gguf_file.arch_value("rope.scaling.type")
    factor = number(gguf_file, "rope.scaling.factor", 1.0)
    if kind in (None, "none") or factor in (0, 1):
        return None
    if kind != "yarn" or gguf_file.arch_value("rope.scaling.yarn_log_multiplier") not in (None, 0, 0.0):
        raise ModelError(
            f"{gguf_file.path.name} uses rope scaling {str(kind)[:40]!r}, which akunu does not map for gpt-oss"
        )
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": integer(gguf_file, "rope.scaling.original_context_length"),
        "beta_fast": float(number(gguf_file, "rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(number(gguf_file, "rope.scaling.yarn_beta_slow", 1.0)),
    }


def bare_sinks(weights: Weights, config: Config) -> Weights:
    """llama.cpp's `attn_sinks.weight` is mlx-lm's bare `sinks` array."""
    return {
        name.removesuffix(".weight") if name.endswith(".sinks.weight") else name: array
        for name, array in weights.items()
    }


GPT_OSS = Architecture("gpt-oss", GPT_OSS_LAYER, gpt_oss_config, fix_layout=bare_sinks)
