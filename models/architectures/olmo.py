"""olmo2 (OLMo-2): norms after attention and MLP instead of before, Q/K norms over the whole projection."""

from __future__ import annotations

from akunu.models.architectures.base import PROJECTIONS, Architecture, Config
from akunu.models.architectures.metadata import common_config, number
from akunu.models.gguf_file import GGUFFile


def olmo2_config(gguf_file: GGUFFile) -> Config:
    return {
        "model_type": "olmo2",
        **common_config(gguf_file),
        "rope_theta": float(number(gguf_file, "rope.freq_base", 10_000.0)),
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf_file.tensors,
    }


OLMO2 = Architecture(
    "olmo2",
    {
        **PROJECTIONS,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    olmo2_config,
)
