"""Crafted and fuzzed GGUF files: each ends in a one-line ModelError or a model that runs, never a traceback."""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import akunu  # noqa: F401  (must precede mlx)
from akunu import cost_curve
from akunu.errors import ModelError
from akunu.models import load_model
from akunu.models.gguf_file import read_gguf
from tests import gguf_craft as craft
from tests import llama_cpp_tiny
from tests.tiny import tiny_llama
from tests.tiny_gguf import VOCAB, write_tiny_gguf

U32, STR, F32 = 4, 8, 6


@pytest.fixture(scope="module")
def tiny_layout(tmp_path_factory) -> craft.Layout:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, matrix_type=Q.Q8_0)
    return craft.parse(path)


def _load_and_run(path: Path) -> None:
    """A correct load: the model runs a forward pass and the tokenizer round-trips text."""
    loaded = load_model(str(path))
    ids = loaded.tokenizer.encode("Name three rivers.")
    logits = loaded.model(mx.array(ids)[None])
    mx.eval(logits)
    assert logits.shape[-1] >= 1
    loaded.tokenizer.decode(list(range(min(VOCAB, loaded.model.args.vocab_size))))


def _set(key: str, type_id: int, value, item_type: int | None = None):
    return lambda layout: layout.metadata.__setitem__(key, craft.Value(type_id, value, item_type))


def _tensor(name: str, **changes):
    def change(layout):
        entry = next(t for t in layout.tensors if t.name == name)
        for attribute, value in changes.items():
            setattr(entry, attribute, value)

    return change


def _duplicate_tensor(layout):
    layout.tensors[1].name = layout.tensors[0].name


def _big_endian(layout):
    layout.version = struct.unpack("<I", struct.pack(">I", 3))[0]


def _longer_vocabulary(layout):
    layout.metadata["tokenizer.ggml.tokens"].value += [f"<extra{i}>" for i in range(50)]
    layout.metadata["tokenizer.ggml.token_type"].value += [3] * 50


# Each fault the issue lists, and further bad inputs; (how to break the file, the one line expected).
CRAFTED = {
    "head_count = 0": (_set("llama.attention.head_count", U32, 0), "head_count = 0 is out of range"),
    "text layer_norm_rms_epsilon": (
        _set("llama.attention.layer_norm_rms_epsilon", STR, "tiny"),
        "layer_norm_rms_epsilon should be a number, not 'tiny'",
    ),
    "text general.alignment": (_set("general.alignment", STR, "thirty-two"), "general.alignment is 'thirty-two'"),
    "alignment 0": (_set("general.alignment", U32, 0), "general.alignment is 0, not a power of two"),
    "weight relabelled IQ2_XXS": (
        _tensor("blk.0.ffn_down.weight", type_id=int(Q.IQ2_XXS)),
        "quantization type IQ2_XXS, which akunu does not support",
    ),
    "big-endian file": (_big_endian, "big-endian GGUF file"),
    "dims overflowing memory": (_tensor("blk.0.attn_q.weight", ne=[2**40, 2**40]), "truncated or corrupt"),
    "dims wrapping int64": (_tensor("blk.0.attn_q.weight", ne=[2**32, 2**32]), "truncated or corrupt"),
    "negative offset": (_tensor("blk.0.attn_q.weight", offset=-64), "truncated or corrupt"),
    "duplicate tensor names": (_duplicate_tensor, "appears twice"),
    "huge block_count": (_set("llama.block_count", U32, 10**9), "block_count is 1000000000, but tensors exist for 2"),
    "heads not sharing KV heads": (_set("llama.attention.head_count_kv", U32, 3), "4 attention heads cannot share 3"),
    "embedding_length mismatch": (_set("llama.embedding_length", U32, 96), "embedding_length is 96, but token_embd"),
    "NaN epsilon": (_set("llama.attention.layer_norm_rms_epsilon", F32, math.nan), "should be a number, not nan"),
    "array as the tokenizer model": (_set("tokenizer.ggml.model", 9, [], U32), "tokenizer.ggml.model should be text"),
    "array as the rope scaling type": (_set("llama.rope.scaling.type", 9, [], U32), "rope.scaling.type should be text"),
    "vocabulary longer than the embedding": (
        _longer_vocabulary,
        f"vocabulary has {VOCAB + 50} tokens, but token_embd.weight has only",
    ),
}


@pytest.mark.parametrize("fault", list(CRAFTED))
def test_crafted_files_give_one_line(tiny_layout, tmp_path, fault):
    change, message = CRAFTED[fault]
    layout = copy.deepcopy(tiny_layout)
    change(layout)
    path = craft.write(layout, tmp_path / "crafted.gguf")
    with pytest.raises(ModelError) as caught:
        _load_and_run(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_huge_tensor_count_is_one_line(tiny_layout, tmp_path):
    layout = copy.deepcopy(tiny_layout)
    layout.counts = (len(layout.tensors) + 10**5, len(layout.metadata))
    with pytest.raises(ModelError, match="corrupt GGUF file"):
        _load_and_run(craft.write(layout, tmp_path / "crafted.gguf"))


def test_a_repeated_metadata_key_is_one_line(tiny_layout, tmp_path):
    layout = copy.deepcopy(tiny_layout)
    layout.repeated_keys.append(("llama.block_count", craft.Value(U32, 1)))
    with pytest.raises(ModelError, match="metadata key 'llama.block_count' appears twice"):
        _load_and_run(craft.write(layout, tmp_path / "crafted.gguf"))


def test_a_vector_labelled_q8_0_loads_as_its_dequantized_values(tiny_layout, tmp_path):
    layout = copy.deepcopy(tiny_layout)
    _tensor("output_norm.weight", type_id=int(Q.Q8_0))(layout)
    _load_and_run(craft.write(layout, tmp_path / "crafted.gguf"))  # 64 floats' bytes hold 2 Q8_0 blocks: a valid file


def test_float64_metadata_loads_without_mlx_s_reader(tiny_layout, tmp_path):
    """MLX's GGUF reader segfaults on a float64 value; akunu reads such a file itself."""
    layout = copy.deepcopy(tiny_layout)
    layout.metadata["general.some_float64"] = craft.Value(12, 0.5)
    _load_and_run(craft.write(layout, tmp_path / "crafted.gguf"))


@pytest.mark.parametrize(("ggml_type", "scale_at"), [(Q.Q6_K, -2), (Q.Q5_0, 0)])  # dequantized; an exact triple
def test_weights_that_decode_to_infinity_are_one_line(tmp_path, ggml_type, scale_at):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, matrix_type=Q.Q5_0, types_by_name={"blk.0.ffn_down.weight": ggml_type})
    layout = craft.parse(path)
    entry = next(t for t in layout.tensors if t.name == "blk.0.ffn_down.weight")
    data = bytearray(layout.data)
    start = entry.offset + scale_at % GGML_QUANT_SIZES[ggml_type][1]
    data[start : start + 2] = np.float16(np.nan).tobytes()  # the f16 scale d of block 0
    layout.data = bytes(data)
    with pytest.raises(ModelError, match="blk.0.ffn_down.weight decodes to NaN or infinite weights"):
        _load_and_run(craft.write(layout, tmp_path / "crafted.gguf"))


@pytest.mark.parametrize("seconds", [[0.0] * 16, [-1.0] * 16, ["fast"] * 16])
def test_a_nonsense_cost_curve_file_is_measured_again(tmp_path, seconds):
    model = tiny_llama()
    record = {"key": "k", "seconds_by_context": {"8": [0.1] * 16, "16": seconds}}
    cost_curve.curve_path("k", tmp_path).write_text(json.dumps(record))
    costs = cost_curve.cached(model, "k", tmp_path, max_width=3, contexts=(8, 16)).at(12)
    assert costs[0] == 1.0 and all(c > 0 for c in costs)
    saved = json.loads(cost_curve.curve_path("k", tmp_path).read_text())["seconds_by_context"]
    assert all(s > 0 for curve in saved.values() for s in curve)


# Fuzzing ------------------------------------------------------------------------------------


class Mutation:
    """One change to a layout, with a readable repr for hypothesis's falsifying examples."""

    def __init__(self, text: str, apply):
        self.text, self.apply = text, apply

    def __call__(self, layout):
        self.apply(layout)

    def __repr__(self):
        return self.text[:300]


INTERESTING_INTS = [0, 1, 2, 3, 31, 32, 64, 256, 300, 2**31 - 1, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]
KEYS = [
    "general.alignment",
    "general.architecture",
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
]
_RANGES = {
    0: (0, 255),
    1: (-128, 127),
    2: (0, 2**16 - 1),
    3: (-(2**15), 2**15 - 1),
    4: (0, 2**32 - 1),
    5: (-(2**31), 2**31 - 1),
    10: (0, 2**64 - 1),
    11: (-(2**63), 2**63 - 1),
}


def scalar(type_id: int) -> st.SearchStrategy:
    if type_id in _RANGES:
        low, high = _RANGES[type_id]
        return st.one_of(
            st.sampled_from([v for v in INTERESTING_INTS + [-1] if low <= v <= high]), st.integers(low, high)
        )
    if type_id in (6, 12):
        return st.floats(width=32 if type_id == 6 else 64, allow_nan=True, allow_infinity=True)
    if type_id == 7:
        return st.booleans()
    return st.text(max_size=12) | st.sampled_from(["gpt2", "llama", "linear", "", "{{ raise_exception('x') }}"])


@st.composite
def metadata_values(draw) -> craft.Value:
    type_id = draw(st.sampled_from([*range(0, 8), 10, 11, 12, 8, 8, 9, 9]))
    if type_id != 9:
        return craft.Value(type_id, draw(scalar(type_id)))
    item_type = draw(st.sampled_from([0, 4, 5, 6, 7, 8, 10]))
    return craft.Value(9, draw(st.lists(scalar(item_type), max_size=8)), item_type)


@st.composite
def header_changes(draw):
    choice = draw(st.sampled_from(["magic", "version", "counts"]))
    if choice == "magic":
        magic = draw(st.binary(min_size=4, max_size=4) | st.just(b"FUGG"))
        return Mutation(f"magic={magic!r}", lambda layout: setattr(layout, "magic", magic))
    if choice == "version":
        version = draw(st.sampled_from([0, 1, 2, 4, 2**24 * 3, 2**32 - 1]) | st.integers(0, 2**32 - 1))
        return Mutation(f"version={version}", lambda layout: setattr(layout, "version", version))
    extra = draw(st.sampled_from([-1, 1, 2**20, 2**40]))
    which = draw(st.sampled_from([0, 1]))

    def change(layout):
        counts = [len(layout.tensors), len(layout.metadata)]
        counts[which] = max(counts[which] + extra, 0)
        layout.counts = tuple(counts)

    return Mutation(f"{['tensor', 'key'][which]} count {extra:+}", change)


@st.composite
def metadata_changes(draw):
    key = draw(st.sampled_from(KEYS) | st.text(max_size=10))
    action = draw(st.sampled_from(["set", "set", "set", "delete", "truncate"]))
    value = draw(metadata_values())
    cut = draw(st.integers(0, VOCAB + 5))

    def change(layout):
        if action == "delete":
            layout.metadata.pop(key, None)
        elif action == "truncate" and isinstance(getattr(layout.metadata.get(key), "value", None), list):
            layout.metadata[key].value = layout.metadata[key].value[:cut]
        else:
            layout.metadata[key] = value

    return Mutation(f"{action} {key!r} ({value if action == 'set' else cut})", change)


@st.composite
def tensor_changes(draw):
    index = draw(st.integers(0, 30))
    field = draw(st.sampled_from(["name", "ne", "type_id", "offset"]))
    if field == "name":
        value = draw(
            st.sampled_from(
                [
                    "token_embd.weight",
                    "blk.0.attn_q.weight",
                    "blk.9.attn_q.weight",
                    "blk.x.attn_q.weight",
                    "output.weight",
                    "rope_freqs.weight",
                    "",
                ]
            )
            | st.text(max_size=20)
        )
    elif field == "ne":
        value = draw(st.lists(st.sampled_from(INTERESTING_INTS) | st.integers(0, 4096), max_size=5))
    elif field == "type_id":
        value = draw(st.integers(0, 45))
    else:
        value = draw(st.sampled_from([0, 32, -32, 2**62, 2**64 - 32]) | st.integers(0, 2**20).map(lambda n: n * 32))

    def change(layout):
        setattr(layout.tensors[index % len(layout.tensors)], field, value)

    return Mutation(f"tensor #{index} {field}={value!r}", change)


FUZZ_CASES = {"tried": 0, "one-line errors": 0, "loads": 0, "tracebacks": 0}


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    changes=st.lists(
        st.one_of(header_changes(), metadata_changes(), tensor_changes(), tensor_changes()), min_size=1, max_size=3
    )
)
def test_fuzzed_gguf_files_load_or_give_one_line(tiny_layout, tmp_path, changes):
    layout = copy.deepcopy(tiny_layout)
    for change in changes:
        change(layout)
    path = craft.write(layout, tmp_path / "fuzzed.gguf")
    FUZZ_CASES["tried"] += 1
    try:
        _load_and_run(path)
    except ModelError as error:
        message = str(error)
        assert message and "\n" not in message and len(message) < 600, message
        FUZZ_CASES["one-line errors"] += 1
    except Exception:
        FUZZ_CASES["tracebacks"] += 1
        raise
    else:
        FUZZ_CASES["loads"] += 1


def test_fuzz_counts_are_reported(capsys):
    """Runs after the fuzz test (file order): prints its counts for the record (-s shows them)."""
    if FUZZ_CASES["tried"]:
        with capsys.disabled():
            print(
                f"\nGGUF fuzz: {FUZZ_CASES['tried']} cases tried, {FUZZ_CASES['one-line errors']} one-line errors, "
                f"{FUZZ_CASES['loads']} correct loads, {FUZZ_CASES['tracebacks']} tracebacks"
            )


@pytest.mark.parametrize("dtype", ["quantized", "float32"])
def test_a_quantized_bias_loads_as_its_dequantized_values(tmp_path, dtype):
    """Only a matrix's weight becomes an MLX triple: a Q8_0 expert bias (2-D, rows of 32) is dequantized."""
    path = llama_cpp_tiny.write(llama_cpp_tiny.ARCHS["gpt-oss"], tmp_path / "gpt-oss.gguf", matrices="q8_0")
    gguf_file = read_gguf(path)
    info = gguf_file.tensors["blk.0.ffn_gate_exps.bias"]
    assert info.ggml_type == Q.Q8_0
    expected = dequantize(gguf_file.tensor_bytes(info).reshape(info.shape[0], -1), Q.Q8_0)
    loaded = load_model(str(path), dtype=dtype)
    assert np.array_equal(np.array(loaded.model.model.layers[0].mlp.experts.gate_proj.bias), expected)
