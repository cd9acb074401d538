"""Teacher-forced agreement with llama.cpp: on the same GGUF and the same token ids, how often akunu's top next
token is llama.cpp's, and each one's perplexity on the text (`akunu bench llama-cpp`).

llama.cpp's side is in `akunu.bench.llama_cpp`; both read llama.cpp's tokenization of the text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from akunu.errors import AkunuError

SHIPPED_TEXT = "declaration-of-independence.txt"  # in akunu/data
CHUNK = 256  # positions per forward pass


class TextError(AkunuError):
    """The text to score cannot be read, or is too short to score."""

    exit_code = 2


@dataclass(frozen=True)
class Predictions:
    """Per position of a text: the top next token, and the log-probability given to the actual next token."""

    top: np.ndarray
    logprob: np.ndarray

    @property
    def perplexity(self) -> float:
        return math.exp(-float(np.mean(self.logprob)))


@dataclass(frozen=True)
class Agreement:
    positions: int
    agreed: int  # positions where akunu's top token is llama.cpp's
    akunu_perplexity: float
    llama_cpp_perplexity: float

    @property
    def share(self) -> float:
        return self.agreed / self.positions


def read_text(path: Path | None) -> tuple[str, str]:
    """(the text, its name): the file at `path`, or the shipped Declaration of Independence."""
    if path is None:
        return (resources.files("akunu") / "data" / SHIPPED_TEXT).read_text(encoding="utf-8"), SHIPPED_TEXT
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TextError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    return text, Path(path).name


def akunu_predictions(model, ids: list[int], chunk: int = CHUNK) -> Predictions:
    """akunu's top token and the log-probability of the actual next token at every position but the last."""
    import mlx.core as mx

    from akunu.kv_cache import make_cache

    cache = make_cache(model)
    top, logprob = [], []
    for start in range(0, len(ids) - 1, chunk):
        stop = min(start + chunk, len(ids) - 1)
        logits = model(mx.array(ids[start:stop])[None], cache=cache)[0].astype(mx.float32)
        log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        next_ids = mx.array(ids[start + 1 : stop + 1])
        top.append(np.array(mx.argmax(logits, axis=-1)))
        logprob.append(np.array(mx.take_along_axis(log_probs, next_ids[:, None], axis=-1)[:, 0]))
    return Predictions(np.concatenate(top), np.concatenate(logprob).astype(np.float64))


def compare(ours: Predictions, theirs: Predictions) -> Agreement:
    return Agreement(
        positions=len(ours.top),
        agreed=int(np.sum(ours.top == theirs.top)),
        akunu_perplexity=ours.perplexity,
        llama_cpp_perplexity=theirs.perplexity,
    )
