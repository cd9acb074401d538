"""Tokenizers rebuilt from GGUF metadata: synthetic vocabularies for exact behaviour, the real SmolLM2
(byte-level BPE) and Gemma 3 (sentencepiece) files for fidelity, plus cross-checks against transformers."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from akunu.errors import ModelError
from akunu.models.detokenizer import StreamingDetokenizer, byte_level_alphabet
from akunu.models.gguf_vocab import TokenType
from akunu.models.special_tokens import special_splitter
from akunu.models.tokenizer import Tokenizer

ROUND_TRIP_TEXTS = [
    "Hello world",
    "Héllo wörld, àçcénts: naïve café, Ærøskøbing, ß ñ ü",
    "日本語のテキストと中文字符，한국어 텍스트",
    "emoji 😀👍🏽🇯🇵 ❤️ and ZWJ family 👨‍👩‍👧",
    "def f(x):\n\treturn x  *   2\n\n\n    # indented\twith\ttabs",
    "  leading and trailing spaces   ",
    "numbers 1234567890 3.14159 1,000,000 ²³ ½",
    "<html><body><table><tr><td>cell</td></tr></table></body></html>",
    "line one\r\nline two\n\n\nline five\t\t",
    "\u200b zero width, \u00a0nbsp, \ufeff bom",
    "",
    " ",
    "\n",
]


# Synthetic vocabularies ---------------------------------------------------------------------


def test_byte_level_alphabet_matches_gpt2():
    alphabet = byte_level_alphabet()
    assert len(alphabet) == 256 and sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == 0x20 and alphabet["Ċ"] == 0x0A and alphabet["ĉ"] == 0x09 and alphabet["A"] == 0x41


def _byte_level_metadata(pre: str) -> dict:
    symbols = sorted(byte_level_alphabet(), key=byte_level_alphabet().get)  # id == byte value
    merged = ["Ġw", "Ġwo", "hi", "12", "<|", "|>"]
    tokens = symbols + merged + ["<|end|>", "<think>"]
    types = [TokenType.NORMAL] * (len(tokens) - 2) + [TokenType.CONTROL, TokenType.USER_DEFINED]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.merges": ["Ġ w", "Ġw o", "h i", "1 2", "< |", "| >"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 2,
        "tokenizer.ggml.eos_token_id": len(tokens) - 2,
        "tokenizer.ggml.add_bos_token": False,
    }


def test_synthetic_byte_level_bpe_merges_specials_and_bytes():
    tok = Tokenizer.from_gguf_metadata(_byte_level_metadata("gpt2"))
    end, think = tok.vocab_size - 2, tok.vocab_size - 1
    hi, g_wo = 256 + 2, 256 + 1
    assert tok.encode("hi wo") == [hi, g_wo]
    assert tok.encode("hi<|end|>hi<think>") == [hi, end, hi, think]
    assert tok.encode("<|x|>") == [256 + 4, ord("x"), 256 + 5]  # "<|" and "|>" merge, but no special is there
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.special_ids == frozenset({end}) and tok.eos_ids == frozenset({end})
    for text in ROUND_TRIP_TEXTS + ["hi<|end|> wo<think>"]:
        assert tok.decode(tok.encode(text)) == text


def test_pre_tokenizer_follows_the_pre_type():
    # GPT-2's regex keeps "12" together; SmolLM2/StarCoder isolate every digit first (llama.cpp: \p{N} then GPT-2).
    assert Tokenizer.from_gguf_metadata(_byte_level_metadata("gpt2")).encode("12") == [256 + 3]
    assert Tokenizer.from_gguf_metadata(_byte_level_metadata("smollm")).encode("12") == [ord("1"), ord("2")]


def test_unknown_pre_type_falls_back_to_gpt2_with_a_warning(caplog):
    tok = Tokenizer.from_gguf_metadata(_byte_level_metadata("something-new"))
    assert tok.encode("12 wo") == [256 + 3, 256 + 1]
    assert "something-new" in caplog.text


def test_unsupported_tokenizer_model_is_a_model_error():
    with pytest.raises(ModelError, match="'rwkv'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})


SP_WORDS = [
    "▁",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "▁h",
    "ll",
    "▁he",
    "llo",
    "▁hello",
    "el",
    "▁w",
    "or",
    "▁wor",
    "ld",
    "▁world",
]


def _sentencepiece_metadata() -> dict:
    # Llama-2 style: dummy prefix, BOS added, <unk> marked CONTROL as many GGUF files do.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + SP_WORDS
    types = [TokenType.CONTROL] * 3 + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(SP_WORDS)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.array([0.0] * 259 + [-float(i) for i in range(len(SP_WORDS))], dtype=np.float32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": True,
    }


def test_synthetic_sentencepiece_merges_by_score_with_dummy_prefix():
    tok = Tokenizer.from_gguf_metadata(_sentencepiece_metadata())
    word = {piece: 259 + i for i, piece in enumerate(SP_WORDS)}
    assert tok.encode("hello world", add_bos=False) == [word["▁hello"], word["▁world"]]
    # "▁he" outranks "el", so "hel" is ▁he + l, not ▁h + el.
    assert tok.encode("hel", add_bos=False) == [word["▁he"], word["l"]]
    assert tok.encode("hello") == [1, word["▁hello"]]
    # BOS written in the text is not doubled; a special token is cut out and the text after it gets a dummy prefix.
    assert tok.encode("<s>hello</s>hello") == [1, word["▁hello"], 2, word["▁hello"]]
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    assert tok.encode("é", add_bos=False) == [word["▁"], 3 + 0xC3, 3 + 0xA9]
    assert tok.decode(tok.encode("hello world")) == "<s>hello world"
    assert tok.decode(tok.encode("hello world"), skip_special=True) == "hello world"
    assert tok.token_text(3 + 0xE2) == "<0xE2>" and tok.token_text(word["▁hello"]) == " hello"


def test_synthetic_sentencepiece_round_trips_any_text():
    tok = Tokenizer.from_gguf_metadata(_sentencepiece_metadata())
    for text in ROUND_TRIP_TEXTS:
        # The dummy prefix is removed again on decode, so only a text that itself starts with a space loses one.
        assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_special_splitter_takes_longest_special_at_leftmost_place():
    split = special_splitter({"<a>": 1, "<a>b": 2, "<ab>": 3, "b": 4})
    assert split("x<a>by<a>c<ab>") == [("x", None), ("<a>b", 2), ("y", None), ("<a>", 1), ("c", None), ("<ab>", 3)]
    assert split("") == [] and split("plain") == [("plain", None)]


# Streaming detokenizer ------------------------------------------------------------------------

# "é" = C3 A9 and "😀" = F0 9F 98 80 split across tokens; id 6 is a special token.
SPLIT_TABLE = [b"a", b"\xc3", b"\xa9", b"\xf0\x9f", b"\x98", b"\x80", b"<s>", b" b"]


def test_detokenizer_holds_back_split_characters_until_complete():
    detokenizer = StreamingDetokenizer(SPLIT_TABLE)
    emitted = [detokenizer.add(token) for token in [0, 1, 2, 3, 4, 5, 7]]
    assert emitted == ["a", "", "é", "", "", "😀", " b"]
    assert detokenizer.flush() == "" and detokenizer.text == "aé😀 b"


def test_detokenizer_flush_marks_an_unfinished_character():
    detokenizer = StreamingDetokenizer(SPLIT_TABLE)
    assert [detokenizer.add(token) for token in [0, 3, 4]] == ["a", "", ""]
    assert detokenizer.flush() == "\ufffd" and detokenizer.text == "a\ufffd"


def test_detokenizer_strips_the_dummy_prefix_space_of_the_first_ordinary_token_only():
    detokenizer = StreamingDetokenizer(SPLIT_TABLE, special_ids=frozenset({6}), strip_leading_space=True)
    assert [detokenizer.add(token) for token in [6, 7, 7]] == ["<s>", "b", " b"]


def test_detokenizer_ignores_ids_outside_the_vocabulary():
    detokenizer = StreamingDetokenizer(SPLIT_TABLE)
    assert detokenizer.add(0) == "a" and detokenizer.add(10_000) == "" and detokenizer.add(-1) == ""


# Real models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path(catalogue_model) -> Path:
    return Path(os.environ.get("AKUNU_TEST_SMOLLM2") or catalogue_model("smollm2-135m"))


@pytest.fixture(scope="module")
def gemma3_path(catalogue_model) -> Path:
    return Path(os.environ.get("AKUNU_TEST_GEMMA3") or catalogue_model("gemma3-270m"))


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def gemma3(gemma3_path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_path)


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_path) -> list[str]:
    from akunu.models.gguf_file import read_gguf

    return list(read_gguf(smollm2_path).metadata["tokenizer.ggml.tokens"])


@pytest.mark.real_model
def test_smollm2_metadata(smollm2, smollm2_vocab):
    assert smollm2.vocab_size == 49152 and smollm2.bos_id == 1 and smollm2.eos_id == 2 and not smollm2.add_bos
    assert smollm2_vocab[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # <|im_end|> as declared, plus <|endoftext|> and the FIM repository marker <reponame>, as llama.cpp stops
    assert smollm2.eos_ids == frozenset({0, 2, 4})
    assert smollm2.has_chat_template


@pytest.mark.real_model
def test_smollm2_known_ids(smollm2, smollm2_vocab):
    ids = {piece: i for i, piece in enumerate(smollm2_vocab)}
    assert smollm2.encode("<|im_start|>") == [1] and smollm2.encode("<|im_end|>") == [2]
    assert smollm2.encode("Hello world") == [ids["Hello"], ids["Ġworld"]]
    assert smollm2.encode("<|im_start|>user\nHi<|im_end|>") == [1, ids["user"], ids["Ċ"], ids["Hi"], 2]
    # SmolLM2's HF pre-tokenizer isolates digits before byte-level BPE, so " 2024" is "Ġ" and four digits.
    assert smollm2.encode(" 2024") == [ids["Ġ"], ids["2"], ids["0"], ids["2"], ids["4"]]
    # ...and the GPT-2 regex then runs on "x\n\n" alone, where the newline run ends the piece and stays whole.
    assert smollm2.encode("x\n\n1") == [ids["x"], ids["ĊĊ"], ids["1"]]
    assert smollm2.encode("é") == [ids["Ã©"]]


@pytest.mark.real_model
def test_smollm2_chatml_rendering(smollm2):
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    prompt = smollm2.apply_chat_template(messages)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm2.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 4 and ids.count(2) == 3


@pytest.mark.real_model
def test_encode_chat_is_the_rendered_conversation_ready_for_the_answer(smollm2, gemma3):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = smollm2.encode_chat(messages)
    assert ids == smollm2.encode(smollm2.apply_chat_template(messages))
    assert smollm2.decode(ids).endswith("What is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.decode(smollm2.encode_chat(messages, add_generation_prompt=False)).endswith("<|im_end|>\n")
    with pytest.raises(ModelError, match="no chat template"):
        gemma3.encode_chat(messages)


@pytest.mark.real_model
def test_gemma3_metadata_and_special_tokens(gemma3):
    assert gemma3.vocab_size == 262144 and gemma3.bos_id == 2 and gemma3.eos_id == 1 and gemma3.add_bos
    assert gemma3.eos_ids == frozenset({1, 106})  # <eos> and <end_of_turn>
    assert not gemma3.has_chat_template and gemma3.chat_template is None
    with pytest.raises(ModelError, match="no chat template"):
        gemma3.apply_chat_template([{"role": "user", "content": "hi"}])
    assert gemma3.encode("<start_of_turn>user\n", add_bos=False)[:1] == [105]
    assert gemma3.encode("Hi") == [2, *gemma3.encode("Hi", add_bos=False)]
    assert gemma3.encode("<bos>Hi") == gemma3.encode("Hi")  # a BOS written in the prompt is not doubled


@pytest.mark.real_model
def test_gemma3_user_defined_tokens(gemma3):
    # Whitespace runs, newlines and HTML tags are single user-defined tokens in Gemma's vocabulary.
    assert gemma3.encode("\n\n", add_bos=False) == [108]
    assert gemma3.encode("a  b", add_bos=False)[1] == 138  # "  " is token 138 ("▁▁" in tokenizer.model)
    assert gemma3.encode("<table>", add_bos=False) == [168]
    assert gemma3.encode("\t\t", add_bos=False) == [255969]


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_round_trip(model, request):
    tok: Tokenizer = request.getfixturevalue(model)
    for text in ROUND_TRIP_TEXTS:
        assert tok.decode(tok.encode(text, add_bos=False)) == text


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_streaming_detokenizer_never_emits_half_a_character(model, request):
    tok: Tokenizer = request.getfixturevalue(model)
    text = "Streaming 日本語の文章 and emoji 😀🎉👍🏽, ünïcödé ✓ 한국어 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done."
    ids = tok.encode(text, add_bos=False)
    # The test only means something if some token holds part of a character.
    assert any("\ufffd" in tok.decode([token]) for token in ids)
    detokenizer = tok.detokenizer()
    segments = [detokenizer.add(token) for token in ids] + [detokenizer.flush()]
    assert all("\ufffd" not in segment for segment in segments)
    assert "".join(segments) == detokenizer.text == tok.decode(ids) == text


@pytest.mark.real_model
def test_smollm2_from_hf_dir_matches_gguf(smollm2, tmp_path):
    pytest.importorskip("transformers")
    smollm2.to_mlx_lm().save_pretrained(tmp_path)  # forwarded to the HF tokenizer
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    assert (from_dir.bos_id, from_dir.eos_id, from_dir.eos_ids, from_dir.add_bos) == (1, 2, smollm2.eos_ids, False)
    assert from_dir.chat_template == smollm2.chat_template
    for text in ROUND_TRIP_TEXTS + ["<|im_start|>user\nHi 2024<|im_end|>"]:
        assert from_dir.encode(text) == smollm2.encode(text)
        assert from_dir.decode(from_dir.encode(text)) == text


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_to_mlx_lm_wraps_an_equivalent_hf_tokenizer(model, request):
    pytest.importorskip("mlx_lm")
    tok: Tokenizer = request.getfixturevalue(model)
    wrapper = tok.to_mlx_lm()
    assert set(wrapper.eos_token_ids) == set(tok.eos_ids)
    for text in _fuzz_corpus(tok, count=150, seed=1) + ROUND_TRIP_TEXTS:
        assert wrapper.encode(text, add_special_tokens=False) == tok.encode(text, add_bos=False), repr(text)
    ids = tok.encode("Streaming 日本語 😀 done", add_bos=False)
    detokenizer = wrapper.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == "Streaming 日本語 😀 done"


# Independent reference: transformers' own GGUF -> tokenizer conversion ---------------------------------


def _transformers_reference(path: Path, *, split_digits: bool):
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except Exception:  # noqa: BLE001 - older or newer transformers without this module
        pytest.skip("transformers has no GGUF tokenizer conversion here")
    from tokenizers import pre_tokenizers

    from akunu.models.gguf_file import read_gguf

    metadata = read_gguf(path).metadata
    fields = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in metadata
    }
    fields = {name: value.tolist() if isinstance(value, np.ndarray) else value for name, value in fields.items()}
    reference, _ = convert_gguf_tokenizer(metadata["general.architecture"], fields)
    if split_digits:
        # transformers has no entry for pre="smollm"; the original SmolLM2 tokenizer.json isolates digits first.
        reference.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), reference.pre_tokenizer]
        )
    return reference


def _fuzz_corpus(tok: Tokenizer, *, count: int, seed: int) -> list[str]:
    """Strings stitched from random vocabulary pieces, whitespace runs, random code points and special tokens."""
    rng = random.Random(seed)
    specials = sorted(tok.decode([i]) for i in tok.special_ids)
    corpus = []
    while len(corpus) < count:
        parts = []
        for _ in range(rng.randint(1, 10)):
            roll = rng.random()
            if roll < 0.55:
                piece = tok.decode([rng.randrange(tok.vocab_size)])
                parts.append("" if "\ufffd" in piece else piece)
            elif roll < 0.7:
                parts.append(rng.choice([" ", "  ", "\n", "\t", "    ", "\n\n", " \n", "\r\n", "2024", "3.14"]))
            elif roll < 0.9:
                parts.append(
                    "".join(
                        chr(rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0x2FFFF)])) for _ in range(3)
                    )
                )
            else:
                parts.append(rng.choice(specials))
        corpus.append("".join(parts))
    return corpus


@pytest.mark.real_model
@pytest.mark.parametrize(("model", "split_digits"), [("smollm2", True), ("gemma3", False)])
def test_ids_match_transformers_gguf_conversion(model, split_digits, request):
    tok: Tokenizer = request.getfixturevalue(model)
    reference = _transformers_reference(request.getfixturevalue(f"{model}_path"), split_digits=split_digits)
    corpus = ROUND_TRIP_TEXTS + _fuzz_corpus(tok, count=600, seed=0)
    mismatches = [
        text
        for text in corpus
        if tok.encode(text, add_bos=False) != reference.encode(text, add_special_tokens=False).ids
    ]
    assert mismatches == []


# Optional: original HF tokenizers as references ------------------------------------------------------
# AKUNU_TEST_REFERENCE_TOKENIZERS names a folder holding <name>/tokenizer.json of original HF tokenizers
# (llama2, llama3, qwen3, gemma3). Each is turned into the metadata llama.cpp's converter would write,
# rebuilt by us, and must give the original's ids: this pins the pre-tokenizer table and the
# sentencepiece path (dummy prefix, byte fallback) to real tokenizers.


def _reference_tokenizer_file(name: str) -> Path:
    root = os.environ.get("AKUNU_TEST_REFERENCE_TOKENIZERS")
    path = Path(root or "") / name / "tokenizer.json"
    if not root or not path.is_file():
        pytest.skip(f"no reference {name}/tokenizer.json (set AKUNU_TEST_REFERENCE_TOKENIZERS)")
    return path


def _metadata_like_llama_cpp(spec: dict, model: str, pre: str | None) -> dict:
    """What convert_hf_to_gguf.py writes for this tokenizer.json: each id's text and type, and merges or scores."""
    vocab, added = spec["model"]["vocab"], {token["id"]: token for token in spec["added_tokens"]}
    size = max([*vocab.values(), *added]) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [TokenType.UNUSED] * size
    for text, i in vocab.items():
        byte_piece = model == "llama" and len(text) == 6 and text.startswith("<0x")
        tokens[i], types[i] = text, TokenType.BYTE if byte_piece else TokenType.NORMAL
    for i, token in added.items():
        tokens[i], types[i] = token["content"], TokenType.CONTROL if token["special"] else TokenType.USER_DEFINED
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"]["merges"]]
    metadata = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    if model == "gpt2":
        return metadata | {"tokenizer.ggml.pre": pre, "tokenizer.ggml.merges": merges}
    # A sentencepiece BPE piece's score orders its merge: minus the rank of the merge that first makes it.
    scores = [0.0 if len(text) == 1 else -1e9 for text in tokens]
    for rank, merge in enumerate(merges):
        merged = vocab[merge.replace(" ", "", 1)]
        scores[merged] = max(scores[merged], -float(rank))
    return metadata | {"tokenizer.ggml.scores": scores, "tokenizer.ggml.unknown_token_id": 0}


@pytest.mark.parametrize(
    ("name", "model", "pre"), [("llama2", "llama", None), ("llama3", "gpt2", "llama-bpe"), ("qwen3", "gpt2", "qwen2")]
)
def test_rebuilt_tokenizer_matches_original_hf_tokenizer(name, model, pre):
    import json

    import tokenizers

    path = _reference_tokenizer_file(name)
    original = tokenizers.Tokenizer.from_file(str(path))
    rebuilt = Tokenizer.from_gguf_metadata(_metadata_like_llama_cpp(json.loads(path.read_text()), model, pre))
    corpus = (
        ROUND_TRIP_TEXTS
        + ["e\u0301 composed by NFC", "I'M DON'T it's", "x\n\n1"]
        + _fuzz_corpus(rebuilt, count=800, seed=3)
    )
    original_ids = [original.encode(text, add_special_tokens=False).ids for text in corpus]
    assert [rebuilt.encode(text, add_bos=False) for text in corpus] == original_ids
    from_dir = Tokenizer.from_hf_dir(path.parent)
    assert [from_dir.encode(text, add_bos=False) for text in corpus] == original_ids


@pytest.mark.real_model
def test_gemma3_gguf_matches_original_hf_tokenizer(gemma3):
    import tokenizers

    original = tokenizers.Tokenizer.from_file(str(_reference_tokenizer_file("gemma3")))
    corpus = ROUND_TRIP_TEXTS + _fuzz_corpus(gemma3, count=1500, seed=4)
    mismatches = [
        text
        for text in corpus
        if gemma3.encode(text, add_bos=False) != original.encode(text, add_special_tokens=False).ids
    ]
    assert mismatches == []
