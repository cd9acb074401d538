"""What every GGUF tokenizer reads from its `tokenizer.ggml.*` metadata: token types, scores and special ids."""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import Any

from akunu.errors import ModelError


class TokenType(IntEnum):
    """GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type); sentencepiece uses the same numbers."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def token_types(metadata: Mapping[str, Any], count: int) -> list[int]:
    """Each token's TokenType, NORMAL for all when the file has none."""
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return [int(TokenType.NORMAL)] * count
    types = [int(kind) for kind in types]
    if len(types) != count:
        raise ModelError(f"tokenizer metadata is inconsistent: {count} tokens but {len(types)} token types")
    return types


def scores_of(metadata: Mapping[str, Any], count: int) -> list[float]:
    """Each token's sentencepiece score, 0 for all when the file has none."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        return [0.0] * count
    scores = [float(score) for score in scores]
    if len(scores) != count:
        raise ModelError(f"tokenizer metadata is inconsistent: {count} tokens but {len(scores)} scores")
    return scores


def optional_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    """A token id the metadata names, or None when it is missing or outside the vocabulary."""
    value = metadata.get(key)
    if value is None or not 0 <= int(value) < vocab_size:
        return None
    return int(value)
