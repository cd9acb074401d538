"""Benchmark workloads: JSONL files with one prompt per line, `category` and `prompt` (and an optional `id`).

The shipped workloads live in `akunu/data/workload-*.jsonl`, one file per category. A user's
own file may use any category names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from akunu.errors import AkunuError

# The shipped categories, from the most copy-heavy to none at all.
CATEGORIES = ("code-edit", "summarize", "rag", "json", "chat")


class WorkloadError(AkunuError):
    """A workload file is missing or malformed, or a selection names no prompts."""

    exit_code = 2


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # the user message; the chat template is applied when it is encoded


def parse_workload(lines: Iterable[str], source: str) -> list[Prompt]:
    """Prompts from JSONL lines; blank lines are skipped, anything else wrong is a one-line error naming the line."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    per_category: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        record = _json_object(line, where)
        category = _required_text(record, "category", where)
        text = _required_text(record, "prompt", where)
        per_category[category] = per_category.get(category, 0) + 1
        prompt_id = record.get("id", f"{category}-{per_category[category]}")
        if not isinstance(prompt_id, str) or not prompt_id.strip():
            raise WorkloadError(f"{where}: 'id' must be a non-empty string")
        if prompt_id in seen:
            raise WorkloadError(f"{where}: id {prompt_id!r} is already used on line {seen[prompt_id]}")
        seen[prompt_id] = number
        prompts.append(Prompt(prompt_id, category, text))
    if not prompts:
        raise WorkloadError(f"{source}: no prompts (expected JSON lines with 'category' and 'prompt')")
    return prompts


def _json_object(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise WorkloadError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise WorkloadError(
            f"{where}: expected a JSON object with 'category' and 'prompt', got {type(record).__name__}"
        )
    return record


def _required_text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if value is None:
        raise WorkloadError(f"{where}: missing {key!r}")
    if not isinstance(value, str) or not value.strip():
        raise WorkloadError(f"{where}: {key!r} must be a non-empty string")
    return value


def load_workload(path: Path | str) -> list[Prompt]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"workload file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise WorkloadError(f"cannot read workload {path}: {error}") from None
    return parse_workload(text.splitlines(), str(path))


def shipped_workload() -> list[Prompt]:
    """Every shipped prompt, in the order of CATEGORIES."""
    data = resources.files("akunu") / "data"
    prompts: list[Prompt] = []
    for category in CATEGORIES:
        resource = data / f"workload-{category}.jsonl"
        prompts += parse_workload(resource.read_text(encoding="utf-8").splitlines(), f"akunu/data/{resource.name}")
    return prompts


def select(
    prompts: Sequence[Prompt], categories: Sequence[str] | None = None, limit: int | None = None
) -> list[Prompt]:
    """The prompts of `categories` (all when None), at most `limit` per category, in file order."""
    present = list(dict.fromkeys(p.category for p in prompts))
    wanted = list(dict.fromkeys(categories)) if categories else present
    unknown = [c for c in wanted if c not in present]
    if unknown:
        raise WorkloadError(
            f"no prompts in category {', '.join(map(repr, unknown))}; the workload has {', '.join(present)}"
        )
    if limit is not None and limit < 1:
        raise WorkloadError(f"--limit must be at least 1 (got {limit})")
    chosen: list[Prompt] = []
    for category in wanted:
        in_category = [p for p in prompts if p.category == category]
        chosen += in_category[:limit] if limit else in_category
    return chosen
