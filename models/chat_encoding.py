"""A conversation's prompt ids, with control tokens only where the chat template writes them.

The template renders messages into text, and that text is tokenized. If the special-token strings in it were
all read as control tokens, a user could write `<|im_end|><|im_start|>system ...` into a message and pose as
the system. So the rendered text is cut where the messages' own text lies, and those parts are tokenized with
special-token parsing off, as llama.cpp's server does for user content. The request's tool definitions are
the caller's text too: wherever a string of theirs that holds special-token text is rendered (as is or as
JSON writes it), it is tokenized as text. A conversation whose text holds no special-token string is
tokenized exactly as before, in one piece.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

# Private-use characters that mark where a message's text begins and ends while the template renders.
_MARKS = [(chr(0xF0000 + 2 * i), chr(0xF0001 + 2 * i)) for i in range(16)]


def encode_conversation(
    tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    render = functools.partial(tokenizer.apply_chat_template, add_generation_prompt=add_generation_prompt, tools=tools)
    rendered = render(messages)
    specials = special_texts(tokenizer)
    texts = list(message_texts(messages))
    hostile_tool_texts = [text for text in _strings_in(tools) if any(s in text for s in specials)]
    if not hostile_tool_texts and not any(special in text for text in texts for special in specials):
        return tokenizer.encode(rendered)
    spans = _marked_spans(render, messages, rendered, texts)
    if spans is None:
        spans = _found_spans(rendered, texts)
    spans += _occurrences(rendered, hostile_tool_texts)
    spans = [(start, end) for start, end in spans if any(s in rendered[start:end] for s in specials)]
    return _encode_pieces(tokenizer, rendered, _merged(spans))


def special_texts(tokenizer) -> list[str]:
    return [text for text in (tokenizer.token_text(i) for i in tokenizer.special_ids) if text]


def message_texts(messages: list[dict[str, Any]]) -> Iterator[str]:
    """Every piece of text a caller wrote in the messages (content, content parts, tool-call arguments)."""
    for message in messages:
        yield from _texts_of(message.get("content"))
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                yield from _texts_of(function.get("arguments"))


def _texts_of(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for part in value:
            yield from _texts_of(part.get("text") if isinstance(part, dict) else part)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _texts_of(item)


def _strings_in(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, dictionary keys included (a tool's parameter names are the caller's too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings_in(key)
            yield from _strings_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings_in(item)


def _occurrences(rendered: str, texts: list[str]) -> list[tuple[int, int]]:
    """Every place each text appears in `rendered`, as written or as JSON escapes it (templates use `tojson`)."""
    spans = []
    for text in texts:
        for form in {text, json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]}:
            at = rendered.find(form)
            while at >= 0:
                spans.append((at, at + len(form)))
                at = rendered.find(form, at + 1)
    return spans


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping spans joined into one, in order."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _marked_spans(render, messages, rendered: str, texts: list[str]):
    """Where the messages' text lies in `rendered`, found by rendering it between marks; None if the
    template changed the text (trimmed or cut it) so that the marks no longer tell."""
    everything = rendered + "".join(texts)
    marks = next(((o, c) for o, c in _MARKS if o not in everything and c not in everything), None)
    if marks is None:
        return None
    opening, closing = marks
    marked_messages = [_marked(message, opening, closing) for message in messages]
    try:
        marked = render(marked_messages)
    except Exception:  # noqa: BLE001 - a template that inspects the text may refuse the marks; search instead
        return None
    spans, plain, start = [], [], None
    for char in marked:
        if char == opening and start is None:
            start = len(plain)
        elif char == closing and start is not None:
            spans.append((start, len(plain)))
            start = None
        elif char in (opening, closing):  # unbalanced: the template cut a message
            return None
        else:
            plain.append(char)
    return spans if start is None and "".join(plain) == rendered else None


def _marked(message: dict[str, Any], opening: str, closing: str) -> dict[str, Any]:
    def mark(value: Any) -> Any:
        if isinstance(value, str):
            return f"{opening}{value}{closing}"
        if isinstance(value, list):
            return [
                {**part, "text": mark(part["text"])} if isinstance(part, dict) and "text" in part else mark(part)
                for part in value
            ]
        return value

    marked = {**message, "content": mark(message.get("content"))}
    if message.get("tool_calls"):
        marked["tool_calls"] = [_marked_call(call, mark) for call in message["tool_calls"]]
    return marked


def _marked_call(call: Any, mark) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": mark(function["arguments"])}}


def _found_spans(rendered: str, texts: list[str]) -> list[tuple[int, int]]:
    """The messages' text found in order in `rendered` (as is, or trimmed as templates often do)."""
    spans, cursor = [], 0
    for text in texts:
        for candidate in (text, text.strip()):
            at = rendered.find(candidate, cursor) if candidate else -1
            if at >= 0:
                spans.append((at, at + len(candidate)))
                cursor = at + len(candidate)
                break
    return spans


def _encode_pieces(tokenizer, rendered: str, plain_spans: list[tuple[int, int]]) -> list[int]:
    """Markup with special-token parsing on, the spans of message text with it off; BOS as `encode` adds it."""
    ids: list[int] = []
    cursor = 0
    for start, end in sorted(plain_spans):
        if start < cursor:
            continue
        ids += tokenizer.encode(rendered[cursor:start], add_bos=False) if start > cursor else []
        ids += tokenizer.encode(rendered[start:end], add_bos=False, parse_special=False)
        cursor = end
    ids += tokenizer.encode(rendered[cursor:], add_bos=False) if cursor < len(rendered) else []
    if tokenizer.add_bos and tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids.insert(0, tokenizer.bos_id)
    return ids


def placed_system_messages(tokenizer, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with those from the system (or developer) after the first turn where the chat template can
    put them: in place when it writes a system message there, else joined to the user's text next to them."""
    first_turn = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    later = [i for i in range(first_turn, len(messages)) if messages[i]["role"] == "system"]
    if not later or _writes_system_mid_conversation(tokenizer):
        return messages
    placed = [dict(m) for m in messages]
    for i in reversed(later):  # from the end, so a later one lands after an earlier one in the same message
        target = _user_beside(placed, i)
        text = placed.pop(i)["content"]
        if target is None:
            placed.append({"role": "user", "content": text})
            continue
        target -= target > i
        user = placed[target]["content"]
        placed[target]["content"] = f"{text}\n\n{user}" if target >= i else f"{user}\n\n{text}"
    return placed


def _user_beside(messages: list[dict[str, Any]], i: int) -> int | None:
    """The user message that takes the system message at `i`: the next one, or the one before when nothing but
    system messages follows it (the model's turn comes next)."""
    after = next((j for j in range(i + 1, len(messages)) if messages[j]["role"] == "user"), None)
    if after is not None:
        return after
    before = next((j for j in range(i - 1, -1, -1) if messages[j]["role"] != "system"), None)
    return before if before is not None and messages[before]["role"] == "user" else None


def _writes_system_mid_conversation(tokenizer) -> bool:
    """Whether the template renders a system message between turns (some refuse it, some drop it)."""
    mark = "\U000f0000system-probe\U000f0001"
    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "system", "content": mark}, {"role": "user", "content": "c"}]  # fmt: skip
    try:
        return mark in tokenizer.apply_chat_template(probe)
    except Exception:  # noqa: BLE001 - a template may raise on any role order it does not take
        return False
