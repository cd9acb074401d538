"""`akunu generate --draft/--draft-model/--ngram-cache/--tree` reach the engine and keep greedy output."""

import pytest

from akunu.drafters import DEFAULT_SPEC
from akunu.drafters.base import NGramDrafter
from akunu.drafters.draft_model import ModelDrafter
from akunu.drafters.hybrid import HybridDrafter
from akunu.drafters.lookup import LookupDrafter
from akunu.drafters.ngram_cache import CachedNGramDrafter
from akunu.drafters.tree import NGramTreeDrafter
from tests.fakes import fake_tokenizer_of, invoke

PROMPT = "abcabcabcabc"


def plain_text():
    result = invoke("generate", PROMPT, "--no-spec", "--max-tokens", "24")
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize(
    "options, kind",
    [
        (["--draft", "layer-skip:1"], ModelDrafter),
        (["--draft", "hybrid:layer-skip:1"], HybridDrafter),
        (["--draft-model", "tiny-model"], ModelDrafter),
        (["--tree", "6"], NGramTreeDrafter),
        (["--draft", "ngram"], NGramDrafter),
        (["--draft", "lookup"], LookupDrafter),
    ],
    ids=["layer-skip", "hybrid", "draft-model", "tree", "ngram", "lookup"],
)
def test_drafter_options_reach_the_engine_and_keep_the_output(fake_engine, options, kind):
    expected = plain_text()
    result = invoke("generate", PROMPT, "--max-tokens", "24", *options)
    assert result.exit_code == 0, result.output
    assert isinstance(fake_engine.streams[-1]["drafter"], kind)
    assert result.stdout == expected


def test_the_default_passes_no_drafter(fake_engine):
    assert invoke("generate", PROMPT).exit_code == 0
    assert invoke("generate", PROMPT, "--draft", DEFAULT_SPEC).exit_code == 0  # the option's default is the engine's
    assert [stream["drafter"] for stream in fake_engine.streams[-2:]] == [None, None]


def test_the_ngram_cache_file_is_written_after_the_run(fake_engine, tmp_path):
    path = tmp_path / "ngrams.cache"
    expected = plain_text()
    result = invoke("generate", PROMPT, "--max-tokens", "24", "--ngram-cache", str(path))
    assert result.exit_code == 0, result.output
    drafter = fake_engine.streams[-1]["drafter"]  # the default, lookup over the cached n-gram tables
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.fallback, CachedNGramDrafter)
    assert path.exists() and result.stdout == expected


@pytest.mark.parametrize(
    "options, message",
    [
        (["--no-spec", "--draft", "layer-skip:1"], "need speculative decoding"),
        (["--draft", "layer-skip:1", "--draft-model", "x"], "either --draft-model or --draft"),
        (["--draft", "warp-drive"], "unknown drafter"),
        (["--tree", "4", "--draft", "layer-skip:1"], "--tree works with the plain n-gram drafter only"),
    ],
)
def test_conflicting_or_unknown_drafter_options_are_one_line_errors(fake_engine, options, message):
    result = invoke("generate", PROMPT, *options)
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    "options", [["--draft-model", "other"], ["--draft", "hybrid:model:other"]], ids=["draft-model", "hybrid-spec"]
)
def test_a_draft_model_with_another_tokenizer_is_refused_before_any_weights_load(fake_engine, monkeypatch, options):
    import akunu.models

    monkeypatch.setattr(akunu.models, "load_tokenizer", lambda spec, progress=None: fake_tokenizer_of(spec))
    result = invoke("generate", "--model", "tiny-model", PROMPT, *options)
    assert result.exit_code == 2, result.output
    assert "draft model other uses a different tokenizer (token 1 differs)" in result.stderr
    assert fake_engine.loads == []  # neither the target's weights nor the draft's


def test_a_draft_model_with_the_same_tokenizer_is_checked_then_loaded(fake_engine):
    result = invoke("generate", "--model", "tiny-model", PROMPT, "--max-tokens", "4", "--draft-model", "tiny-draft")
    assert result.exit_code == 0, result.output
    assert fake_engine.tokenizer_loads == ["tiny-model", "tiny-draft"]
    assert [load["spec"] for load in fake_engine.loads] == ["tiny-model", "tiny-draft"]


def test_draft_model_names_are_read_from_a_spec_as_make_drafter_reads_it():
    from akunu.drafters.specs import draft_model_names

    assert draft_model_names("suffix+ngram") == []
    assert draft_model_names("model:a") == ["a"]
    assert draft_model_names("ngram+model:a") == ["a"]
    assert draft_model_names("hybrid:model:b") == ["b"]
    assert draft_model_names("model:a+model:b") == ["a", "b"]
    assert draft_model_names("model:") == []
