"""llama.cpp's tokenizer test vectors, recorded by scripts/record_tokenizer_vectors.py into tests/fixtures/vocab/."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

from akunu.models.gguf_vocab import TokenType

VOCAB_FIXTURES = Path(__file__).parent / "fixtures" / "vocab"


def families() -> list[str]:
    return sorted(path.name.removesuffix(".json.gz") for path in VOCAB_FIXTURES.glob("*.json.gz"))


def load(family: str) -> dict[str, Any]:
    return json.loads(gzip.decompress((VOCAB_FIXTURES / f"{family}.json.gz").read_bytes()))


def metadata_from_fixture(fixture: dict[str, Any]) -> dict[str, Any]:
    """GGUF-like metadata from a fixture: tokens it dropped become unused placeholders."""
    vocab = fixture["metadata"]
    size = vocab["vocab_size"]
    tokens = [f"<fixture-unused-{i}>" for i in range(size)]
    types = [int(TokenType.UNUSED)] * size
    for i, token in vocab["tokens"].items():
        tokens[int(i)] = token
        types[int(i)] = int(TokenType.NORMAL)
    for i, kind in vocab["token_type"].items():
        types[int(i)] = kind
    metadata = {key: value for key, value in vocab.items() if key.startswith(("tokenizer.", "general."))}
    metadata.update(
        {
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
            "tokenizer.ggml.merges": vocab["merges"],
        }
    )
    if "scores" in vocab:
        scores = np.full(size, -1e9, dtype=np.float32)
        for i, score in vocab["scores"].items():
            scores[int(i)] = score
        metadata["tokenizer.ggml.scores"] = scores
    return metadata
