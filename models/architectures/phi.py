"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): fused qkv and gate/up matrices, as mlx-lm's phi3 keeps them."""

from __future__ import annotations

from akunu.errors import ModelError
from akunu.models.architectures.base import PRE_NORMS, Architecture, Config
from akunu.models.architectures.metadata import common_config, integer, number
from akunu.models.gguf_file import GGUFFile


def phi3_config(gguf_file: GGUFFile) -> Config:
    if "rope_factors_long.weight" in gguf_file.tensors:
        raise ModelError(f"{gguf_file.path.name}: phi3 long-context rope factors are not supported yet")
    common = common_config(gguf_file, ffn_up_factor=2)
    rotary = integer(gguf_file, "rope.dimension_count", common["head_dim"])
    return {
        "model_type": "phi3",
        **common,
        "rope_theta": float(number(gguf_file, "rope.freq_base", 10_000.0)),
        "partial_rotary_factor": rotary / common["head_dim"],
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
    }


PHI3 = Architecture(
    "phi3",
    {
        **PRE_NORMS,
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        # llama.cpp's phi3 ffn_up holds [gate; up], the order mlx-lm's gate_up_proj splits.
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    phi3_config,
)
