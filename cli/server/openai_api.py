"""The OpenAI wire format: request bodies become prompt ids and a GenerationConfig; results become bodies.

Unknown fields are ignored, as OpenAI-compatible servers do; a known field with a bad value is a 400
naming the field. Sampling defaults to greedy (temperature 0), like `akunu generate`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass

CHAT, COMPLETION = "chat.completion", "text_completion"


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # CHAT or COMPLETION
    prompt_ids: list[int]
    config: object  # GenerationConfig
    stream: bool
    include_usage: bool


def parse_chat(body: dict, loaded, base_config) -> ParsedRequest:
    from akunu.cli.conversation import PLAIN_USER_PREFIX, Conversation

    messages = _messages(body.get("messages"))
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
    conversation = Conversation(system=system, turns=[m for m in messages if m["role"] != "system"])
    try:
        prompt_ids = conversation.prompt_ids(loaded.tokenizer)
    except Exception as error:  # noqa: BLE001  (a chat template may reject a message order)
        raise ApiError(400, f"the chat template cannot render these messages: {error}", param="messages") from None
    # Without a chat template the conversation is a transcript: stop where the user's next line would begin.
    extra_stop = () if loaded.tokenizer.has_chat_template else (PLAIN_USER_PREFIX,)
    return _parsed(CHAT, body, loaded, base_config, prompt_ids, extra_stop)


def parse_completion(body: dict, loaded, base_config) -> ParsedRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        prompt_ids = loaded.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < loaded.tokenizer.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {loaded.tokenizer.vocab_size})", param="prompt")
        prompt_ids = list(prompt)
    else:
        raise ApiError(400, "'prompt' must be a non-empty string (or a list of token ids); one prompt per request", param="prompt")
    return _parsed(COMPLETION, body, loaded, base_config, prompt_ids, ())


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be system, developer, user or assistant", param=f"messages[{i}].role")
        parsed.append({"role": role, "content": _content(message.get("content"), i)})
    return parsed


def _content(content, i: int) -> str:
    """A string, null, or a list of text parts (what newer clients send)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")


def _parsed(kind: str, body: dict, loaded, base_config, prompt_ids: list[int], extra_stop: tuple[str, ...]) -> ParsedRequest:
    from akunu.sampling import SamplingParams

    context = loaded.context_length
    if context and len(prompt_ids) >= context:
        raise ApiError(
            400, f"the prompt has {len(prompt_ids)} tokens but the model's context is {context} tokens",
            param="messages" if kind == CHAT else "prompt", code="context_length_exceeded",
        )  # fmt: skip
    if _field(body, "n", 1, int, low=1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens")
    max_tokens = _field(body, "max_completion_tokens" if max_tokens is not None else "max_tokens", base_config.max_tokens, int, low=1)
    sampling = SamplingParams(
        temp=_field(body, "temperature", 0.0, float, low=0.0),
        top_p=_field(body, "top_p", 1.0, float, low=0.0, high=1.0, low_open=True),
        top_k=_field(body, "top_k", 0, int, low=0, high=loaded.tokenizer.vocab_size - 1),
        min_p=_field(body, "min_p", 0.0, float, low=0.0, high=1.0),
        seed=_field(body, "seed", None, int, low=0, high=2**64 - 1),
    )
    stream = _field(body, "stream", False, bool)
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    config = dataclasses.replace(base_config, max_tokens=max_tokens, sampling=sampling, stop=(*_stops(body.get("stop")), *extra_stop),
                                 grammar=_response_format(body.get("response_format")))  # fmt: skip
    return ParsedRequest(kind, prompt_ids, config, stream, include_usage)


def _response_format(response_format) -> str | None:
    """The grammar `response_format` asks for (akunu.grammar), None for text; a bad one is a 400."""
    from akunu.errors import OptionsError
    from akunu.grammar import response_format_grammar

    if response_format is None:
        return None
    try:
        return response_format_grammar(response_format)
    except OptionsError as error:
        raise ApiError(400, str(error), param="response_format") from None


def _field(body: dict, name: str, default, kind: type, *, low=None, high=None, low_open: bool = False):
    """body[name] checked for type and range; null or missing gives the default."""
    value = body.get(name)
    if value is None:
        return default
    numeric = kind in (int, float)
    wrong_type = isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind)
    if wrong_type or (numeric and not math.isfinite(value)):
        raise ApiError(400, f"'{name}' must be {'a number' if kind is float else 'an integer' if kind is int else 'true or false'}", param=name)
    too_low = low is not None and (value <= low if low_open else value < low)
    if numeric and (too_low or (high is not None and value > high)):
        bounds = f"{'(' if low_open else '['}{low}, {high if high is not None else '∞'}{']' if high is not None else ')'}"
        raise ApiError(400, f"'{name}' must be in {bounds} (got {value})", param=name)
    return kind(value)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")


# --- responses ---------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.prefilled_tokens},
    }


def akunu_stats(stats) -> dict:
    """The speculative-decoding numbers `akunu chat` shows, plus how much of the prompt was prefilled."""
    numbers = stats.to_dict()
    keys = "forward_passes drafted accepted acceptance_rate tokens_per_pass decode_tps prompt_tokens prefilled_tokens prefill_tps"
    return {key: numbers[key] for key in keys.split()}


def completion_body(kind: str, request_id: str, model: str, text: str, finish_reason: str, stats) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if kind == CHAT:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {**_envelope(kind, request_id, model, chunk=False), "choices": [choice], "usage": usage(stats), "akunu": akunu_stats(stats)}


def chunk_body(kind: str, request_id: str, model: str, text: str | None, *, first: bool = False,
               finish_reason: str | None = None, stats=None) -> dict:  # fmt: skip
    """One server-sent event: new text, or the last one with the finish reason (and the usage); `text=None`
    with `stats` is the usage-only chunk `stream_options.include_usage` asks for."""
    body = _envelope(kind, request_id, model, chunk=True)
    if text is not None or finish_reason is not None:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if kind == CHAT:
            choice["delta"] = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        else:
            choice["text"] = text or ""
        body["choices"] = [choice]
    else:
        body["choices"] = []
    if stats is not None:
        body["usage"], body["akunu"] = usage(stats), akunu_stats(stats)
    return body


def _envelope(kind: str, request_id: str, model: str, *, chunk: bool) -> dict:
    return {"id": request_id, "object": f"{kind}.chunk" if chunk and kind == CHAT else kind, "created": int(time.time()), "model": model}
