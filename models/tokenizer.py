"""Tokenizers rebuilt from a GGUF file's metadata or read from a Hugging Face model directory.

GGUF stores no tokenizer program, only its data, under llama.cpp's key names. We rebuild
the original tokenizer from that data:

* `tokenizer.ggml.model == "gpt2"` or `"gemma4"`: BPE, encoding as llama.cpp does (gguf_bpe.py, with
  the pre-tokenizer table of llama.cpp's llama-vocab.cpp in pretokenizers.py).
* `tokenizer.ggml.model == "llama"`: a real sentencepiece BPE model assembled in memory
  from pieces, scores and token types, run by the sentencepiece library itself.

Special-token strings are cut out of text before either runs, per `parse_special` (special_tokens.py), and
which tokens end generation is llama.cpp's rule too (stop_tokens.py).

Decoding is ours for every kind: each token maps to the exact bytes it stands for, so
decoding and streaming are the same incremental UTF-8 decode (see detokenizer.py).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

from akunu.errors import ModelError
from akunu.models.chat_template import ChatTemplate
from akunu.models.detokenizer import (
    StreamingDetokenizer,
    byte_level_alphabet,
    byte_level_token_bytes,
    bytes_of_token,
    is_byte_piece,
    sentencepiece_token_bytes,
)
from akunu.models.gguf_vocab import TokenType, optional_id, scores_of, token_types
from akunu.models.stop_tokens import end_of_generation_ids, gguf_end_of_generation_ids

log = logging.getLogger(__name__)

# How token ids turn into text: GPT-2 byte symbols, sentencepiece pieces, or anything else.
Decoding = Literal["byte_level", "sentencepiece", "other"]


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template."""

    def __init__(
        self,
        *,
        encode_plain: Callable[[str], list[int]],
        encode_text: Callable[[str], list[int]],
        pieces: Sequence[str],
        token_bytes: Sequence[bytes],
        special_ids: frozenset[int],
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
        strip_leading_space: bool = False,
        decoding: Decoding = "other",
        hf_tokenizer: Callable[[], tokenizers.Tokenizer] | None = None,
    ):
        self._encode_plain = encode_plain  # text (special-token strings included) -> ids, no BOS
        self._encode_text = encode_text  # the same, special-token strings read as plain text
        self._pieces = pieces
        self._token_bytes = token_bytes
        self.special_ids = special_ids
        self.bos_id = bos_id
        self.eos_id = eos_id  # the one the model declares; `eos_ids` adds every other end-of-turn token
        self.eos_ids = eos_ids | ({eos_id} if eos_id is not None else set())
        self.add_bos = add_bos
        self.vocab_size = len(pieces)
        self.chat_template = chat_template
        self._strip_leading_space = strip_leading_space
        self._decoding = decoding
        self._hf_tokenizer = hf_tokenizer
        self._template = ChatTemplate(chat_template) if chat_template else None

    # Construction -----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        """The tokenizer described by a GGUF file's `tokenizer.*` metadata."""
        from akunu.models.gguf_file import read_gguf

        return cls.from_gguf_metadata(read_gguf(Path(path)).metadata, source=str(path))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, source: str = "GGUF file") -> Tokenizer:
        """The same, from metadata already read (values as `gguf_file.read_gguf` returns them)."""
        kind = metadata.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in metadata:
            raise ModelError(f"{source} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        if kind == "gpt2":
            from akunu.models.gguf_bpe import byte_level_bpe_arguments

            return cls(**byte_level_bpe_arguments(metadata, source))
        if kind == "gemma4":
            from akunu.models.gguf_bpe import raw_bpe_arguments

            return cls(**raw_bpe_arguments(metadata, source))
        if kind == "llama":
            return _sentencepiece_from_gguf(metadata, source)
        raise ModelError(
            f"{source} uses tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), 'gemma4' (BPE),"
            " 'llama' (sentencepiece)"
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """The tokenizer of an MLX / Hugging Face model directory (tokenizer.json + tokenizer_config.json)."""
        return _from_hf_dir(Path(path))

    # Text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids for `text`; special-token strings in it (e.g. "<|im_start|>") become their ids
        when `parse_special`, and are read as plain text otherwise (llama.cpp's parse_special).

        BOS is prepended when `add_bos` (default: the model's flag) is set, unless the text
        already starts with it, as a chat template that writes `{{ bos_token }}` does.
        """
        ids = self._encode_plain(text) if parse_special else self._encode_text(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; special tokens are written out unless `skip_special`."""
        detokenizer = self.detokenizer()
        for token_id in ids:
            if not (skip_special and token_id in self.special_ids):
                detokenizer.add(token_id)
        detokenizer.flush()
        return detokenizer.text

    def detokenizer(self) -> StreamingDetokenizer:
        """A fresh streaming decoder whose output concatenates to `decode(ids)`."""
        return StreamingDetokenizer(self._token_bytes, self.special_ids, self._strip_leading_space)

    @property
    def token_bytes(self) -> Sequence[bytes]:
        """The bytes each token id stands for (special tokens: their text), as a grammar matcher needs them."""
        return self._token_bytes

    def token_text(self, token_id: int) -> str:
        """A readable form of one token for --verbose displays: its text, or <0xNN> for bytes of a split character."""
        raw = bytes_of_token(self._token_bytes, token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(chr(byte) if byte < 0x80 else f"<0x{byte:02X}>" for byte in raw)

    # Chat -------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The model's prompt text for a conversation, offering `tools` (OpenAI-style function specs) to
        templates that take them (check `has_chat_template` first)."""
        if self._template is None:
            raise ModelError("this model has no chat template")
        return self._template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_id),
            eos_token=self._special_text(self.eos_id),
            tools=tools,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        parse_special: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt ids of a conversation inside the chat template (check `has_chat_template` first).

        Control tokens come from the template's markup only, unless `parse_special` reads them in messages too.
        """  # fmt: skip
        if parse_special:
            return self.encode(
                self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
            )
        from akunu.models.chat_encoding import encode_conversation

        return encode_conversation(self, messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def _special_text(self, token_id: int | None) -> str:
        return self._pieces[token_id] if token_id is not None and 0 <= token_id < self.vocab_size else ""

    # Baseline ---------------------------------------------------------------------------

    def to_mlx_lm(self) -> Any:
        """An `mlx_lm` TokenizerWrapper over an equivalent HF tokenizer, so mlx-lm's generation can be a baseline."""
        if self._hf_tokenizer is None:
            raise NotImplementedError("this tokenizer has no Hugging Face equivalent to hand to mlx-lm")
        from mlx_lm.tokenizer_utils import (
            BPEStreamingDetokenizer,
            NaiveStreamingDetokenizer,
            SPMStreamingDetokenizer,
            TokenizerWrapper,
        )
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(
            tokenizer_object=self._hf_tokenizer(),
            bos_token=self._special_text(self.bos_id) or None,
            eos_token=self._special_text(self.eos_id) or None,
        )
        fast.chat_template = self.chat_template
        detokenizer_class = {
            "byte_level": BPEStreamingDetokenizer,
            "sentencepiece": functools.partial(SPMStreamingDetokenizer, trim_space=self._strip_leading_space),
        }.get(self._decoding, NaiveStreamingDetokenizer)
        return TokenizerWrapper(fast, detokenizer_class, eos_token_ids=sorted(self.eos_ids))

    def __repr__(self) -> str:
        eos = sorted(self.eos_ids)
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={eos}, add_bos={self.add_bos})"


# GGUF: sentencepiece ----------------------------------------------------------------------


def _sentencepiece_from_gguf(metadata: Mapping[str, Any], source: str) -> Tokenizer:
    import sentencepiece

    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = token_types(metadata, len(tokens))
    scores = scores_of(metadata, len(tokens))
    unk_id = optional_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
    add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    proto = _sentencepiece_model_proto(tokens, types, scores, unk_id, add_dummy_prefix)
    try:
        processor = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    except Exception as error:  # noqa: BLE001
        raise ModelError(f"{source}: cannot build a sentencepiece model from its vocabulary: {error}") from None

    from akunu.models.special_tokens import special_token_encoders

    # Special tokens are cut out first, as llama.cpp does (sentencepiece never matches control pieces),
    # and each piece of text between them gets its own dummy prefix.
    types_for_split = [TokenType.UNKNOWN if i == unk_id else kind for i, kind in enumerate(types)]
    encode_plain, encode_text = special_token_encoders(metadata, tokens, types_for_split, processor.encode)

    token_bytes = [
        token.encode("utf-8") if kind in (TokenType.CONTROL, TokenType.UNKNOWN) or i == unk_id
        else sentencepiece_token_bytes(token, byte_piece=kind == TokenType.BYTE)
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
    ]  # fmt: skip
    special_ids = frozenset(i for i, kind in enumerate(types) if kind == TokenType.CONTROL)
    return Tokenizer(
        encode_plain=encode_plain,
        encode_text=encode_text,
        pieces=tokens,
        token_bytes=token_bytes,
        special_ids=special_ids,
        bos_id=optional_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens)),
        eos_id=optional_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens)),
        eos_ids=gguf_end_of_generation_ids(metadata, tokens),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", True)),
        chat_template=metadata.get("tokenizer.chat_template"),
        strip_leading_space=add_dummy_prefix,
        decoding="sentencepiece",
        hf_tokenizer=lambda: _sentencepiece_as_hf(tokens, types, scores, unk_id, add_dummy_prefix),
    )


def _sentencepiece_model_proto(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], unk_id: int | None, add_dummy_prefix: bool
) -> Any:
    """A sentencepiece BPE ModelProto equivalent to the original `tokenizer.model` the GGUF was made from."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    proto = model_pb2.ModelProto()
    proto.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = TokenType.BYTE in types
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = add_dummy_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    seen: set[str] = set()
    for i, (token, kind, score) in enumerate(zip(tokens, types, scores, strict=True)):
        if i == unk_id:
            kind = TokenType.UNKNOWN  # sentencepiece needs exactly one; GGUF files often mark <unk> as control
        elif kind == TokenType.UNKNOWN:
            kind = TokenType.CONTROL
        if kind == TokenType.USER_DEFINED:
            token = token.replace(" ", "\u2581")  # llama.cpp's converter wrote these with plain spaces
        if not token or token in seen:
            token, kind = f"<akunu_unreachable_{i}>", TokenType.UNUSED  # sentencepiece rejects empty or repeated pieces
        seen.add(token)
        proto.pieces.add(piece=token, score=score, type=int(kind))
    if unk_id is None:
        proto.pieces.add(piece="<akunu_unk>", score=0.0, type=int(TokenType.UNKNOWN))
    return proto


def _sentencepiece_as_hf(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], unk_id: int | None, add_dummy_prefix: bool
) -> tokenizers.Tokenizer:
    """The sentencepiece model as a `tokenizers` BPE, for mlx-lm's baseline; merges rank by the merged piece's score."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # user-defined pieces keep their plain text: they match raw input as added tokens
    mergeable = {token for token, i in vocab.items() if types[i] == TokenType.NORMAL}
    merges = []
    for token in mergeable:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[vocab[token]], vocab[token], left, right))
    merges.sort()
    unk = tokens[unk_id] if unk_id is not None else None
    hf = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, _, left, right in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Prepend("\u2581")] if add_dummy_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    hf.pre_tokenizer = None
    tail = [decoders.Strip(" ", 1, 0)] if add_dummy_prefix else []
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    hf.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, k in enumerate(types) if k == TokenType.CONTROL]
    )
    hf.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, k in enumerate(types)
            if k == TokenType.USER_DEFINED
        ]
    )
    return hf


# Hugging Face directories -----------------------------------------------------------------


def _from_hf_dir(path: Path) -> Tokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelError(f"{path} has no tokenizer.json")
    try:
        hf = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # noqa: BLE001
        raise ModelError(f"cannot read {tokenizer_file}: {error}") from None
    config = _read_json(path / "tokenizer_config.json")
    vocab_size = hf.get_vocab_size(with_added_tokens=True)
    pieces = [hf.id_to_token(i) or "" for i in range(vocab_size)]
    added = hf.get_added_tokens_decoder()
    special_ids = frozenset(i for i, token in added.items() if token.special)
    decoder = json.loads(hf.decoder.__getstate__()) if hf.decoder is not None else None
    token_bytes, strip_leading_space, decoding = _hf_token_bytes(hf, decoder, pieces, special_ids)

    bos_id = _hf_token_id(hf, config.get("bos_token"))
    eos_id = _hf_token_id(hf, config.get("eos_token"))
    eos_ids = {eos_id}
    for extra in ("generation_config.json", "config.json"):
        configured = _read_json(path / extra).get("eos_token_id")
        eos_ids |= set(configured if isinstance(configured, list) else [configured])
    eos_ids = end_of_generation_ids(pieces, {i for i in eos_ids if isinstance(i, int)}, among=added)
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # decided by the post-processor: does it put BOS in front?
        add_bos = bos_id is not None and hf.encode("a", add_special_tokens=True).ids[:1] == [bos_id]

    encode_plain, encode_text = _hf_encoders(hf)
    return Tokenizer(
        encode_plain=encode_plain,
        encode_text=encode_text,
        pieces=pieces,
        token_bytes=token_bytes,
        special_ids=special_ids,
        bos_id=bos_id,
        eos_id=eos_id,
        eos_ids=eos_ids,
        add_bos=bool(add_bos),
        chat_template=_hf_chat_template(path, config),
        strip_leading_space=strip_leading_space,
        decoding=decoding,
        hf_tokenizer=lambda: tokenizers.Tokenizer.from_file(str(tokenizer_file)),
    )


def _hf_encoders(hf: tokenizers.Tokenizer) -> tuple[Callable[[str], list[int]], Callable[[str], list[int]]]:
    """`hf`'s encoding with special-token strings parsed, and read as text (its `encode_special_tokens`
    switch, shared by both, hence the lock)."""
    lock = threading.Lock()

    def encode(text: str, as_text: bool) -> list[int]:
        with lock:
            hf.encode_special_tokens = as_text
            try:
                return hf.encode(text, add_special_tokens=False).ids
            finally:
                hf.encode_special_tokens = False

    return functools.partial(encode, as_text=False), functools.partial(encode, as_text=True)


def _hf_token_bytes(
    hf: tokenizers.Tokenizer, decoder: Any, pieces: Sequence[str], special_ids: frozenset[int]
) -> tuple[list[bytes], bool, Decoding]:
    """Per-token bytes for the decoder this tokenizer.json declares, whether to strip a leading space, and its kind.

    Special tokens are their text. Other added tokens are plain text too, except that a
    sentencepiece decoder still turns their "▁" into spaces, as HF's does.
    """
    kinds = _decoder_kinds(decoder)
    added_ids = set(hf.get_added_tokens_decoder())
    if "ByteLevel" in kinds:
        alphabet = byte_level_alphabet()
        table = [
            piece.encode("utf-8") if i in added_ids else byte_level_token_bytes(piece, alphabet)
            for i, piece in enumerate(pieces)
        ]
        return table, False, "byte_level"
    if kinds & {"ByteFallback", "Metaspace", "Replace"}:
        table = [
            piece.encode("utf-8") if i in special_ids
            else sentencepiece_token_bytes(piece, byte_piece=i not in added_ids and is_byte_piece(piece))
            for i, piece in enumerate(pieces)
        ]  # fmt: skip
        return table, _decoder_strips_leading_space(decoder), "sentencepiece"
    # Other decoders (WordPiece, ...): each token decoded alone is the best we can do.
    table = [
        piece.encode("utf-8") if i in added_ids else hf.decode([i], skip_special_tokens=False).encode("utf-8")
        for i, piece in enumerate(pieces)
    ]  # fmt: skip
    return table, False, "other"


def _decoder_kinds(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    return {decoder.get("type", "")} | {kind for child in decoder.get("decoders", []) for kind in _decoder_kinds(child)}


def _decoder_strips_leading_space(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "Strip":
        return decoder.get("content") == " " and decoder.get("start", 0) >= 1
    if decoder.get("type") == "Metaspace":
        return decoder.get("prepend_scheme", "always" if decoder.get("add_prefix_space", True) else "never") != "never"
    return any(_decoder_strips_leading_space(child) for child in decoder.get("decoders", []))


def _hf_token_id(hf: tokenizers.Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return hf.token_to_id(token) if isinstance(token, str) else None


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template.strip() else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot read {path}: {error}") from None
    return value if isinstance(value, dict) else {}
