"""Benchmark workloads: JSONL parsing and its errors, selection, and the shipped prompts' shape."""

from __future__ import annotations

import json
import re

import pytest

from akunu.bench import CATEGORIES, WorkloadError, load_workload, select, shipped_workload
from akunu.bench.workloads import Prompt, parse_workload


def write(tmp_path, *lines: str):
    path = tmp_path / "workload.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def line(**record) -> str:
    return json.dumps(record)


# Parsing ---------------------------------------------------------------------------------


def test_load_workload_with_default_ids_and_blank_lines(tmp_path):
    path = write(
        tmp_path,
        line(category="rag", prompt="Q1"),
        "",
        line(category="rag", prompt="Q2", id="custom"),
        line(category="chat", prompt="Hi", extra="ignored"),
    )
    assert load_workload(path) == [
        Prompt("rag-1", "rag", "Q1"),
        Prompt("custom", "rag", "Q2"),
        Prompt("chat-1", "chat", "Hi"),
    ]


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"category": "rag", "prompt": "x"', "not valid JSON"),
        ('["rag", "x"]', "expected a JSON object"),
        (line(prompt="x"), "missing 'category'"),
        (line(category="rag"), "missing 'prompt'"),
        (line(category="rag", prompt="   "), "'prompt' must be a non-empty string"),
        (line(category=3, prompt="x"), "'category' must be a non-empty string"),
        (line(category="rag", prompt="x", id=7), "'id' must be a non-empty string"),
        (line(category="rag", prompt="x", id="first"), "id 'first' is already used on line 1"),
    ],
)
def test_a_bad_line_is_a_one_line_error_naming_the_line(tmp_path, bad, message):
    path = write(tmp_path, line(category="rag", prompt="fine", id="first"), "", bad)
    with pytest.raises(WorkloadError) as error:
        load_workload(path)
    text = str(error.value)
    assert text.startswith(f"{path}:3: ") and message in text
    assert "\n" not in text


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match="no prompts"):
        load_workload(write(tmp_path, "", "  "))


def test_parse_workload_names_its_source():
    with pytest.raises(WorkloadError, match=r"^mine:2: "):
        parse_workload([line(category="a", prompt="b"), "{"], "mine")


# Selection -------------------------------------------------------------------------------


def test_select_by_category_and_limit_keeps_file_order():
    pool = [Prompt(f"{c}{i}", c, "t") for c in ("a", "b", "c") for i in range(3)]
    assert [p.id for p in select(pool, None, 2)] == ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert [p.id for p in select(pool, ["c", "a"], 1)] == ["c0", "a0"]
    assert select(pool) == pool


def test_select_rejects_unknown_categories_and_bad_limits():
    pool = [Prompt("x", "rag", "t")]
    with pytest.raises(WorkloadError, match="no prompts in category 'summary'; the workload has rag"):
        select(pool, ["summary"])
    with pytest.raises(WorkloadError, match="--limit"):
        select(pool, None, 0)


# The shipped workloads -------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped() -> dict[str, list[Prompt]]:
    by_category: dict[str, list[Prompt]] = {}
    for prompt in shipped_workload():
        by_category.setdefault(prompt.category, []).append(prompt)
    return by_category


def fenced_block(text: str) -> str:
    match = re.search(r"```[\w-]*\n(.*?)\n```", text, re.DOTALL)
    assert match, "no fenced block"
    return match.group(1)


def test_every_category_has_at_least_eight_prompts(shipped):
    assert list(shipped) == list(CATEGORIES)
    for category, prompts in shipped.items():
        assert len(prompts) >= 8, category
    ids = [p.id for prompts in shipped.values() for p in prompts]
    assert len(ids) == len(set(ids))


def test_code_edit_prompts_give_30_to_80_lines_of_code(shipped):
    for prompt in shipped["code-edit"]:
        lines = fenced_block(prompt.text).splitlines()
        assert 30 <= len(lines) <= 80, (prompt.id, len(lines))


def test_summarize_prompts_give_300_to_800_words(shipped):
    for prompt in shipped["summarize"]:
        match = re.search(r"\n---\n(.*)\n---$", prompt.text, re.DOTALL)
        assert match, prompt.id
        words = len(match.group(1).split())
        assert 300 <= words <= 800, (prompt.id, words)


def test_rag_prompts_give_two_to_four_passages_and_a_question(shipped):
    for prompt in shipped["rag"]:
        passages = re.findall(r"^\[(\d)\] ", prompt.text, re.MULTILINE)
        assert 2 <= len(passages) <= 4, prompt.id
        assert passages == [str(i) for i in range(1, len(passages) + 1)]
        assert "\nQuestion: " in prompt.text


def test_json_prompts_give_records_and_a_target_format(shipped):
    for prompt in shipped["json"]:
        records = fenced_block(prompt.text).splitlines()
        assert len(records) >= 5, prompt.id
        assert "JSON" in prompt.text or "YAML" in prompt.text


def test_chat_prompts_have_no_context_to_copy(shipped):
    for prompt in shipped["chat"]:
        assert "```" not in prompt.text and len(prompt.text.split()) < 60, prompt.id
