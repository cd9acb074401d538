"""qwen2 (Qwen2/2.5), qwen3 and qwen3moe: rope on halves (NeoX), so llama.cpp stores Q/K rows unpermuted."""

from __future__ import annotations

from akunu.errors import ModelError
from akunu.models.architectures.base import PRE_NORMS, PROJECTIONS, QK_NORMS, Architecture, Config
from akunu.models.architectures.metadata import common_config, integer, number
from akunu.models.gguf_file import GGUFFile


def _qwen_common(gguf_file: GGUFFile) -> Config:
    return {
        **common_config(gguf_file),
        "rope_theta": float(number(gguf_file, "rope.freq_base", 1_000_000.0)),
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
    }


def qwen2_config(gguf_file: GGUFFile) -> Config:
    config = {"model_type": "qwen2", **_qwen_common(gguf_file)}
    # mlx-lm's qwen2 derives head_dim from hidden / heads and always has q/k/v biases.
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise ModelError(
            f"{gguf_file.path.name}: a qwen2 head size other than embedding_length / head_count is not supported"
        )
    if "blk.0.attn_q.bias" not in gguf_file.tensors:
        raise ModelError(f"{gguf_file.path.name}: a qwen2 file without q/k/v biases is not supported")
    return config


def qwen3_config(gguf_file: GGUFFile) -> Config:
    return {"model_type": "qwen3", **_qwen_common(gguf_file)}


def qwen3moe_config(gguf_file: GGUFFile) -> Config:
    experts = integer(gguf_file, "expert_count")
    return {
        "model_type": "qwen3_moe",
        **_qwen_common(gguf_file),
        "num_experts": experts,
        "num_experts_per_tok": integer(gguf_file, "expert_used_count"),
        "moe_intermediate_size": integer(gguf_file, "expert_feed_forward_length"),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights.
        "norm_topk_prob": True,
    }


MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}

QWEN2 = Architecture("qwen2", {**PROJECTIONS, **PRE_NORMS}, qwen2_config)
QWEN3 = Architecture("qwen3", {**PROJECTIONS, **PRE_NORMS, **QK_NORMS}, qwen3_config)
QWEN3MOE = Architecture("qwen3moe", {**PROJECTIONS, **PRE_NORMS, **QK_NORMS, **MOE}, qwen3moe_config)
