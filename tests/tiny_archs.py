"""Every text architecture in `mlx_lm.models`, built tiny with random weights.

Configs are built from the ModelArgs dataclass of each model file: a field named like a size
gets a tiny value (`SIZES`), a few architectures need consistent extras (`EXTRAS`), and any
other required field gets a small value of its annotated type. `SKIPPED` names the modules
that are not a model; `NOT_BUILT` the models the generic config cannot build, with the error.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing

import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_flatten, tree_map

VOCAB = 64

SIZES = {  # field name -> tiny value; applied whether the field is required or has a default
    "vocab_size": VOCAB, "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "model_dim": 32,
    "num_hidden_layers": 4, "n_layer": 4, "n_layers": 4, "num_layers": 4,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "hidden_dim": 64,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "head_dim": 8, "kv_channels": 8,
    "max_position_embeddings": 512, "n_positions": 512, "context_length": 512, "seq_length": 512,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    "sliding_window": 8, "window_size": 8, "attention_window_size": 8, "sliding_window_size": 8,
    "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "conv_kernel": 4, "d_conv": 4, "conv_L_cache": 3,
    "state_size": 8, "ssm_state_size": 8, "d_state": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "expand": 2, "n_groups": 1, "mamba_n_groups": 1, "mamba_chunk_size": 16, "chunk_size": 16,
    "time_step_rank": 4, "dt_rank": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "topk_group": 1, "n_group": 1, "partial_rotary_factor": 0.5,
}  # fmt: skip

_HYBRID = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
EXTRAS: dict[str, dict] = {  # module -> field overrides an architecture needs beyond SIZES: mostly which layer is which
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1},
    "nemotron_h": {"hybrid_override_pattern": ["M", "*", "M", "E"], "mamba_num_heads": 4, "mamba_head_dim": 16},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2},
    "mamba2": {"time_step_limit": (0.0, float("inf")), "num_heads": 4, "head_dim": 16},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1, 3], "num_heads": 4, "head_dim": 8}},
    "gear": {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "mamba_proj_bias": False,
        "mamba_conv_bias": True,
        "mamba_d_head": 16,
        "position_embedding_type": "rope",
        "shared_intermediate_size": 32,
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 32},
}

BUILT = [  # the architectures tested: every module below that builds with the generic tiny config
    "Klear",
    "afm7",
    "apertus",
    "baichuan_m1",
    "bailing_hybrid",
    "bailing_moe",
    "bailing_moe_linear",
    "bailing_moe_v3",
    "cohere",
    "cohere2",
    "deepseek",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v41",
    "dots1",
    "ernie4_5",
    "ernie4_5_moe",
    "exaone",
    "falcon_h1",
    "gemma",
    "gemma2",
    "glm",
    "glm4",
    "glm4_moe",
    "glm4_moe_lite",
    "gpt2",
    "gpt_bigcode",
    "gpt_neox",
    "gpt_oss",
    "granite",
    "granitemoe",
    "granitemoehybrid",
    "helium",
    "hunyuan_v1_dense",
    "internlm2",
    "internlm3",
    "iquestloopcoder",
    "jamba",
    "kimi_linear",
    "laguna",
    "lfm2_moe",
    "llama",
    "mamba",
    "mamba2",
    "mimo",
    "minicpm",
    "minimax",
    "mixtral",
    "muse_glimmer",
    "nanbeige",
    "nanochat",
    "nemotron",
    "olmo2",
    "olmo3",
    "olmo_hybrid",
    "olmoe",
    "phi",
    "phi3",
    "phimoe",
    "plamo2",
    "plamo3",
    "qwen",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_5",
    "qwen3_moe",
    "qwen3_next",
    "recurrent_gemma",
    "rwkv7",
    "seed_oss",
    "smollm3",
    "solar_open",
    "stablelm",
    "starcoder2",
    "talkie",
    "telechat3",
    "youtu_llm",
]
NOT_BUILT = {  # module -> why the generic tiny config does not build it (not an engine limit)
    "phi3small": "builds, but its plain decoding segfaults in MLX on the CPU with the tiny config",
    "afmoe": "ValueError: 'full_attention' is not in list",
    "bitnet": "RuntimeError: [metal_kernel] No Metal back-end.",
    "dbrx": "KeyError: 'ffn_hidden_size'",
    "deepseek_v2": "AttributeError: 'NoneType' object has no attribute 'get'",
    "exaone4": "AttributeError: 'float' object has no attribute 'get'",
    "exaone_moe": "IndexError: list index out of range",
    "gear": "AttributeError: 'ArraysCache' object has no attribute 'offset' (mlx-lm's gear reads an offset from its linear layers' cache)",
    "gemma3": "TypeError: ModelArgs.__init__() missing 1 required positional argument: 'model_type'",
    "gemma3_text": "IndexError: list index out of range",
    "gemma3n": "TypeError: TextConfig.__init__() missing 24 required positional arguments: 'model_type', 'hidden_size', 'num_hidden_layers', 'intermediate_size', 'num",
    "gemma4": "ran out of memory or time with the generic config (a default size is large)",
    "gemma4_text": "IndexError: list index out of range",
    "glm_moe_dsa": "KeyError: 'rope_theta'",
    "gptj": "ValueError: [rope] dims must not exceed the input's last dimension (8) but got 64.",
    "hunyuan": "TypeError: 'NoneType' object is not subscriptable",
    "kimi_k25": "ran out of memory or time with the generic config (a default size is large)",
    "kimi_k3": "TypeError: 'NoneType' object is not subscriptable",
    "kimi_vl": "ran out of memory or time with the generic config (a default size is large)",
    "lfm2": "ValueError: [matmul] shapes: its block sizes need their own fields",
    "lfm2-vl": "TypeError: ModelArgs.__init__() missing 14 required positional arguments: 'model_type', 'vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attenti",
    "lille-130m": "ZeroDivisionError: float division by zero",
    "llama4": "TypeError: TextArgs.__init__() missing 19 required positional arguments: 'attention_bias', 'attention_chunk_size', 'head_dim', 'hidden_size', 'interle",
    "llama4_text": "IndexError: list index out of range",
    "longcat_flash": "AttributeError: 'LongcatFlashMLA' object has no attribute 'mla_scale_q_lora'",
    "longcat_flash_ngram": "AttributeError: 'LongcatFlashMLA' object has no attribute 'mla_scale_q_lora'",
    "mellum": "IndexError: list index out of range",
    "mimo_v2_flash": "TypeError: 'int' object is not subscriptable",
    "minicpm3": "AttributeError: 'NoneType' object has no attribute 'get'",
    "minimax_m3_vl": "ran out of memory or time with the generic config (a default size is large)",
    "ministral3": "TypeError: 'NoneType' object is not subscriptable",
    "mistral3": "TypeError: ModelArgs.__init__() missing 7 required positional arguments: 'model_type', 'hidden_size', 'num_hidden_layers', 'intermediate_size', 'num_a",
    "mistral4": "TypeError: 'NoneType' object is not subscriptable",
    "muse_spark": "TypeError: TextArgs.__init__() missing 18 required positional arguments: 'hidden_size', 'num_attention_heads', 'num_key_value_heads', 'head_dim', 'num",
    "nemotron-nas": "ValueError: Number of block_configs (0) must match num_hidden_layers (4)",
    "nemotron_h": "TypeError in __mul__: a field the generic config leaves None",
    "olmo": "ran out of memory or time with the generic config (a default size is large)",
    "openelm": "IndexError: list index out of range",
    "phixtral": "ValueError: [rope] dims must not exceed the input's last dimension (8) but got 32.",
    "pixtral": "TypeError: ModelArgs.__init__() missing 6 required positional arguments: 'model_type', 'hidden_size', 'num_hidden_layers', 'intermediate_size', 'rms_n",
    "plamo": "ValueError: [scaled_dot_product_attention] n_heads must be a multiple of n_kv_heads, found n_heads 4 for n_kv_heads 8.",
    "prism_hadamard_qwen35": "ValueError: Unsupported Hadamard pack: schema 2, namespace ''",
    "qwen2_vl": "TypeError: ModelArgs.__init__() missing 8 required positional arguments: 'model_type', 'hidden_size', 'num_hidden_layers', 'intermediate_size', 'num_a",
    "qwen3_5_moe": "ran out of memory or time with the generic config (a default size is large)",
    "qwen3_vl": "TypeError: ModelArgs.__init__() missing 11 required positional arguments: 'model_type', 'hidden_size', 'num_hidden_layers', 'intermediate_size', 'num_",
    "qwen3_vl_moe": "TypeError: ModelArgs.__init__() missing 18 required positional arguments: 'model_type', 'hidden_size', 'num_hidden_layers', 'intermediate_size', 'num_",
    "spark2_5": "ValueError: Missing RoPE parameters for layer types: ['full_attention', 'sliding_attention']",
    "step3p5": "ValueError: [argpartition] Received invalid kth 7 along axis -1 for array with shape: (1,5,4)",
}  # fmt: skip
ARCHITECTURES = BUILT

SKIPPED = {  # module -> why it is not built here
    "base": "helpers, no model", "cache": "caches, no model", "rope_utils": "helpers, no model",
    "switch_layers": "layers, no model", "activations": "helpers, no model", "pipeline": "helpers, no model",
    "ssm": "helpers, no model", "gated_delta": "helpers, no model", "mla": "helpers, no model",
    "bitlinear_layers": "layers, no model",
}  # fmt: skip


def module_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__))


def _small(annotation):
    """A small value of a required field's type."""
    text = str(annotation)
    if annotation is bool or "bool" in text:
        return False
    if annotation is int or text.startswith("int"):
        return 2
    if annotation is float or "float" in text:
        return 0.5
    if "List" in text or "list" in text:
        return []
    if "Dict" in text or "dict" in text:
        return {}
    if annotation is str or "str" in text:
        return ""
    return None


def tiny_args(name: str, module, **overrides):
    fields = {f.name: f for f in dataclasses.fields(module.ModelArgs)}
    values = _values(name, module.ModelArgs, overrides)
    return _finish(name, module, fields, values, overrides)


def _values(name: str, args_class, overrides: dict) -> dict:
    fields = {f.name: f for f in dataclasses.fields(args_class)}
    hints = typing.get_type_hints(args_class)
    values = {"model_type": name}
    for key, f in fields.items():
        if key in SIZES:
            values[key] = SIZES[key]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and key not in values:
            values[key] = _small(hints.get(key))
    values.update(EXTRAS.get(name, {}))
    values.update(overrides)
    return values


def _finish(name: str, module, fields: dict, values: dict, overrides: dict):
    if "text_config" in fields and "text_config" not in SIZES:  # a wrapper whose text model has its own args
        text_args = next(getattr(module, c) for c in ("TextModelArgs", "TextArgs", "TextConfig") if hasattr(module, c))
        values["text_config"] = _values(name, text_args, overrides)
    return module.ModelArgs(**{k: v for k, v in values.items() if k in fields})


def tiny_model(name: str, seed: int = 0, **overrides):
    """Module `name`'s Model with a tiny config (`overrides` replace its fields) and random weights."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = module.Model(tiny_args(name, module, **overrides))
    params = tree_flatten(model.parameters())
    model.update(tree_map(lambda p: p * 2.0 if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
    mx.eval(model.parameters())
    assert params, name
    return model
