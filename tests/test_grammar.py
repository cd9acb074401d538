"""Constrained decoding (akunu.grammar): outputs follow their schema, with and without speculation.

The models have random weights, so only the grammar keeps their output valid; every output that
finished (ended on EOS) must parse and validate.
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akunu.drafters.base import Draft
from akunu.errors import OptionsError
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.grammar import Constraint, apply_mask, grammar_draft, response_format_grammar, wrapped_json_grammar
from akunu.models.tokenizer import Tokenizer
from akunu.sampling import SamplingParams, target_logprobs
from tests.grammar_fixtures import json_model, json_tokenizer
from tests.stats_tools import fits
from tests.tiny import tiny_llama

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "active": {"type": "boolean"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "role", "tags", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return json_tokenizer()


@pytest.fixture(scope="module")
def model():
    return json_model(seed=3)


def run(model, tokenizer, constraint, *, spec=True, temp=0.0, seed=None, max_tokens=120, exact=False):
    config = GenerationConfig(
        max_tokens=max_tokens,
        sampling=SamplingParams(temp=temp, seed=seed),
        spec=SpecConfig(enabled=spec, exact=exact),
    )
    return generate(
        model, tokenizer, tokenizer.encode('{"name":"ab","role":"user"} {"name":"'), config, constraint=constraint
    )


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("temp", [0.0, 1.0], ids=["greedy", "sampled"])
def test_output_validates_against_the_schema(model, tokenizer, spec, temp):
    for seed in range(2):
        text, _, stats = run(
            model, tokenizer, Constraint.json_schema(PERSON, tokenizer), spec=spec, temp=temp, seed=seed
        )
        assert stats.finish_reason == "stop", text
        assert_valid(text, PERSON)


def test_json_object_gives_an_object(model, tokenizer):
    for seed in range(3):
        text, _, stats = run(model, tokenizer, Constraint.json_object(tokenizer), temp=1.0, seed=seed, max_tokens=200)
        if stats.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_a_forced_tool_call_is_prefix_json_suffix(model, tokenizer):
    call = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": PERSON},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    for separator in (None, "\n"):
        grammar = wrapped_json_grammar("<call>", {"anyOf": [call]}, "</call>", separator=separator)
        config = GenerationConfig(max_tokens=200, sampling=SamplingParams(temp=1.0, seed=4), grammar=grammar)
        text, _, stats = generate(model, tokenizer, tokenizer.encode("call:"), config)
        assert stats.finish_reason == "stop", text
        for piece in text.split("\n"):
            assert piece.startswith("<call>") and piece.endswith("</call>")
            assert_valid(piece[len("<call>") : -len("</call>")], call)


def test_response_format_strict_refuses_what_lenient_ignores(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    loose = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    Constraint(response_format_grammar(loose), tokenizer)
    with pytest.raises(OptionsError):
        Constraint(
            response_format_grammar({**loose, "json_schema": {**loose["json_schema"], "strict": True}}), tokenizer
        )
    assert response_format_grammar({"type": "text"}) is None


@pytest.mark.parametrize("keyword", ["not", "if", "uniqueItems"])
def test_a_keyword_that_cannot_be_enforced_is_refused_strict_or_not(tokenizer, keyword):
    value = {"not": {"type": "string"}, "if": {"type": "integer"}, "uniqueItems": True}[keyword]
    schema = {"type": "object", "properties": {"a": {keyword: value}}}
    for strict in (True, False, None):
        spec = {"name": "x", "schema": schema, **({} if strict is None else {"strict": strict})}
        with pytest.raises(OptionsError, match=f'"{keyword}"'):
            Constraint(response_format_grammar({"type": "json_schema", "json_schema": spec}), tokenizer)
    with pytest.raises(OptionsError, match=f'"{keyword}"'):  # a forced tool call's parameters
        wrapped_json_grammar("<call>", schema, "</call>")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
def test_greedy_output_is_the_same_with_and_without_speculation(model, tokenizer, exact):
    constraint = Constraint.json_schema(PERSON, tokenizer)
    plain = run(model, tokenizer, constraint, spec=False, exact=exact)
    fast = run(model, tokenizer, constraint, spec=True, exact=exact)
    assert fast[2].drafted > 0 and fast[2].forward_passes < plain[2].forward_passes
    assert fast[1] == plain[1]


def test_forced_tokens_are_drafted_and_forbidden_drafts_cut(tokenizer):
    schema = {"type": "object", "properties": {"name": {"const": "x"}}, "required": ["name"]}
    constraint = Constraint.json_schema(schema, tokenizer)
    constraint.reset()
    draft, own = grammar_draft(constraint, Draft(tokenizer.encode("[1,2]")), limit=10)
    assert tokenizer.decode(draft.tokens).startswith('{"'), "what the grammar forces is drafted"
    assert own == 0, "a proposal that disagrees with the forced tokens is dropped"
    ok = tokenizer.encode('{"name": "x"}')
    draft, own = grammar_draft(constraint, Draft(ok + tokenizer.encode("zz")), limit=20)
    assert tokenizer.decode(draft.tokens) == '{"name": "x"}' and own == len(ok), "cut at the first forbidden token"
    assert constraint.matcher.compute_ff_bytes().startswith(b'{"'), "drafting left the grammar state alone"


def test_masks_follow_the_draft_and_leave_the_state(tokenizer):
    constraint = Constraint.json_schema({"enum": ["true", "false"]}, tokenizer)  # the JSON strings
    constraint.reset()
    quote = tokenizer.encode('"')
    masks = constraint.masks(quote, 128)
    first, second = ({i for i, allowed in enumerate(row.tolist()) if allowed} for row in masks)
    assert tokenizer.encode('"')[0] in first and tokenizer.encode("t")[0] not in first
    assert {tokenizer.encode("t")[0], tokenizer.encode("true")[0], tokenizer.encode("f")[0]} <= second
    assert not any(row[109:].any().item() for row in masks), "padding rows past the vocabulary are never allowed"
    assert constraint.masks([], 128)[0].tolist() == masks[0].tolist(), "the state is back after the draft"


def test_a_bad_schema_is_one_clear_error(tokenizer):
    with pytest.raises(OptionsError):
        Constraint.json_schema(["not", "a", "schema"], tokenizer)
    with pytest.raises(OptionsError):
        Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, tokenizer)


# Random schemas -----------------------------------------------------------------------------

leaf_schemas = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 99),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(
        st.one_of(st.text("abc", max_size=3), st.integers(0, 9), st.booleans()), min_size=1, max_size=3, unique=True
    ).map(lambda values: {"enum": values}),
)


def _object(properties: dict, required_mask: list[bool]) -> dict:
    names = list(properties)
    required = [name for name, keep in zip(names, required_mask) if keep]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


schemas = st.recursive(
    leaf_schemas,
    lambda inner: st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 2)),
        st.dictionaries(st.text("xyz", min_size=1, max_size=3), inner, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
                lambda m: _object(props, m)
            )
        ),
    ),
    max_leaves=5,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(schema=schemas, seed=st.integers(0, 2**16), spec=st.booleans())
def test_random_schemas_give_valid_output(model, tokenizer, schema, seed, spec):
    constraint = Constraint.json_schema(schema, tokenizer)
    text, _, stats = run(model, tokenizer, constraint, spec=spec, temp=1.0, seed=seed, max_tokens=60)
    if stats.finish_reason == "stop":  # an output cut at max_tokens is a prefix of a valid one, not one
        assert_valid(text, schema)


# The constrained distribution through speculation --------------------------------------------

# Eight tokens; the grammar allows "abc", "cab" and "d" runs, so it masks tokens, forces "bc" after "a",
# and lets the output end (EOS) after any whole word.
PIECES = ["<eos>", "a", "b", "c", "ab", "bc", "ca", "d"]
GRAMMAR = "start: /(abc|cab|d)+/"
PROMPT = [1, 5, 7, 3, 4, 7, 6, 2, 1, 5, 7, 3, 4, 7, 6, 2, 1, 5]  # valid words, so the drafter proposes valid runs


def eight_token_tokenizer() -> Tokenizer:
    def encode(text):
        ids, at = [], 0
        while at < len(text):
            token = max((i for i in range(1, 8) if text.startswith(PIECES[i], at)), key=lambda i: len(PIECES[i]))
            ids.append(token)
            at += len(PIECES[token])
        return ids

    return Tokenizer(
        encode_plain=encode, encode_text=encode, pieces=PIECES, token_bytes=[p.encode() for p in PIECES],
        special_ids=frozenset({0}), bos_id=None, eos_id=0, eos_ids=frozenset({0}), add_bos=False, chat_template=None,
    )  # fmt: skip


def exact_constrained_probs(model, tokenizer, params, length: int) -> dict:
    """P(sequence) under the masked target distribution, by enumeration (EOS ends a sequence)."""
    constraint = Constraint.lark(GRAMMAR, tokenizer)
    probs, done = {(): 1.0}, {}
    for _ in range(length):
        grown = {}
        for prefix, p in probs.items():
            constraint.reset()
            constraint.commit(prefix)
            logits = apply_mask(model(mx.array([PROMPT + list(prefix)]))[0, -1], constraint.masks([], 8)[0])
            step = mx.exp(target_logprobs(logits, params)).tolist()
            for token, q in enumerate(step):
                if q > 0 and token == 0:  # the output ends; EOS is not among the generated ids
                    done[prefix] = p * q
                elif q > 0:
                    grown[prefix + (token,)] = p * q
        probs = grown
    return {**done, **probs}


@pytest.mark.slow
def test_speculation_keeps_the_constrained_distribution():
    params = SamplingParams(temp=0.8, top_p=0.9)  # the filters apply to the masked distribution
    model, tokenizer, runs, length = tiny_llama(vocab=8, seed=5, sharpness=1.5), eight_token_tokenizer(), 800, 4
    exact = exact_constrained_probs(model, tokenizer, params, length)
    constraint = Constraint.lark(GRAMMAR, tokenizer)
    for spec in (False, True):
        mx.random.seed(99)
        config = GenerationConfig(
            max_tokens=length, sampling=params, spec=SpecConfig(enabled=spec, draft_tokens=3, draft_length="fixed")
        )
        counts, drafted = Counter(), 0
        for _ in range(runs):
            _, ids, stats = generate(model, tokenizer, PROMPT, config, constraint=constraint)
            counts[tuple(ids)] += 1
            drafted += stats.drafted
        ok, stat, critical = fits(counts, exact, runs)
        assert ok, f"spec={spec}: chi2 {stat:.1f} >= {critical:.1f}"
        assert drafted > 0 or not spec
