"""Tiny random-weight models for engine tests (their tokenizer is `tests.fakes.FakeTokenizer`)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import gemma3_text, llama

from tests.tiny_archs import tiny_model


def tiny_llama(
    vocab: int = 64, layers: int = 2, hidden: int = 32, seed: int = 0, sharpness: float = 1.0, attention: float = 1.0
):
    """A random llama; `sharpness` scales the output head so distributions are peaked, and a
    small `attention` makes it nearly a bigram model, whose greedy output soon cycles."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))  # livelier than the default init
    model.lm_head.weight = model.lm_head.weight * sharpness
    for layer in model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * attention
    mx.eval(model.parameters())
    return model


def tiny_gemma3(vocab: int = 64, layers: int = 2, window: int = 8, seed: int = 0, hidden: int = 32):
    """A random Gemma-3 with a short sliding window, so tests cross it quickly; with 2 layers one slides (pattern 2)."""
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=hidden * 2,
        num_attention_heads=2,
        head_dim=16,
        num_key_value_heads=1,
        vocab_size=vocab,
        sliding_window=window,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
    )
    model = gemma3_text.Model(args)
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model


def quantize(model: nn.Module, v_bits: int = 8, half_scales: bool = False) -> nn.Module:
    """The layers' projections affine-quantized in groups of 32 as the GGUF loader gives them (scales holding
    float16 values, as float32, or as float16 but v_proj's with `half_scales`), v_proj at another width than
    the rest, as GGUF files mix types within a layer."""

    def bits(path: str, module: nn.Module):
        return (
            "layers" in path
            and isinstance(module, nn.Linear)
            and {"group_size": 32, "bits": v_bits if "v_proj" in path else 4}
        )

    nn.quantize(model, class_predicate=bits)
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            dtype = mx.float16 if half_scales and "v_proj" not in name else mx.float32
            module.scales, module.biases = (a.astype(mx.float16).astype(dtype) for a in (module.scales, module.biases))
    mx.eval(model.parameters())
    return model


def tiny_qwen2(seed: int = 0) -> nn.Module:
    """Qwen2: llama's layers with biases on q, k and v; heads of 16 dimensions, as the kernels take."""
    return tiny_model("qwen2", seed=seed, hidden_size=64, intermediate_size=128, vocab_size=64)
