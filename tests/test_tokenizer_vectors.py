"""llama.cpp's tokenizer test vectors, one case per vocabulary family: akunu must give llama.cpp's ids.

The fixtures (tests/fixtures/vocab/, from scripts/record_tokenizer_vectors.py) hold llama.cpp's inputs and
ids and the part of each real vocabulary the inputs reach. llama.cpp encodes them without BOS and with
special-token parsing off, so the same is asked of akunu here.
"""

from __future__ import annotations

import functools
import json

import pytest

from akunu.models.stop_tokens import end_of_generation_ids
from akunu.models.tokenizer import Tokenizer
from tests.vocab_fixtures import VOCAB_FIXTURES, families, load, metadata_from_fixture

FAMILIES = families()


@functools.cache
def _tokenizer(family: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata_from_fixture(load(family)), source=family)


def _id(tokenizer: Tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_bos=False)
    assert len(ids) == 1, f"{text!r} is not one token"
    return ids[0]


def test_every_family_of_llama_cpp_vocab_tests_is_recorded():
    expected = {"command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe"}
    expected |= {"llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"}
    assert set(FAMILIES) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_match_llama_cpp(family):
    fixture = load(family)
    tokenizer = _tokenizer(family)
    failed = [
        (text, expected, got)
        for text, expected in fixture["cases"]
        if (got := tokenizer.encode(text, add_bos=False, parse_special=False)) != expected
    ]
    total = len(fixture["cases"])
    assert not failed, f"{family}: {total - len(failed)}/{total} as llama.cpp; first miss: {failed[0]}"


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_gives_back_the_input(family):
    tokenizer = _tokenizer(family)
    for text, expected in load(family)["cases"]:
        assert tokenizer.decode(expected) == text


@pytest.mark.parametrize("family", [f for f in FAMILIES if "llama_cpp_eog_ids" in load(f)])
def test_end_of_generation_ids_match_llama_cpp(family):
    tokenizer = _tokenizer(family)
    assert tokenizer.eos_ids == _llama_cpp_stops(tokenizer, load(family)["llama_cpp_eog_ids"])


def _llama_cpp_stops(tokenizer: Tokenizer, llama_cpp_eog_ids: list[int]) -> frozenset[int]:
    """llama.cpp's end-of-generation ids, less any "</s>" but a declared EOS: llama.cpp stops on every "</s>",
    which in Qwen's and Gemma's vocabularies is an ordinary token (HTML's strike-through tag)."""
    return frozenset(i for i in llama_cpp_eog_ids if tokenizer.decode([i]) != "</s>" or i == tokenizer.eos_id)


@pytest.mark.parametrize("family", [f for f in FAMILIES if "llama_cpp_prompts" in load(f)])
def test_prompts_with_special_tokens_match_llama_cpp(family):
    tokenizer = _tokenizer(family)
    for text, expected in load(family)["llama_cpp_prompts"]:
        assert tokenizer.encode(text) == expected, text


def test_control_tokens_are_text_without_parse_special_but_user_defined_ones_stay_tokens():
    qwen = _tokenizer("qwen2")
    im_end = _id(qwen, "<|im_end|>")
    as_text = qwen.encode("<|im_end|>", add_bos=False, parse_special=False)
    assert im_end not in as_text and len(as_text) > 1 and qwen.decode(as_text) == "<|im_end|>"
    gemma = _tokenizer("gemma-4")
    turn = _id(gemma, "<|turn>")
    assert turn not in gemma.encode("<|turn>", add_bos=False, parse_special=False)
    tool_call = _id(gemma, "<|tool_call>")  # user-defined: llama.cpp matches it even with parsing off
    assert gemma.encode("a<|tool_call>b", add_bos=False, parse_special=False)[1] == tool_call
    spm = _tokenizer("llama-spm")
    assert spm.encode("</s>", add_bos=False) == [spm.eos_id]
    assert spm.eos_id not in spm.encode("</s>", add_bos=False, parse_special=False)


def test_gemma4_bos_and_newline_runs():
    gemma = _tokenizer("gemma-4")
    assert gemma.add_bos and gemma.encode("Hi")[0] == gemma.bos_id
    # A run of newlines that is one token stays one token, however its merges would pair it up.
    assert gemma.encode("\n\n\n", add_bos=False) == [_id(gemma, "\n\n\n")]


STOPS = {
    "qwen2": {"<|endoftext|>", "<|im_end|>"},
    "qwen35": {"<|endoftext|>", "<|im_end|>"},
    "llama-bpe": {"<|end_of_text|>", "<|eot_id|>"},
    "phi-3": {"<|endoftext|>", "<|end|>"},  # not its user-defined "</s>", which llama.cpp also stops on
    "gemma-4": {"<eos>", "<turn|>", "<|tool_response>"},
    "llama-spm": {"</s>"},
    "command-r": {"<|END_OF_TURN_TOKEN|>", "<PAD>"},  # llama.cpp takes "<PAD>" for a FIM pad
}


@pytest.mark.parametrize("family", sorted(STOPS))
def test_generation_stops_on_the_family_end_of_turn_tokens(family):
    tokenizer = _tokenizer(family)
    stops = {tokenizer.decode([i]) for i in tokenizer.eos_ids}
    assert stops == STOPS[family]


def test_harmony_ends_a_turn_at_return_or_call_not_at_end():
    tokens = ["a", "<|start|>", "<|end|>", "<|message|>", "<|return|>", "<|call|>", "<|endoftext|>"]
    ids = end_of_generation_ids(tokens, declared=[6])
    assert {tokens[i] for i in ids} == {"<|return|>", "<|call|>", "<|endoftext|>"}
    # Without harmony's <|return|> and <|call|>, <|end|> is Phi-3's end of turn.
    assert {tokens[i] for i in end_of_generation_ids(tokens[:4], declared=[])} == {"<|end|>"}


@pytest.mark.real_model
def test_qwen2_5_coder_prompts_and_stops_match_llama_cpp(catalogue_model):
    from akunu.models.catalogue import KNOWN

    recorded = json.loads((VOCAB_FIXTURES / "real-qwen2.5-coder-0.5b-instruct.json").read_text(encoding="utf-8"))
    (name,) = [entry.name for entry in KNOWN.values() if entry.filename == recorded["model"]]  # qwen2.5-coder-0.5b
    qwen = Tokenizer.from_gguf(catalogue_model(name))
    assert qwen.eos_ids == _llama_cpp_stops(qwen, recorded["llama_cpp_eog_ids"])
    assert {qwen.decode([i]) for i in qwen.eos_ids} >= {"<|im_end|>", "<|endoftext|>"}
    for text, expected in recorded["llama_cpp_prompts"]:
        assert qwen.encode(text) == expected
