"""Special tokens in text, cut out before a tokenizer model sees it, as llama.cpp's `tokenizer_st_partition` does.

With `parse_special`, every control, user-defined and unknown token's text becomes that token; without it
only user-defined ones do (vocabulary words like "<think>", not control markup), so a user's text can
never write a control token. Some vocabularies swallow the whitespace after a special token (Phi-3's
tokenizer.json marks its tokens `rstrip`); llama.cpp knows them by model name, and so does this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from akunu.models.gguf_vocab import TokenType

Encoder = Callable[[str], list[int]]
_C_WHITESPACE = " \t\n\v\f\r"  # C's isspace(), which llama.cpp strips with


def special_token_encoders(
    metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], encode_words: Encoder
) -> tuple[Encoder, Encoder]:
    """Encoders of text with special-token strings parsed, and with only user-defined tokens parsed;
    `encode_words` encodes the plain text between them."""
    user_defined, control = int(TokenType.USER_DEFINED), {int(TokenType.CONTROL), int(TokenType.UNKNOWN)}
    user = {tokens[i]: i for i, kind in enumerate(types) if kind == user_defined and tokens[i]}
    every = {tokens[i]: i for i, kind in enumerate(types) if kind in control and tokens[i]}
    every.update(user)
    rstrip = _rstrip_ids(metadata, tokens, every.values())

    def encoder(specials: dict[str, int]) -> Encoder:
        split = special_splitter(specials)

        def encode(text: str) -> list[int]:
            ids: list[int] = []
            strip = False
            for fragment, special_id in split(text):
                if special_id is not None:
                    ids.append(special_id)
                    strip = special_id in rstrip
                    continue
                fragment = fragment.lstrip(_C_WHITESPACE) if strip else fragment
                if fragment:
                    ids.extend(encode_words(fragment))
            return ids

        return encode

    return encoder(every), encoder(user)


def _rstrip_ids(metadata: Mapping[str, Any], tokens: Sequence[str], special_ids) -> frozenset[int]:
    """Special tokens that swallow the whitespace after them (llama.cpp's per-model token attributes)."""
    name = str(metadata.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    ids = set(special_ids) | {i for i, token in enumerate(tokens) if token == "</s>"}
    return frozenset(i for i in ids if tokens[i] not in ("<unk>", "<s>", "<|endoftext|>"))


def special_splitter(specials: Mapping[str, int]) -> Callable[[str], list[tuple[str, int | None]]]:
    """Cuts text into plain fragments and special tokens, taking the longest special at the leftmost place."""
    if not specials:
        return lambda text: [(text, None)] if text else []
    pattern = re.compile(_trie_regex(sorted(specials)))

    def split(text: str) -> list[tuple[str, int | None]]:
        parts: list[tuple[str, int | None]] = []
        start = 0
        for match in pattern.finditer(text):
            if match.start() > start:
                parts.append((text[start : match.start()], None))
            parts.append((match.group(), specials[match.group()]))
            start = match.end()
        if start < len(text):
            parts.append((text[start:], None))
        return parts

    return split


def _trie_regex(words: Sequence[str]) -> str:
    """One regex for many literals, shaped as a prefix tree so matching costs O(length), not O(count)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}
    return _trie_node_regex(trie)


def _trie_node_regex(node: dict[str, Any]) -> str:
    ends_here = "" in node
    branches = [re.escape(char) + _trie_node_regex(child) for char, child in sorted(node.items()) if char]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if ends_here else body  # greedy "?" prefers the longer special
