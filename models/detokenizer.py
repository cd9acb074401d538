"""Token ids -> text one token at a time, never emitting half a UTF-8 character.

Every tokenizer here reduces a token to the exact bytes it stands for (byte-level BPE
symbols mapped back to bytes, sentencepiece `<0xE2>` byte pieces, `▁` as a space), so
streaming is an incremental UTF-8 decode of those bytes: O(1) per token, and a character
split across tokens is held back until its last byte arrives.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class StreamingDetokenizer:
    """Turns generated token ids into text as they arrive.

    `add(id)` returns only the newly completed text; `flush()` returns what was held back
    (an unfinished character becomes U+FFFD). The concatenation of everything returned equals
    `Tokenizer.decode` of all the ids added.
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        special_ids: frozenset[int] = frozenset(),
        strip_leading_space: bool = False,
    ):
        self._token_bytes = token_bytes
        self._special_ids = special_ids
        # Sentencepiece models with a dummy prefix start their first word with "▁"; drop that space once.
        self._strip_pending = strip_leading_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._segments: list[str] = []
        self._text_cache = ""
        self._cached_segments = 0
        self.tokens: list[int] = []

    def add(self, token_id: int) -> str:
        """Consume one token id; return the text it completes (possibly "")."""
        self.tokens.append(token_id)
        raw = bytes_of_token(self._token_bytes, token_id)
        if self._strip_pending and token_id not in self._special_ids:
            self._strip_pending = False
            if raw.startswith(b" "):
                raw = raw[1:]
        return self._keep(self._utf8.decode(raw))

    def flush(self) -> str:
        """Emit anything held back; an incomplete trailing character becomes U+FFFD."""
        return self._keep(self._utf8.decode(b"", final=True))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._cached_segments != len(self._segments):
            self._text_cache += "".join(self._segments[self._cached_segments :])
            self._cached_segments = len(self._segments)
        return self._text_cache

    def _keep(self, segment: str) -> str:
        if segment:
            self._segments.append(segment)
        return segment


def bytes_of_token(token_bytes: Sequence[bytes], token_id: int) -> bytes:
    """The bytes a token stands for; an id outside the vocabulary (a padded logit row) stands for nothing."""
    if 0 <= token_id < len(token_bytes):
        return token_bytes[token_id]
    return b""


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level symbol -> byte table: printable bytes stand for themselves, others shift past U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbol_of = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in symbol_of:
            symbol_of[byte] = chr(256 + shifted)
            shifted += 1
    return {symbol: byte for byte, symbol in symbol_of.items()}


def byte_level_token_bytes(symbols: str, alphabet: dict[str, int]) -> bytes:
    """A byte-level BPE token's bytes; a token spelled outside the alphabet (mislabelled) is taken as plain text."""
    try:
        return bytes(alphabet[symbol] for symbol in symbols)
    except KeyError:
        return symbols.encode("utf-8")


def sentencepiece_token_bytes(piece: str, *, byte_piece: bool) -> bytes:
    """A sentencepiece piece's bytes: a byte-fallback piece `<0xE2>` is that one byte, `▁` is a space."""
    if byte_piece and is_byte_piece(piece):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def is_byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and _is_hex(piece[3:5])


def _is_hex(text: str) -> bool:
    return all(char in "0123456789abcdefABCDEF" for char in text)
