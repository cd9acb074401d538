"""llama (Llama 2/3.x, Mistral, SmolLM2), granite and smollm3: llama.cpp's LLAMA layout, rope on interleaved pairs."""

from __future__ import annotations

from akunu.models.architectures.base import PRE_NORMS, PROJECTIONS, Architecture, Config, unpermute_qk
from akunu.models.architectures.metadata import common_config, llama3_rope_scaling, number
from akunu.models.gguf_file import GGUFFile


def llama_config(gguf_file: GGUFFile) -> Config:
    common = common_config(gguf_file)
    base = float(number(gguf_file, "rope.freq_base", 10000.0))
    return {
        "model_type": "llama",
        **common,
        "rope_scaling": llama3_rope_scaling(gguf_file, common["head_dim"], base) or common["rope_scaling"],
        "rope_theta": base,
        # llama.cpp's converter permutes Q/K rows into the interleaved (GPT-J) rope layout.
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf_file.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gguf_file.tensors,
    }


def smollm3_config(gguf_file: GGUFFile) -> Config:
    # llama.cpp skips rope on every 4th layer (n_no_rope_layer_step = 4), as SmolLM3 was trained.
    return {**llama_config(gguf_file), "model_type": "smollm3", "no_rope_layer_interval": 4}


def granite_config(gguf_file: GGUFFile) -> Config:
    common = common_config(gguf_file)
    return {
        "model_type": "granite",
        **common,
        "rope_theta": float(number(gguf_file, "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf_file.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gguf_file.tensors,
        "logits_scaling": float(number(gguf_file, "logit_scale")),
        "embedding_multiplier": float(number(gguf_file, "embedding_scale", 1.0)),
        "residual_multiplier": float(number(gguf_file, "residual_scale", 1.0)),
        "attention_multiplier": float(number(gguf_file, "attention.scale", common["head_dim"] ** -0.5)),
    }


LLAMA_LAYER = {**PROJECTIONS, **PRE_NORMS}

LLAMA = Architecture("llama", LLAMA_LAYER, llama_config)
SMOLLM3 = Architecture("smollm3", LLAMA_LAYER, smollm3_config)
# mlx-lm's granite rotates halves with no option: give it Q/K rows in Hugging Face order again.
GRANITE = Architecture("granite", LLAMA_LAYER, granite_config, fix_layout=unpermute_qk)
