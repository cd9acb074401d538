"""gemma2 and gemma3 (text): norms stored as 1 + w, rope on halves, soft-capped (gemma2) or local/global (gemma3) attention."""

from __future__ import annotations

from akunu.models.architectures.base import PROJECTIONS, QK_NORMS, Architecture, Config, gemma_norms
from akunu.models.architectures.metadata import common_config, integer, number
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
