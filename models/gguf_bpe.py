"""BPE tokenizers rebuilt from a GGUF file's vocabulary and merges, encoding as llama.cpp does.

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE; text is cut into words by the pre-tokenizer of the
  file's `tokenizer.ggml.pre` (pretokenizers.py), each word's bytes become GPT-2 symbols, then merge.
* `tokenizer.ggml.model == "gemma4"`: BPE over raw UTF-8 with spaces written "▁", cut only at newline
  runs, bytes of unknown characters as <0xNN> tokens.

Special tokens are cut out of the text first (special_tokens.py); the `tokenizers` library then runs
the pre-tokenizer and the merges on each piece of plain text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

from akunu.errors import ModelError
from akunu.models.detokenizer import byte_level_alphabet, byte_level_token_bytes, sentencepiece_token_bytes
from akunu.models.gguf_vocab import TokenType, optional_id, token_types
from akunu.models.pretokenizers import GPT2, PRE_TOKENIZERS, PreTokenizer, hf_pre_tokenizer
from akunu.models.special_tokens import special_token_encoders
from akunu.models.stop_tokens import gguf_end_of_generation_ids

log = logging.getLogger(__name__)

# Qwen's tokenizer.json composes text to NFC before splitting it (llama.cpp does not; it matters only
# for decomposed accents, which llama.cpp then encodes as the original model never would).
_NFC_PRE = ("qwen2", "deepseek-r1-qwen")
_UNKNOWN_PRE = PreTokenizer((GPT2,))


def byte_level_bpe_arguments(metadata: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The `Tokenizer` arguments of a byte-level BPE vocabulary (or a raw one, by its pre-tokenizer)."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = token_types(metadata, len(tokens))
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    spec = _pre_tokenizer(pre)
    if not spec.byte_level:
        return raw_bpe_arguments(metadata, source, pre=pre)
    words, with_specials = _hf_tokenizers(
        tokens, types, _merges(metadata, source), spec, nfc=pre in _NFC_PRE, source=source
    )
    token_bytes = _byte_level_token_bytes(tokens, types)
    return _tokenizer(
        metadata,
        tokens,
        types,
        encode_words=lambda text: words.encode(text, add_special_tokens=False).ids,
        token_bytes=token_bytes,
        add_bos_default=spec.add_bos,
        decoding="byte_level",
        hf_tokenizer=with_specials,
    )


def raw_bpe_arguments(metadata: Mapping[str, Any], source: str, pre: str = "gemma4") -> dict[str, Any]:
    """The `Tokenizer` arguments of a BPE vocabulary over raw UTF-8 (Gemma 4)."""
    """Gemma 4's tokenizer (and Sarvam's): sentencepiece-style pieces, merged by rank like any BPE."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = token_types(metadata, len(tokens))
    spec = PRE_TOKENIZERS[pre]
    gemma4 = pre != "sarvam-moe"
    words, with_specials = _hf_tokenizers(tokens, types, _merges(metadata, source), spec, nfc=False, source=source)
    newline_tokens = {token: i for i, token in enumerate(tokens) if gemma4 and token and not token.strip("\n")}

    def encode_words(text: str) -> list[int]:
        ids: list[int] = []
        for run in re.findall(r"[^\n]+|\n+", text.replace(" ", "\u2581")):
            # A run of newlines that is one token stays one token (llama.cpp's Gemma 4 rule).
            if run in newline_tokens:
                ids.append(newline_tokens[run])
            else:
                ids.extend(words.encode(run, add_special_tokens=False).ids)
        return ids

    token_bytes = [
        token.encode("utf-8") if kind in _WRITTEN_AS_TEXT
        else sentencepiece_token_bytes(token, byte_piece=kind == TokenType.BYTE)
        for token, kind in zip(tokens, types, strict=True)
    ]  # fmt: skip
    return _tokenizer(
        metadata,
        tokens,
        types,
        encode_words=encode_words,
        token_bytes=token_bytes,
        add_bos_default=gemma4,
        force_bos=gemma4,  # llama.cpp turns BOS on for Gemma 4 whatever the file says
        decoding="sentencepiece",
        hf_tokenizer=with_specials,
    )


_WRITTEN_AS_TEXT = frozenset({int(TokenType.CONTROL), int(TokenType.USER_DEFINED), int(TokenType.UNKNOWN)})


def _byte_level_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """Each token's bytes: GPT-2 symbols mapped back to bytes in one `translate`, as a vocabulary has 100k+ tokens."""
    alphabet = byte_level_alphabet()
    to_latin1 = {ord(symbol): byte for symbol, byte in alphabet.items()}
    # Characters below U+0100 that are not symbols must not pass as bytes: send them out of Latin-1's range.
    to_latin1.update({code: 0x110000 - 1 for code in range(256) if chr(code) not in alphabet})
    table = str.maketrans(to_latin1)
    token_bytes = []
    for token, kind in zip(tokens, types, strict=True):
        if kind in _WRITTEN_AS_TEXT:
            token_bytes.append(token.encode("utf-8"))
            continue
        try:
            token_bytes.append(token.translate(table).encode("latin-1"))
        except UnicodeEncodeError:
            token_bytes.append(byte_level_token_bytes(token, alphabet))  # mislabelled: plain text
    return token_bytes


def _tokenizer(
    metadata: Mapping[str, Any],
    tokens: list[str],
    types: list[int],
    *,
    encode_words: Callable[[str], list[int]],
    token_bytes: list[bytes],
    add_bos_default: bool,
    decoding: Any,
    hf_tokenizer: Callable[[], tokenizers.Tokenizer],
    force_bos: bool = False,
) -> dict[str, Any]:
    encode_plain, encode_text = special_token_encoders(metadata, tokens, types, encode_words)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) or force_bos
    return dict(
        encode_plain=encode_plain,
        encode_text=encode_text,
        pieces=tokens,
        token_bytes=token_bytes,
        special_ids=frozenset(i for i, kind in enumerate(types) if kind == TokenType.CONTROL),
        bos_id=optional_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens)),
        eos_id=optional_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens)),
        eos_ids=gguf_end_of_generation_ids(metadata, tokens),
        add_bos=add_bos,
        chat_template=metadata.get("tokenizer.chat_template"),
        decoding=decoding,
        hf_tokenizer=hf_tokenizer,
    )


def _pre_tokenizer(pre: str) -> PreTokenizer:
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        log.warning(
            "unknown pre-tokenizer %r: splitting text with GPT-2's regex, so token ids may differ from the original",
            pre,
        )
        return _UNKNOWN_PRE
    return spec


def _merges(metadata: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
    # llama.cpp cuts each merge at its first space after the first character.
    merges = []
    for merge in metadata.get("tokenizer.ggml.merges", []):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelError(f"{source} has a malformed BPE merge: {merge[:40]!r}")
        merges.append((merge[:cut], merge[cut + 1 :]))
    return merges


def _hf_tokenizers(
    tokens: Sequence[str],
    types: Sequence[int],
    merges: list[tuple[str, str]],
    spec: PreTokenizer,
    *,
    nfc: bool,
    source: str,
) -> tuple[tokenizers.Tokenizer, Callable[[], tokenizers.Tokenizer]]:
    """The `tokenizers` equivalent without special tokens (to encode plain text), and a maker of the one with
    them (for mlx-lm), which copies the first rather than keep the merges alive for it."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    try:
        model = models.BPE(
            vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges, byte_fallback=not spec.byte_level
        )
    except Exception as error:  # noqa: BLE001 - a malformed vocabulary is the file's fault
        raise ModelError(f"{source} has an inconsistent BPE vocabulary: {error}") from None
    words = tokenizers.Tokenizer(model)
    if spec.byte_level:
        words.pre_tokenizer = hf_pre_tokenizer(spec)
        words.decoder = decoders.ByteLevel()
    else:
        words.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    if nfc:
        words.normalizer = normalizers.NFC()

    def with_specials() -> tokenizers.Tokenizer:
        hf = tokenizers.Tokenizer.from_str(words.to_str())
        _add_special_tokens(hf, tokens, types, escape_spaces=not spec.byte_level)
        return hf

    return words, with_specials


def _add_special_tokens(
    hf: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int], escape_spaces: bool
) -> None:
    if escape_spaces:  # the mlx-lm baseline sees raw text: spaces become "▁" as Gemma 4's normalizer does
        hf.normalizer = normalizers.Replace(" ", "\u2581")
        hf.pre_tokenizer = hf_pre_tokenizer(PRE_TOKENIZERS["gemma4"])
    hf.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types)
            if kind == TokenType.CONTROL
        ]
    )
    hf.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, types)
            if kind == TokenType.USER_DEFINED
        ]
    )
