"""Tiny GGUF files written with gguf.GGUFWriter: random weights of a 2-layer llama or Gemma-3 and a
GPT-2 byte tokenizer, for loader tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 300, 64, 2, 4, 2, 256  # FFN fills one K-quant block
HEAD_DIM = HIDDEN // HEADS

LLAMA_LAYER = {
    "attn_q": (HEADS * HEAD_DIM, HIDDEN),
    "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (FFN, HIDDEN),
    "ffn_up": (FFN, HIDDEN),
    "ffn_down": (HIDDEN, FFN),
}
LLAMA_NORMS = ("attn_norm", "ffn_norm")
GEMMA_NORMS = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


def encode_values(values: np.ndarray, ggml_type: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or floats to store, the float32 values a reader should get back)."""
    if ggml_type == Q.F32:
        return values, values
    if ggml_type == Q.F16:
        return values.astype(np.float16), values.astype(np.float16).astype(np.float32)
    if ggml_type in HALF_SCALE_OFFSETS:  # gguf cannot quantize these: random blocks with sane scales
        raw = _random_k_blocks(values.shape, ggml_type, rng)
        return raw, dequantize(raw, ggml_type)
    packed = quantize(values, ggml_type)
    return packed, dequantize(packed, ggml_type)


# Byte offsets of the float16 scales (d, dmin) in a block, for types gguf-py cannot quantize.
HALF_SCALE_OFFSETS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}


def _random_k_blocks(shape: tuple[int, ...], ggml_type: Q, rng: np.random.Generator) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rows, blocks = int(np.prod(shape[:-1])), shape[-1] // block_size
    raw = rng.integers(0, 256, size=(rows, blocks, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    for offset in HALF_SCALE_OFFSETS[ggml_type]:
        raw[..., offset : offset + 2] = scale
    return raw.reshape(*shape[:-1], blocks * type_size)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    matrix_type: Q = Q.Q8_0,
    embedding_type: Q | None = None,
    tie: bool = True,
    seed: int = 0,
    tokenizer: bool = True,
    types_by_name: dict[str, Q] | None = None,
    extra_f32: dict[str, np.ndarray] | None = None,
    context: int = 256,
) -> dict[str, np.ndarray]:
    """Write a 2-layer model; return the float32 values each tensor should load as, by GGUF name."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_sliding_window(32)
    if tokenizer:
        _add_tokenizer(writer)

    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tie:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    norms = GEMMA_NORMS + ("attn_q_norm", "attn_k_norm") if arch == "gemma3" else LLAMA_NORMS
    for layer in range(LAYERS):
        for stem, shape in LLAMA_LAYER.items():
            shapes[f"blk.{layer}.{stem}.weight"] = shape
        for stem in norms:
            shapes[f"blk.{layer}.{stem}.weight"] = (HEAD_DIM,) if stem in ("attn_q_norm", "attn_k_norm") else (HIDDEN,)

    expected = {}
    for name, shape in shapes.items():
        values = (rng.standard_normal(shape) * (0.05 if len(shape) == 2 else 0.1) + (len(shape) == 1)).astype(
            np.float32
        )
        ggml_type = (types_by_name or {}).get(name) or (
            Q.F32
            if len(shape) == 1
            else (embedding_type or matrix_type)
            if name == "token_embd.weight"
            else matrix_type
        )
        stored, expected[name] = encode_values(values, ggml_type, rng)
        writer.add_tensor(name, stored, raw_dtype=ggml_type if ggml_type not in (Q.F32, Q.F16) else None)
    for name, values in (extra_f32 or {}).items():
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in character for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _add_tokenizer(writer: GGUFWriter) -> None:
    extra = ["<|im_start|>", "<|im_end|>"] + [f"<|unused{i}|>" for i in range(VOCAB - 258)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(gpt2_byte_alphabet() + extra)
    writer.add_token_types([1] * 256 + [3] * len(extra))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
