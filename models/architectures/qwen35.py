"""qwen35 and qwen35moe (Qwen3.5/3.6): gated delta-net layers between full-attention layers, onto mlx-lm's qwen3_5.

llama.cpp's converter stores A_log as -exp(A_log), the conv kernel without its middle axis, dt_bias as
`ssm_dt.bias`, and (when there are more value heads than key heads) the value heads tiled by key head
instead of grouped. Norms already carry Qwen3.5's +1, as mlx-lm's sanitized weights do. Multi-token
prediction blocks (`nextn_predict_layers`, after the trunk) are dropped: akunu drafts without them.
"""

from __future__ import annotations

import mlx.core as mx

from akunu.errors import ModelError
from akunu.models.architectures.base import PROJECTIONS, QK_NORMS, Architecture, Config, Weights
from akunu.models.architectures.metadata import common_config, inconsistent, integer, number
from akunu.models.architectures.qwen import MOE
from akunu.models.gguf_file import GGUFFile
from akunu.models.gguf_weights import GROUP_SIZE, quantized_stems


def qwen35_config(gguf_file: GGUFFile) -> Config:
    common = common_config(gguf_file)
    common["num_hidden_layers"] -= integer(gguf_file, "nextn_predict_layers", 0, minimum=0)
    if common["num_hidden_layers"] < 1:
        inconsistent(gguf_file, "nextn_predict_layers leaves no trunk layers")
    if common.pop("rope_scaling") is not None:
        raise ModelError(f"{gguf_file.path.name}: rope scaling on a qwen35 model is not supported yet")
    head_dim = common["head_dim"]
    rotary = integer(gguf_file, "rope.dimension_count", head_dim)
    state = integer(gguf_file, "ssm.state_size")
    value_heads = integer(gguf_file, "ssm.time_step_rank")
    key_heads = integer(gguf_file, "ssm.group_count")
    if integer(gguf_file, "ssm.inner_size") != state * value_heads or value_heads % key_heads or rotary > head_dim:
        inconsistent(
            gguf_file,
            f"ssm sizes (state {state}, {value_heads} value heads, {key_heads} key heads, "
            f"rotary {rotary} of head {head_dim})",
        )
    return {
        "model_type": "qwen3_5",
        **common,
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
        # Text positions are equal in every M-RoPE section, so M-RoPE is plain rope on `rotary` dims.
        "rope_parameters": {
            "type": "default",
            "rope_theta": float(number(gguf_file, "rope.freq_base", 10_000_000.0)),
            "partial_rotary_factor": rotary / head_dim,
        },
        "linear_num_value_heads": value_heads,
        "linear_num_key_heads": key_heads,
        "linear_key_head_dim": state,
        "linear_value_head_dim": state,
        "linear_conv_kernel_dim": integer(gguf_file, "ssm.conv_kernel"),
        "full_attention_interval": _full_attention_interval(gguf_file, common["num_hidden_layers"]),
    }


def qwen35moe_config(gguf_file: GGUFFile) -> Config:
    return {
        **qwen35_config(gguf_file),
        "num_experts": integer(gguf_file, "expert_count"),
        "num_experts_per_tok": integer(gguf_file, "expert_used_count"),
        "moe_intermediate_size": integer(gguf_file, "expert_feed_forward_length"),
        "shared_expert_intermediate_size": integer(gguf_file, "expert_shared_feed_forward_length"),
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,  # llama.cpp's qwen35moe graph renormalises the chosen experts' weights
    }


def _full_attention_interval(gguf_file: GGUFFile, layers: int) -> int:
    """mlx-lm's qwen3_5 puts full attention on every interval-th layer; a per-layer list must say the same."""
    recurrent = gguf_file.arch_value("attention.recurrent_layers")
    if recurrent is None:
        return integer(gguf_file, "full_attention_interval", 4)
    recurrent = [bool(flag) for flag in recurrent][:layers]
    interval = next((i + 1 for i, flag in enumerate(recurrent) if not flag), len(recurrent) + 1)
    if recurrent != [(i + 1) % interval != 0 for i in range(layers)]:
        raise ModelError(
            f"{gguf_file.path.name}: a qwen35 layer pattern other than full attention every n-th layer is not supported"
        )
    return interval


def qwen35_layout(weights: Weights, config: Config) -> Weights:
    fixed = {}
    for name, array in weights.items():
        if _is_prediction_block(name, config):
            continue
        if name.endswith(".A_log"):
            array = mx.log(-array)
        elif name.endswith(".conv1d.weight"):
            array = array[..., None]  # (channels, kernel) -> mlx-lm's (channels, kernel, 1)
        elif name.endswith(".shared_expert_gate.weight"):
            array = array.reshape(1, -1)
        fixed[name.replace(".linear_attn.dt.bias", ".linear_attn.dt_bias")] = array
    if config["linear_num_value_heads"] != config["linear_num_key_heads"]:
        fixed = _dequantize_value_head_matrices(fixed)
        fixed = {name: _group_value_heads(name, array, config) for name, array in fixed.items()}
    return fixed


def _is_prediction_block(name: str, config: Config) -> bool:
    return name.startswith("model.layers.") and int(name.split(".")[2]) >= config["num_hidden_layers"]


# Where the value-head axis sits in each delta-net tensor, and the value channels' offset along it.
_VALUE_HEAD_AXES = {
    "in_proj_z.weight": 0,
    "in_proj_a.weight": 0,
    "in_proj_b.weight": 0,
    "A_log": 0,
    "dt_bias": 0,
    "out_proj.weight": 1,
    "in_proj_qkv.weight": 0,
    "conv1d.weight": 0,
}


def _dequantize_value_head_matrices(weights: Weights) -> Weights:
    """A quantized triple's rows and columns cannot move one head at a time; the delta-net matrices that
    must move are dequantized (they then load as float Linear layers)."""
    for stem, bits in quantized_stems(weights).items():
        if f"{stem.rpartition('.linear_attn.')[2]}.weight" in _VALUE_HEAD_AXES and ".linear_attn." in stem:
            packed, scales, biases = (weights.pop(f"{stem}.{part}") for part in ("weight", "scales", "biases"))
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)  # float16 ones: float32 weights
            weights[f"{stem}.weight"] = mx.dequantize(packed, scales, biases, group_size=GROUP_SIZE, bits=bits)
    return weights


def _group_value_heads(name: str, array: mx.array, config: Config) -> mx.array:
    """Undo the converter's tiling of value heads (v0 of every key head, then v1, ...) back to grouped order."""
    if ".linear_attn." not in name or name.rpartition(".linear_attn.")[2] not in _VALUE_HEAD_AXES:
        return array
    stem = name.rpartition(".linear_attn.")[2]
    axis, key_heads = _VALUE_HEAD_AXES[stem], config["linear_num_key_heads"]
    per_key = config["linear_num_value_heads"] // key_heads
    head = (
        config["linear_value_head_dim"]
        if stem.endswith(("z.weight", "qkv.weight", "conv1d.weight", "out_proj.weight"))
        else 1
    )
    start = 2 * key_heads * config["linear_key_head_dim"] if stem in ("in_proj_qkv.weight", "conv1d.weight") else 0
    moved = mx.moveaxis(array, axis, 0)
    values = moved[start:]
    grouped = values.reshape(per_key, key_heads, head, *values.shape[1:]).swapaxes(0, 1).reshape(values.shape)
    return mx.moveaxis(mx.concatenate([moved[:start], grouped]), 0, axis)


DELTA_NET = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt",  # its `.bias` becomes dt_bias in qwen35_layout
    "ssm_a": "linear_attn.A_log",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
NEXT_TOKENS = {
    f"nextn.{stem}": f"nextn.{stem}"
    for stem in ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head", "shared_head_norm")
}
NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_ATTENTION = {stem: path for stem, path in PROJECTIONS.items() if stem.startswith("attn_")}
_DENSE_MLP = {stem: path for stem, path in PROJECTIONS.items() if stem.startswith("ffn_")}

_SHARED = {**_ATTENTION, **QK_NORMS, **NORMS, **DELTA_NET, **NEXT_TOKENS}
QWEN35 = Architecture(
    "qwen35", {**_SHARED, **_DENSE_MLP}, qwen35_config, qwen35_layout, bare_tensors=frozenset({"ssm_a"})
)
QWEN35MOE = Architecture(
    "qwen35moe", {**_SHARED, **MOE, **SHARED_EXPERT}, qwen35moe_config, qwen35_layout, bare_tensors=frozenset({"ssm_a"})
)
