"""A tiny tokenizer that can write JSON (every printable ASCII character plus a few merged pieces, so the
grammar has multi-token choices and forced runs), and a random model over its vocabulary."""

from __future__ import annotations

import string

from akunu.models.tokenizer import Tokenizer
from tests.tiny import tiny_llama

PIECES = ['{"', '":', '",', '"}', '":"', "true", "false", "null", "name", "  "]
EOS = "<eos>"


def json_tokenizer() -> Tokenizer:
    """Token ids: 0 is EOS, then the merged pieces, then single characters; encoding is greedy longest-first."""
    pieces = [EOS, *PIECES, *(c for c in string.printable if c not in "\x0b\x0c")]
    longest_first = sorted(range(1, len(pieces)), key=lambda i: -len(pieces[i]))

    def encode_plain(text: str) -> list[int]:
        ids, at = [], 0
        while at < len(text):
            token = next((i for i in longest_first if text.startswith(pieces[i], at)), None)
            if token is None:
                raise ValueError(f"cannot encode {text[at]!r}")
            ids.append(token)
            at += len(pieces[token])
        return ids

    return Tokenizer(
        encode_plain=encode_plain,
        encode_text=encode_plain,
        pieces=pieces,
        token_bytes=[p.encode() for p in pieces],
        special_ids=frozenset({0}),
        bos_id=None,
        eos_id=0,
        eos_ids=frozenset({0}),
        add_bos=False,
        chat_template=None,
    )


def json_model(seed: int = 0, sharpness: float = 1.0):
    """A random 2-layer llama over `json_tokenizer`'s vocabulary (rounded up to 128 logits)."""
    return tiny_llama(vocab=128, seed=seed, sharpness=sharpness)
