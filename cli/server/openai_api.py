"""The OpenAI wire format: request bodies become prompt ids and a GenerationConfig; results become bodies.

Unknown fields are ignored, as OpenAI-compatible servers do; a known field with a bad value, or one this
server does not implement and that would change the answer (UNSUPPORTED), is a 400 naming the field. Sampling defaults to greedy (temperature 0), like `akunu generate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass

from akunu.cli.server.tool_calls import HERMES, ToolRequest, ToolRequestError, family_of, tool_request

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


class ContextTooLong(ApiError):
    """A prompt of `tokens` (at least, when counted from its `size` in bytes before tokenizing) that leaves no
    room in a context of `context` tokens, in OpenAI's words; anthropic_api words it as Anthropic does."""

    def __init__(self, tokens: int, context: int, param: str, *, size: int | None = None) -> None:
        self.tokens, self.context = tokens, context
        counted = f"{size:,} bytes of text, at least {tokens}" if size is not None else f"{tokens}"
        message = (f"This model's maximum context length is {context} tokens. However, your {param} resulted in "
                   f"{counted} tokens. Please reduce the length of the {param}.")  # fmt: skip
        super().__init__(400, message, param=param, code="context_length_exceeded")


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # CHAT or COMPLETION
    prompt_ids: list[int]
    config: object  # GenerationConfig
    stream: bool
    include_usage: bool
    tools: ToolRequest | None = None  # calls are read from the answer only when tools are offered
    family: str = HERMES  # how the model writes tool calls
    constraint: object = None  # config.grammar compiled and checked (akunu.grammar.Constraint), for the worker
    grammar_param: str | None = None  # the field that asked for the grammar, blamed for its errors


# Fields that would change the answer's meaning if ignored: refused unless given their neutral value.
UNSUPPORTED = {
    "logit_bias": lambda v: bool(v),
    "frequency_penalty": lambda v: v not in (0, 0.0),
    "presence_penalty": lambda v: v not in (0, 0.0),
    "best_of": lambda v: v != 1,
    "echo": lambda v: v is not False,
    "suffix": lambda v: v != "",
    "functions": lambda v: True,
    "function_call": lambda v: True,
    "audio": lambda v: True,
    "prediction": lambda v: True,
    "modalities": lambda v: v != ["text"],
}
MAX_STOPS = 4  # as OpenAI's API
MAX_TOP_LOGPROBS = {CHAT: 20, COMPLETION: 5}
GREEDY_BELOW = 1e-5  # a temperature this small is greedy: dividing logits by it overflows


def parse_chat(body: dict, loaded, base_config) -> ParsedRequest:
    check_text(body)
    messages = _messages(body.get("messages"))
    try:
        tools = tool_request(body)
    except ToolRequestError as error:
        raise ApiError(400, str(error), param=error.param) from None
    return chat_request(body, messages, tools, loaded, base_config)


def chat_request(body: dict, messages: list[dict], tools: ToolRequest | None, loaded, base_config, *,
                 stops: tuple[str, ...] = ()) -> ParsedRequest:  # fmt: skip
    """A chat whose messages (as `_message` reads them) and tools are read already; `body` holds the
    generation options under OpenAI's names; `stops` are more stop strings (another API's)."""
    from akunu.cli.conversation import PLAIN_USER_PREFIX

    tokenizer = loaded.tokenizer
    _check_fits([m["content"] for m in messages], loaded.context_length, "messages")
    prompt_ids = chat_prompt_ids(messages, tools, loaded)
    # Without a chat template the conversation is a transcript: stop where the user's next line would begin.
    extra_stop = () if tokenizer.has_chat_template else (PLAIN_USER_PREFIX,)
    parsed = _parsed(CHAT, body, loaded, base_config, prompt_ids, (*stops, *extra_stop))
    family = family_of(getattr(tokenizer, "chat_template", None))
    forced = _grammar("tools", tools.forced, family) if tools else None
    if forced is not None:
        if parsed.config.grammar is not None:
            raise ApiError(
                400,
                "tool_choice required or a named function cannot be combined with response_format",
                param="tool_choice",
            )
        grammar = _grammar("tools", _forced_grammar, forced, tools.parallel)
        parsed = dataclasses.replace(
            parsed, config=dataclasses.replace(parsed.config, grammar=grammar), grammar_param="tools"
        )
    return compiled(dataclasses.replace(parsed, tools=tools, family=family), tokenizer)


def chat_prompt_ids(messages: list[dict], tools: ToolRequest | None, loaded) -> list[int]:
    """The prompt the model's chat template makes of these messages and tools (however long: count_tokens
    counts past the context); a 400 when it cannot."""
    from akunu.cli.conversation import Conversation
    from akunu.models.chat_encoding import placed_system_messages

    tokenizer = loaded.tokenizer
    if tools and not tokenizer.has_chat_template:
        raise ApiError(400, "this model has no chat template to offer tools through", param="tools")
    first_turn = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system = "\n\n".join(m["content"] for m in messages[:first_turn]) or None
    conversation = Conversation(system=system, turns=messages[first_turn:])
    try:
        if not tokenizer.has_chat_template:
            return conversation.prompt_ids(tokenizer)
        placed = placed_system_messages(tokenizer, conversation.messages())
        if tools:
            _check_template_takes_tools(tokenizer, placed, tools)
        return tokenizer.encode_chat(placed, tools=tools.template_tools() if tools else None)
    except ApiError:
        raise
    except Exception as error:  # noqa: BLE001  (a chat template may reject a message order)
        raise ApiError(400, f"the chat template cannot render these messages: {error}", param="messages") from None


def _check_template_takes_tools(tokenizer, messages: list[dict], tools: ToolRequest) -> None:
    """A 400 if the chat template writes the same prompt with the tools as without: they would be dropped unseen."""
    with_tools = tokenizer.apply_chat_template(messages, tools=tools.template_tools())
    if with_tools == tokenizer.apply_chat_template(messages):
        raise ApiError(400, "this model's chat template has no place for tools, so the model would never see them; "
                       "send the request without 'tools'", param="tools")  # fmt: skip


def parse_completion(body: dict, loaded, base_config) -> ParsedRequest:
    check_text(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(
            400,
            f"one prompt per request (got a batch of {len(prompt)}); send them as separate requests",
            param="prompt",
        )
    if isinstance(prompt, str) and prompt:
        _check_fits([prompt], loaded.context_length, "prompt")
        prompt_ids = loaded.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < loaded.tokenizer.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {loaded.tokenizer.vocab_size})", param="prompt")
        prompt_ids = list(prompt)
    else:
        raise ApiError(
            400,
            "'prompt' must be a non-empty string or list of token ids (or a list holding one of them)",
            param="prompt",
        )
    return compiled(_parsed(COMPLETION, body, loaded, base_config, prompt_ids, ()), loaded.tokenizer)


def check_text(body: dict) -> None:
    """Every string in the body is text: JSON's "\\ud800" escapes decode to lone surrogates, which no tokenizer takes."""
    stack = [(body, "")]
    while stack:  # iterative: a deeply nested body must not overflow Python's stack
        value, path = stack.pop()
        if isinstance(value, str) and not _is_text(value):
            field = path or "the request body"
            raise ApiError(
                400,
                f"{field} holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape), which is not text",
                param=path or None,
            )
        if isinstance(value, dict):
            stack += [(key, path) for key in value]
            stack += [(item, f"{path}.{key}" if path else str(key)) for key, item in value.items()]
        elif isinstance(value, list):
            stack += [(item, f"{path}[{i}]") for i, item in enumerate(value)]


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_fits(texts: list[str], context: int | None, param: str) -> None:
    """A 400 for text no tokenization could fit in the context, before tokenizing it (which would block for
    seconds and take hundreds of MB for a multi-megabyte prompt, only to refuse it)."""
    from akunu.cli.text_input import BYTES_PER_TOKEN, text_limit

    size = sum(len(text.encode("utf-8")) for text in texts)
    if context and size > text_limit(context):
        raise ContextTooLong(size // BYTES_PER_TOKEN, context, param, size=size)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    parsed, call_ids = [], set()
    for i, message in enumerate(messages):
        parsed.append(_message(message, i))
        call_ids.update(call["id"] for call in parsed[-1].get("tool_calls", ()))
        if parsed[-1]["role"] == "tool" and parsed[-1]["tool_call_id"] not in call_ids:
            raise ApiError(400, f"messages[{i}].tool_call_id {json.dumps(parsed[-1]['tool_call_id'][:80])} answers "
                           "no tool call of an earlier assistant message", param=f"messages[{i}].tool_call_id")  # fmt: skip
    return parsed


def _message(message, i: int) -> dict:
    """One history message as chat templates take it: role, content text, and an assistant's tool calls or a tool result's id."""
    role = message.get("role") if isinstance(message, dict) else None
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant", "tool"):
        raise ApiError(
            400, f"messages[{i}].role must be system, developer, user, assistant or tool", param=f"messages[{i}].role"
        )
    parsed = {"role": role, "content": _content(message.get("content"), i)}
    if role == "assistant" and message.get("tool_calls"):
        parsed["tool_calls"] = _history_calls(message["tool_calls"], i)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ApiError(
                400,
                f"messages[{i}].tool_call_id must be the id of the call this answers",
                param=f"messages[{i}].tool_call_id",
            )
        parsed["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        parsed["name"] = message["name"]
    return parsed


def _history_calls(calls, i: int) -> list[dict]:
    """An assistant's earlier calls; arguments become objects, as chat templates write them with `tojson`."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{param} must be a list of calls", param=param)
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), (str, dict))
        ):
            raise ApiError(400, f"{param} must hold {{id, type: function, function: {{name, arguments}}}}", param=param)
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ApiError(400, f"{param}: the arguments of {function['name']} are not JSON", param=param) from None
        parsed.append(
            {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return parsed


def _content(content, i: int) -> str:
    """A string, null, or a list of text parts (what newer clients send)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(
        400, f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content"
    )


def _parsed(
    kind: str, body: dict, loaded, base_config, prompt_ids: list[int], extra_stop: tuple[str, ...]
) -> ParsedRequest:
    context = loaded.context_length
    if context and len(prompt_ids) >= context:  # never cut: the client compacts its history on this error
        raise ContextTooLong(len(prompt_ids), context, "messages" if kind == CHAT else "prompt")
    for name, changes_meaning in UNSUPPORTED.items():
        if body.get(name) is not None and changes_meaning(body[name]):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    if _field(body, "n", 1, int, low=1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens")
    max_tokens = _field(
        body, "max_completion_tokens" if max_tokens is not None else "max_tokens", base_config.max_tokens, int, low=1
    )
    stream = _field(body, "stream", False, bool)
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    drafting = _field(body, "speculative", True, bool)  # akunu's extension: false decodes without drafts
    spec = base_config.spec if drafting else dataclasses.replace(base_config.spec, enabled=False)
    config = dataclasses.replace(
        base_config, max_tokens=max_tokens, sampling=_sampling(body, loaded), stop=(*_stops(body.get("stop")), *extra_stop), spec=spec,
        grammar=_grammar("response_format", _response_format, body.get("response_format")), logprobs=_logprobs(kind, body),
    )  # fmt: skip
    return ParsedRequest(kind, prompt_ids, config, stream, include_usage, grammar_param="response_format")


def _sampling(body: dict, loaded):
    from akunu.sampling import SamplingParams

    temp = _field(body, "temperature", 0.0, float, low=0.0)
    top_p = _field(body, "top_p", 1.0, float, low=0.0, high=1.0)
    greedy = temp < GREEDY_BELOW or top_p == 0  # top_p 0 keeps only the most likely token, as OpenAI reads it
    return SamplingParams(
        temp=0.0 if greedy else temp,
        top_p=1.0 if greedy else top_p,
        top_k=_field(body, "top_k", 0, int, low=0, high=loaded.tokenizer.vocab_size - 1),
        min_p=_field(body, "min_p", 0.0, float, low=0.0, high=1.0),
        seed=_field(body, "seed", None, int, low=0, high=2**64 - 1),
    )


def _logprobs(kind: str, body: dict) -> int | None:
    """How many alternatives each token's logprobs list (0: the token's own only); None: no logprobs."""
    most = MAX_TOP_LOGPROBS[kind]
    if kind == COMPLETION:  # the legacy API: logprobs is the number of alternatives
        return _field(body, "logprobs", None, int, low=0, high=most)
    top = _field(body, "top_logprobs", None, int, low=0, high=most)
    if not _field(body, "logprobs", False, bool):
        if top is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top or 0


def compiled(parsed: ParsedRequest, tokenizer) -> ParsedRequest:
    """The request with its grammar compiled and its first step computed, so that a schema that is bad, admits
    nothing or is too complex is a 400 naming its field before the request is queued."""
    from akunu.grammar import Constraint

    if parsed.config.grammar is None:
        return parsed
    constraint = _grammar(parsed.grammar_param, Constraint, parsed.config.grammar, tokenizer)
    _grammar(parsed.grammar_param, constraint.check_start)
    return dataclasses.replace(parsed, constraint=constraint)


def _grammar(param: str, step, *args):
    """`step(*args)`, one stage of building a grammar; its failure is a 400 naming `param` in one line."""
    from akunu.errors import OptionsError

    try:
        return step(*args)
    except OptionsError as error:
        message = str(error) if str(error).startswith(param) else f"{param}: {error}"
        raise ApiError(400, message, param=param) from None
    except RecursionError:
        raise ApiError(400, f"{param}: the schema is nested too deeply", param=param) from None


def _forced_grammar(forced, parallel: bool) -> str:
    from akunu.grammar import wrapped_json_grammar

    return wrapped_json_grammar(
        forced.prefix, forced.schema, forced.suffix, separator=forced.separator if parallel else None
    )


def _response_format(response_format) -> str | None:
    """The grammar `response_format` asks for (akunu.grammar), None for text."""
    from akunu.grammar import response_format_grammar

    return None if response_format is None else response_format_grammar(response_format)


def _field(body: dict, name: str, default, kind: type, *, low=None, high=None, low_open: bool = False):
    """body[name] checked for type and range; null or missing gives the default."""
    value = body.get(name)
    if value is None:
        return default
    numeric = kind in (int, float)
    wrong_type = isinstance(value, bool) != (kind is bool) or not isinstance(
        value, (int, float) if kind is float else kind
    )
    if wrong_type or (numeric and not math.isfinite(value)):
        raise ApiError(
            400,
            f"'{name}' must be {'a number' if kind is float else 'an integer' if kind is int else 'true or false'}",
            param=name,
        )
    too_low = low is not None and (value <= low if low_open else value < low)
    if numeric and (too_low or (high is not None and value > high)):
        bounds = (
            f"{'(' if low_open else '['}{low}, {high if high is not None else '∞'}{']' if high is not None else ')'}"
        )
        raise ApiError(400, f"'{name}' must be in {bounds} (got {value})", param=name)
    return kind(value)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOPS:
            raise ApiError(400, f"'stop' may hold at most {MAX_STOPS} strings (got {len(stop)})", param="stop")
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


def akunu_stats(stats, tools_left_out: tuple[str, ...] = ()) -> dict:
    """The speculative-decoding numbers `akunu chat` shows, plus how much of the prompt was prefilled, and the
    request's tools the prompt left out ("name (why)"), if any."""
    numbers = stats.to_dict()
    keys = "forward_passes drafted accepted acceptance_rate tokens_per_pass decode_tps prompt_tokens prefilled_tokens prefill_tps"
    left_out = {"tools_left_out": list(tools_left_out)} if tools_left_out else {}
    return {**{key: numbers[key] for key in keys.split()}, **left_out}


def completion_body(kind: str, request_id: str, model: str, text: str | None, finish_reason: str, stats, *,
                    tool_calls=(), logprobs: dict | None = None) -> dict:  # fmt: skip
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if kind == CHAT:
        choice["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            choice["message"]["tool_calls"] = [call.to_openai() for call in tool_calls]
    else:
        choice["text"] = text
    return {
        **_envelope(kind, request_id, model, chunk=False),
        "choices": [choice],
        "usage": usage(stats),
        "akunu": akunu_stats(stats),
    }


def chunk_body(kind: str, request_id: str, model: str, text: str | None, *, first: bool = False,
               finish_reason: str | None = None, stats=None, tool_calls=(), logprobs: dict | None = None,
               drafted: bool = False) -> dict:  # fmt: skip
    """One server-sent event: new text or tool calls (`tool_calls`: (index, ToolCall) pairs), or the last one with
    the finish reason (and the usage); `text=None` with `stats` alone is the usage-only chunk `include_usage` asks for.
    `drafted`: the text came from accepted draft tokens, sent as `"akunu": {"drafted": true}` (clients ignore it)."""
    body = _envelope(kind, request_id, model, chunk=True)
    body["choices"] = []
    if text is not None or finish_reason is not None or tool_calls or logprobs:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
        if kind == CHAT:
            delta = {"role": "assistant"} if first else {}
            if text or (first and not tool_calls):
                delta["content"] = text or ""
            if tool_calls:
                delta["tool_calls"] = [{"index": index, **call.to_openai()} for index, call in tool_calls]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body["choices"] = [choice]
    if stats is not None:
        body["usage"], body["akunu"] = usage(stats), akunu_stats(stats)
    elif drafted:
        body["akunu"] = {"drafted": True}
    return body


def logprobs_body(kind: str, entries, tokenizer, offset: int = 0) -> dict | None:
    """OpenAI's `logprobs` object for these tokens (akunu.logprobs.TokenLogprobs); `offset`: text before them (completions)."""
    if not entries:
        return None
    if kind == CHAT:
        return {"content": [{**_token_entry(e.token, e.logprob, tokenizer), "top_logprobs": [_token_entry(t, v, tokenizer) for t, v in e.top]}
                            for e in entries], "refusal": None}  # fmt: skip
    texts = [_token_text(e.token, tokenizer) for e in entries]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(t, tokenizer): v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def _token_entry(token: int, logprob: float, tokenizer) -> dict:
    raw = tokenizer.token_bytes[token] if hasattr(tokenizer, "token_bytes") else _token_text(token, tokenizer).encode()
    return {"token": _token_text(token, tokenizer), "logprob": max(logprob, -9999.0), "bytes": list(raw)}


def _token_text(token: int, tokenizer) -> str:
    return tokenizer.token_text(token)


def _envelope(kind: str, request_id: str, model: str, *, chunk: bool) -> dict:
    return {
        "id": request_id,
        "object": f"{kind}.chunk" if chunk and kind == CHAT else kind,
        "created": int(time.time()),
        "model": model,
    }
