"""Tiny random-weight GGUF files, one per architecture, in llama.cpp's own layout (names, shapes, keys).

The same seed writes the same bytes, so `scripts/record_llama_cpp_fixtures.py` (which runs llama.cpp on
them) and tests/test_llama_cpp_parity.py (which runs akunu on them) see one file without committing it.
Shapes follow llama.cpp's `load_arch_tensors` for each family; weights are float32 so the comparison
measures the mapping, not quantization.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, quants
from gguf.constants import GGMLQuantizationType

from akunu.models.architectures.metadata import llama3_rope_divisors
from tests.tiny_gguf import gpt2_byte_alphabet

Q8_0 = GGMLQuantizationType.Q8_0

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 272, 64, 4, 2, 16, 128
EXPERTS, EXPERTS_USED, EXPERT_FFN = 4, 2, 32
PROMPT = [17, 200, 33, 5, 91, 17, 200, 33, 64, 250, 7, 17]  # token ids: no tokenizer between us and llama.cpp
GREEDY_TOKENS = 12
ROPE_BASE = 10000.0
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

Q, K, V = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
ATTENTION = {"attn_q": (Q, HIDDEN), "attn_k": (K, HIDDEN), "attn_v": (V, HIDDEN), "attn_output": (HIDDEN, Q)}
MLP = {"ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
NORMS = {"attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,)}
QK_NORMS = {"attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,)}
# qwen35: gated delta-net layers, with twice as many value heads as key heads (the converter tiles them).
SSM_STATE, SSM_KEY_HEADS, SSM_VALUE_HEADS, SSM_KERNEL = 16, 2, 4, 4
SSM_KEYS, SSM_VALUES = SSM_STATE * SSM_KEY_HEADS, SSM_STATE * SSM_VALUE_HEADS
QWEN35_NORMS = {"attn_norm": (HIDDEN,), "post_attention_norm": (HIDDEN,)}
QWEN35_ATTENTION = {**ATTENTION, "attn_q": (2 * Q, HIDDEN), **QK_NORMS}  # attn_q holds query and gate per head
DELTA_NET = {
    "attn_qkv": (2 * SSM_KEYS + SSM_VALUES, HIDDEN),
    "attn_gate": (SSM_VALUES, HIDDEN),
    "ssm_conv1d": (2 * SSM_KEYS + SSM_VALUES, SSM_KERNEL),
    "ssm_dt.bias": (SSM_VALUE_HEADS,),
    "ssm_a": (SSM_VALUE_HEADS,),
    "ssm_alpha": (SSM_VALUE_HEADS, HIDDEN),
    "ssm_beta": (SSM_VALUE_HEADS, HIDDEN),
    "ssm_norm": (SSM_STATE,),
    "ssm_out": (HIDDEN, SSM_VALUES),
}
QWEN35_KEYS = {
    "ssm.conv_kernel": SSM_KERNEL,
    "ssm.state_size": SSM_STATE,
    "ssm.group_count": SSM_KEY_HEADS,
    "ssm.time_step_rank": SSM_VALUE_HEADS,
    "ssm.inner_size": SSM_VALUES,
    "full_attention_interval": 2,
    "rope.dimension_count": HEAD_DIM // 2,
    "rope.dimension_sections": [2, 1, 1, 0],
}
PREDICTION_BLOCK = {
    "nextn.eh_proj": (HIDDEN, 2 * HIDDEN),
    "nextn.enorm": (HIDDEN,),
    "nextn.hnorm": (HIDDEN,),
    "nextn.shared_head_norm": (HIDDEN,),
}
SHARED_EXPERT = {
    "ffn_gate_inp_shexp": (HIDDEN,),
    "ffn_gate_shexp": (EXPERT_FFN, HIDDEN),
    "ffn_up_shexp": (EXPERT_FFN, HIDDEN),
    "ffn_down_shexp": (HIDDEN, EXPERT_FFN),
}
MOE = {
    "ffn_gate_inp": (EXPERTS, HIDDEN),
    "ffn_gate_exps": (EXPERTS, EXPERT_FFN, HIDDEN),
    "ffn_up_exps": (EXPERTS, EXPERT_FFN, HIDDEN),
    "ffn_down_exps": (EXPERTS, HIDDEN, EXPERT_FFN),
}
MOE_KEYS = {"expert_count": EXPERTS, "expert_used_count": EXPERTS_USED, "expert_feed_forward_length": EXPERT_FFN}
GEMMA_NORMS = {
    "attn_norm": (HIDDEN,),
    "post_attention_norm": (HIDDEN,),
    "ffn_norm": (HIDDEN,),
    "post_ffw_norm": (HIDDEN,),
}
# gemma4: sliding layers have their own (smaller) head size; full layers rotate a quarter of each head.
SWA_HEAD_DIM, GEMMA4_ROTATED_PAIRS = 8, HEAD_DIM // 8
GEMMA4_SWA = (True, False, True, True, False)
GEMMA4_FULL = {**ATTENTION, **MLP, **GEMMA_NORMS, **QK_NORMS, "layer_output_scale": (1,)}
GEMMA4_SLIDING = {
    **GEMMA4_FULL,
    "attn_q": (HEADS * SWA_HEAD_DIM, HIDDEN),
    "attn_k": (KV_HEADS * SWA_HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * SWA_HEAD_DIM, HIDDEN),
    "attn_output": (HIDDEN, HEADS * SWA_HEAD_DIM),
    "attn_q_norm": (SWA_HEAD_DIM,),
    "attn_k_norm": (SWA_HEAD_DIM,),
}
GPT_OSS_LAYER = {
    **ATTENTION,
    "attn_q.bias": (Q,),
    "attn_k.bias": (K,),
    "attn_v.bias": (V,),
    "attn_output.bias": (HIDDEN,),
    "attn_sinks": (HEADS,),
    "attn_norm": (HIDDEN,),
    "post_attention_norm": (HIDDEN,),
    "ffn_gate_inp": (EXPERTS, HIDDEN),
    "ffn_gate_inp.bias": (EXPERTS,),
    "ffn_gate_exps": (EXPERTS, EXPERT_FFN, HIDDEN),
    "ffn_gate_exps.bias": (EXPERTS, EXPERT_FFN),
    "ffn_up_exps": (EXPERTS, EXPERT_FFN, HIDDEN),
    "ffn_up_exps.bias": (EXPERTS, EXPERT_FFN),
    "ffn_down_exps": (EXPERTS, HIDDEN, EXPERT_FFN),
    "ffn_down_exps.bias": (EXPERTS, HIDDEN),
}
GEMMA4_ROPE_FREQS = np.array([1.0] * GEMMA4_ROTATED_PAIRS + [1e30] * (HEAD_DIM // 2 - GEMMA4_ROTATED_PAIRS), np.float32)


@dataclass(frozen=True)
class TinyArch:
    name: str  # the fixture's name
    gguf_arch: str
    layer: dict[str, tuple[int, ...]]
    layers: int = 2
    tied: bool = True
    keys: dict[str, float | int | str | list] = field(default_factory=dict)  # extra `<arch>.<key>` values
    rope_freqs: bool = False  # llama 3.x: per-frequency rope divisors as a tensor
    top_level: dict[str, np.ndarray] = field(default_factory=dict)  # extra tensors outside the blocks, as given
    sliding_layer: dict[str, tuple[int, ...]] | None = None  # shapes of layers marked sliding in `swa_pattern`
    swa_pattern: tuple[bool, ...] = ()
    # Hybrids: the shapes of recurrent layers, every layer but each full_attention_interval-th.
    recurrent_layer: dict[str, tuple[int, ...]] | None = None
    prediction_blocks: int = 0  # qwen35's multi-token prediction blocks, after the trunk (akunu ignores them)

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        if layer >= self.layers:
            return {**self.layer, **PREDICTION_BLOCK}
        if self.recurrent_layer and (layer + 1) % self.keys["full_attention_interval"]:
            return self.recurrent_layer
        return self.sliding_layer if self.sliding_layer and self.swa_pattern[layer] else self.layer

    def seed(self) -> int:
        return sum(map(ord, self.name))


ARCHS = {
    arch.name: arch
    for arch in (
        TinyArch("llama", "llama", {**ATTENTION, **MLP, **NORMS}, tied=False),
        TinyArch(
            "llama3",
            "llama",
            {**ATTENTION, **MLP, **NORMS},
            tied=False,
            rope_freqs=True,
            keys={"rope.scaling.original_context_length": LLAMA3_ROPE["original_max_position_embeddings"]},
        ),
        TinyArch(
            "qwen2",
            "qwen2",
            {**ATTENTION, **MLP, **NORMS, "attn_q.bias": (Q,), "attn_k.bias": (K,), "attn_v.bias": (V,)},
        ),
        TinyArch("qwen3", "qwen3", {**ATTENTION, **MLP, **NORMS, **QK_NORMS}),
        TinyArch("qwen3moe", "qwen3moe", {**ATTENTION, **NORMS, **QK_NORMS, **MOE}, keys=MOE_KEYS),
        TinyArch(
            "qwen35",
            "qwen35",
            {**QWEN35_ATTENTION, **QWEN35_NORMS, **MLP},
            layers=4,
            keys=QWEN35_KEYS,
            recurrent_layer={**DELTA_NET, **QWEN35_NORMS, **MLP},
        ),
        TinyArch(
            "qwen35moe",
            "qwen35moe",
            {**QWEN35_ATTENTION, **QWEN35_NORMS, **MOE, **SHARED_EXPERT},
            layers=4,
            keys={**QWEN35_KEYS, **MOE_KEYS, "expert_shared_feed_forward_length": EXPERT_FFN},
            recurrent_layer={**DELTA_NET, **QWEN35_NORMS, **MOE, **SHARED_EXPERT},
        ),
        TinyArch(
            "phi3",
            "phi3",
            {
                "attn_qkv": (Q + K + V, HIDDEN),
                "attn_output": (HIDDEN, Q),
                "ffn_up": (2 * FFN, HIDDEN),
                "ffn_down": (HIDDEN, FFN),
                **NORMS,
            },
            tied=False,
            keys={"rope.dimension_count": HEAD_DIM},
        ),
        TinyArch(
            "gemma2",
            "gemma2",
            {**ATTENTION, **MLP, **GEMMA_NORMS},
            keys={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention.sliding_window": 4096},
        ),
        TinyArch(
            "gemma3",
            "gemma3",
            {**ATTENTION, **MLP, **GEMMA_NORMS, **QK_NORMS},
            layers=6,
            keys={"attention.sliding_window": 512},
        ),
        TinyArch(
            "olmo2",
            "olmo2",
            {
                **ATTENTION,
                **MLP,
                "attn_q_norm": (Q,),
                "attn_k_norm": (K,),
                "post_attention_norm": (HIDDEN,),
                "post_ffw_norm": (HIDDEN,),
            },
            tied=False,
        ),
        TinyArch("smollm3", "smollm3", {**ATTENTION, **MLP, **NORMS}, layers=4),  # layer 3 skips rope
        TinyArch(
            "granite",
            "granite",
            {**ATTENTION, **MLP, **NORMS},
            keys={"logit_scale": 4.0, "residual_scale": 0.5, "embedding_scale": 6.0, "attention.scale": 0.125},
        ),
        TinyArch(
            "gemma4",
            "gemma4",
            GEMMA4_FULL,
            layers=len(GEMMA4_SWA),
            sliding_layer=GEMMA4_SLIDING,
            swa_pattern=GEMMA4_SWA,
            top_level={"rope_freqs.weight": GEMMA4_ROPE_FREQS},
            keys={
                "attention.sliding_window": 512,
                "attention.sliding_window_pattern": list(GEMMA4_SWA),
                "attention.key_length_swa": SWA_HEAD_DIM,
                "attention.value_length_swa": SWA_HEAD_DIM,
                "rope.dimension_count_swa": SWA_HEAD_DIM,
                "rope.freq_base_swa": 1000.0,
                "embedding_length_per_layer_input": 0,
                "final_logit_softcapping": 30.0,
            },
        ),
        TinyArch(
            "gpt-oss",
            "gpt-oss",
            GPT_OSS_LAYER,
            tied=False,
            keys={
                "expert_count": EXPERTS,
                "expert_used_count": EXPERTS_USED,
                "expert_feed_forward_length": EXPERT_FFN,
                "attention.sliding_window": 128,
                "rope.scaling.type": "yarn",
                "rope.scaling.factor": 4.0,
                "rope.scaling.original_context_length": 32,
            },
        ),
    )
}


def write(arch: TinyArch, path: Path, *, matrices: str = "float32") -> Path:
    """Write `arch`'s tiny GGUF to `path` (the same bytes for the same arch, every time).

    `matrices` "q8_0" stores every matrix Q8_0 can hold as Q8_0; "q8_0-values" keeps float32 but rounds those
    matrices through Q8_0, so both files hold the same weights."""
    rng = np.random.default_rng(arch.seed())
    writer = GGUFWriter(str(path), arch.gguf_arch)
    _add_hyperparameters(writer, arch)
    _add_tokenizer(writer)
    for name, values in _tensors(arch, rng).items():
        if matrices == "float32" or values.ndim != 2 or values.shape[-1] % 32 or name.startswith("token_embd"):
            writer.add_tensor(name, values)
        elif matrices == "q8_0":
            writer.add_tensor(name, quants.quantize(values, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, quants.dequantize(quants.quantize(values, Q8_0), Q8_0).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hyperparameters(writer: GGUFWriter, arch: TinyArch) -> None:
    writer.add_block_count(arch.layers + arch.prediction_blocks)
    if arch.prediction_blocks:
        writer.add_nextn_predict_layers(arch.prediction_blocks)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(ROPE_BASE)
    for key, value in arch.keys.items():
        full = f"{arch.gguf_arch}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        else:
            writer.add_float32(full, value) if isinstance(value, float) else writer.add_uint32(full, value)


def _tensors(arch: TinyArch, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not arch.tied:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for layer in range(arch.layers + arch.prediction_blocks):
        for stem, shape in arch.layer_shapes(layer).items():
            shapes[f"blk.{layer}.{stem}" + ("" if stem.endswith((".bias", "ssm_a")) else ".weight")] = shape
    tensors = {name: _random(shape, rng, bias=name.endswith(".bias")) for name, shape in shapes.items()}
    for name in shapes:
        if name.endswith(".ssm_a"):  # llama.cpp stores -exp(A_log)
            tensors[name] = -np.exp(tensors[name] - 1.0).astype(np.float32)
    if arch.rope_freqs:
        tensors["rope_freqs.weight"] = llama3_rope_divisors(HEAD_DIM, ROPE_BASE, LLAMA3_ROPE)
    return {**tensors, **arch.top_level}


def _random(shape: tuple[int, ...], rng: np.random.Generator, *, bias: bool) -> np.ndarray:
    if len(shape) == 1 and not bias:  # norm weights near 1
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    scale = 0.5 if bias else 1.0 / np.sqrt(shape[-1])
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _add_tokenizer(writer: GGUFWriter) -> None:
    # llama.cpp refuses a BPE vocabulary without merges, so one merge and its token.
    extra = ["<|im_start|>", "<|im_end|>"] + [f"<|unused{i}|>" for i in range(VOCAB - 259)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(gpt2_byte_alphabet() + ["ab"] + extra)
    writer.add_token_types([1] * 257 + [3] * len(extra))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
