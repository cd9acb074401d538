"""Anthropic's Messages API (`/v1/messages`) over the chat-completions machinery: a request becomes the chat
request the OpenAI routes build (messages with tool calls and results, tools, tool_choice, stops), and the
answer and its stream go back in Anthropic's shapes.

Unknown fields are ignored, as are those the real API would leave unseen by the model (`cache_control`,
`metadata`, `context_management`, `output_config.effort`); a known one this server does not implement and that
would change the answer (image and document blocks, MCP servers, containers, output formats, a prefilled answer)
is a 400 naming it. Tools the server cannot run (server tools such as web_search) and deferred ones
(`defer_loading`, shown to the model only once a tool search finds them) are left out of the prompt and named in
the answer's `akunu.tools_left_out`, as Claude Code sends them with every request. `thinking` is accepted: the
answer comes without thinking blocks, which the API allows. Sampling defaults to greedy, as on the OpenAI routes.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

from akunu.cli.server.openai_api import (
    ApiError,
    ContextTooLong,
    ParsedRequest,
    akunu_stats,
    chat_prompt_ids,
    chat_request,
    check_text,
)
from akunu.cli.server.tool_calls import TOOL_NAME, ToolRequest
from akunu.cli.server.worker import Finished, Piece

log = logging.getLogger("akunu.serve")
PATH = "/v1/messages"
OVERLOADED = 529  # Anthropic's status for a server too busy to take the request
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", OVERLOADED: "overloaded_error"}  # fmt: skip
MAX_STOP_SEQUENCES = 16  # each is looked for after every token
SHARED_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "stream")  # one name and meaning in both APIs
UNSUPPORTED = {"container": lambda v: True, "mcp_servers": lambda v: bool(v), "output_format": lambda v: True}
THINKING = ("thinking", "redacted_thinking")  # earlier thinking the client sends back: never shown to the model
CHOICES = {"auto": "auto", "any": "required", "tool": "named"}  # Anthropic's tool_choice types as ToolRequest's


@dataclass(frozen=True)
class MessagesRequest:
    chat: ParsedRequest
    stop_sequences: tuple[str, ...]  # the request's own, told apart from a template's stop
    tools_left_out: tuple[str, ...] = ()  # "name (why)" of each tool the prompt does not offer


def is_anthropic(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def parse_messages(body: dict, loaded, base_config) -> MessagesRequest:
    messages, tools, left_out = _conversation(body)
    if body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens' is required", param="max_tokens")
    stops = _stop_sequences(body.get("stop_sequences"))
    options = {name: body[name] for name in SHARED_FIELDS if name in body}
    if left_out:
        log.info("/v1/messages: tools left out of the prompt: %s", ", ".join(left_out))
    return MessagesRequest(chat_request(options, messages, tools, loaded, base_config, stops=stops), stops, left_out)


def count_tokens(body: dict, loaded) -> int:
    """The prompt tokens the same request to /v1/messages would have, also past the model's context: clients ask
    to learn whether they must compact."""
    messages, tools, _ = _conversation(body)
    return len(chat_prompt_ids(messages, tools, loaded))


def _conversation(body: dict) -> tuple[list[dict], ToolRequest | None, tuple[str, ...]]:
    """The messages as the OpenAI routes read them (system first), the tools offered and those left out."""
    check_text(body)
    for name, changes_meaning in UNSUPPORTED.items():
        if body.get(name) is not None and changes_meaning(body[name]):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    output = body.get("output_config")
    if isinstance(output, dict) and output.get("format") is not None:
        raise ApiError(400, "'output_config.format' is not supported by this server", param="output_config.format")
    tools, left_out = _tools(body.get("tools"), body.get("tool_choice"))
    system = body.get("system")
    system = [{"role": "system", "content": _text(system, "system")}] if system else []
    return [*system, *_history(body.get("messages"))], tools, left_out


# --- messages ------------------------------------------------------------------------------------


def _history(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    history, call_ids = [], set()
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise ApiError(400, f"messages[{i}].role must be user, assistant or system", param=f"messages[{i}].role")
        if role == "system":  # Claude Code's mid-conversation system turns; the template places them
            history.append({"role": "system", "content": _text(message.get("content"), f"messages[{i}].content")})
            continue
        blocks = _blocks(message.get("content"), f"messages[{i}].content")
        if role == "user":
            history += _user_turn(blocks, i, call_ids)
            continue
        history.append(_assistant_turn(blocks, i))
        call_ids.update(call["id"] for call in history[-1].get("tool_calls", ()))
    if messages[-1]["role"] == "assistant":  # Anthropic continues such a message; a chat template closes it
        last = f"messages[{len(messages) - 1}]"
        raise ApiError(400, f"{last}: a final assistant message (prefill) is not supported", param=last)
    return history


def _user_turn(blocks: list[dict], i: int, call_ids: set[str]) -> list[dict]:
    """Tool results become `tool` messages, text a user message, in the order the blocks come; a result
    answers a tool_use of an earlier message (`call_ids`)."""
    turn, text = [], []
    for j, block in enumerate(blocks):
        at = f"messages[{i}].content[{j}]"
        if _kind(block, at, ("text", "tool_result")) == "text":
            text.append(_block_text(block, at))
            continue
        if text:
            turn.append({"role": "user", "content": "\n\n".join(text)})
            text = []
        turn.append(_tool_result(block, at))
        if turn[-1]["tool_call_id"] not in call_ids:
            raise ApiError(400, f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: "
                           f"{turn[-1]['tool_call_id'][:80]}. Each `tool_result` block must have a corresponding "
                           "`tool_use` block in an earlier message.", param=f"{at}.tool_use_id")  # fmt: skip
    return [*turn, {"role": "user", "content": "\n\n".join(text)}] if text or not turn else turn


def _assistant_turn(blocks: list[dict], i: int) -> dict:
    text, calls = [], []
    for j, block in enumerate(blocks):
        at = f"messages[{i}].content[{j}]"
        kind = _kind(block, at, ("text", "tool_use", *THINKING))
        if kind == "text":
            text.append(_block_text(block, at))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
    message = {"role": "assistant", "content": "\n\n".join(text)}
    return {**message, "tool_calls": calls} if calls else message


def _tool_use(block: dict, at: str) -> dict:
    """An earlier call, as the OpenAI routes read one: its input stays an object, for the template's `tojson`."""
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, dict)):
        raise ApiError(400, f"{at} must be a tool_use block with an id, a name and an input object", param=at)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(block: dict, at: str) -> dict:
    call_id, is_error = block.get("tool_use_id"), block.get("is_error", False)
    if not isinstance(call_id, str):
        raise ApiError(400, f"{at}.tool_use_id must be the id of the tool_use this answers", param=f"{at}.tool_use_id")
    if not isinstance(is_error, bool):
        raise ApiError(400, f"{at}.is_error must be true or false", param=f"{at}.is_error")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{at}.content")
    # A chat template has no place for the flag, so the model reads it in the result.
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}" if is_error else text}


def _text(content, param: str) -> str:
    """A string, or text blocks joined as paragraphs (`system`, a tool result's content)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(_blocks(content, param)):
        _kind(block, f"{param}[{j}]", ("text",))
        texts.append(_block_text(block, f"{param}[{j}]"))
    return "\n\n".join(texts)


def _blocks(content, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise ApiError(400, f"{param} must be a string or a list of content blocks", param=param)
    return content


def _kind(block: dict, at: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type")
    if kind not in allowed:
        raise ApiError(400, f"{at}.type '{kind}' is not supported here; this server takes {', '.join(allowed)} blocks",
                       param=f"{at}.type")  # fmt: skip
    return kind


def _block_text(block: dict, at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise ApiError(400, f"{at}.text must be a string", param=f"{at}.text")
    return block["text"]


def _stop_sequences(stops) -> tuple[str, ...]:
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(stop, str) and stop for stop in stops):
        raise ApiError(400, "'stop_sequences' must be a list of non-empty strings", param="stop_sequences")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ApiError(400, f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} strings (got {len(stops)})",
                       param="stop_sequences")  # fmt: skip
    return tuple(stops)


# --- tools ---------------------------------------------------------------------------------------


def _tools(tools, choice) -> tuple[ToolRequest | None, tuple[str, ...]]:
    """The tools as a ToolRequest (None without tools or with tool_choice none), so calls are forced and read
    as on the OpenAI routes; and "name (why)" of each tool left out."""
    kind, name, parallel = _tool_choice(choice)
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {name, description, input_schema}", param="tools")
    offered = [(i, tool) for i, tool in enumerate(tools or ()) if _left_out(tool) is None]
    left_out = tuple(_left_out(tool) for tool in tools or () if _left_out(tool) is not None)
    if not offered:
        if kind in ("any", "tool"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None, left_out
    functions = [_function(tool, f"tools[{i}]") for i, tool in offered]
    names = [function["name"] for function in functions]
    if len(set(names)) < len(names):
        raise ApiError(400, "tool names must be unique", param="tools")
    if kind == "tool" and name not in names:
        raise ApiError(400, f"tool_choice.name '{name}' is none of the tools", param="tool_choice.name")
    tool_request = None if kind == "none" else ToolRequest(functions, CHOICES[kind], name, parallel=parallel)
    return tool_request, left_out


def _left_out(tool) -> str | None:
    """Why the prompt leaves this tool out ("name (why)"), None when it offers it."""
    if not isinstance(tool, dict):
        return None
    if tool.get("type") not in (None, "custom"):
        return f"{tool.get('name', '?')} ({tool['type']}: a server tool, which this server does not run)"
    if tool.get("defer_loading") is True:
        return f"{tool.get('name', '?')} (defer_loading: shown only once a tool search finds it)"
    return None


def _tool_choice(choice) -> tuple[str, str | None, bool]:
    """(type, the named tool, whether several calls may come)."""
    if choice is None:
        return "auto", None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*CHOICES, "none"):
        raise ApiError(400, "tool_choice must be {type: auto, any, tool (with a name) or none}", param="tool_choice")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise ApiError(400, "tool_choice.disable_parallel_tool_use must be true or false",
                       param="tool_choice.disable_parallel_tool_use")  # fmt: skip
    name = choice.get("name") if kind == "tool" else None
    return kind, name, not single and kind != "tool"


def _function(tool, at: str) -> dict:
    """A custom tool as the function the chat template is given."""
    if not isinstance(tool, dict):
        raise ApiError(400, f"{at} must be a {{name, description, input_schema}} object", param=at)
    if tool.get("type") not in (None, "custom"):
        raise ApiError(400, f"{at}.type '{tool['type']}' is a server tool, which this server does not run",
                       param=f"{at}.type")  # fmt: skip
    name, schema, description = tool.get("name"), tool.get("input_schema"), tool.get("description", "")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ApiError(400, f"{at}.name must be 1 to 64 letters, digits, '_', '.' or '-'", param=f"{at}.name")
    if not isinstance(schema, dict):
        raise ApiError(400, f"{at}.input_schema must be a JSON schema object", param=f"{at}.input_schema")
    if not isinstance(description, str):
        raise ApiError(400, f"{at}.description must be a string", param=f"{at}.description")
    return {"name": name, **({"description": description} if description else {}), "parameters": schema}


# --- responses -----------------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def message_body(
    request: MessagesRequest, message_id: str, model: str, text: str | None, calls, finished: Finished
) -> dict:
    reason, sequence = stop_reason(request, finished, bool(calls))
    blocks = ([_text_block(text)] if text and text.strip() else []) + [_tool_use_block(call) for call in calls]
    return {
        **_message(message_id, model, blocks, reason, sequence, usage(finished.stats)),
        "akunu": akunu_stats(finished.stats, request.tools_left_out),
    }


def stop_reason(request: MessagesRequest, finished: Finished, made_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence); as on the OpenAI routes, a max_tokens cut wins over the calls it cut."""
    if finished.finish_reason == "length":  # by max_tokens, or earlier by the end of the model's context
        asked = finished.stats.generated_tokens >= request.chat.config.max_tokens
        return "max_tokens" if asked else "model_context_window_exceeded", None
    if made_calls:
        return "tool_use", None
    stop = finished.stats.stop_string
    if stop is not None and stop in request.stop_sequences:
        return "stop_sequence", stop
    return "end_turn", None


def usage(stats) -> dict:
    """Anthropic counts apart the prompt tokens read from a cache: input_tokens are the ones prefilled."""
    return {"input_tokens": stats.prefilled_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": stats.prompt_tokens - stats.prefilled_tokens,
            "output_tokens": stats.generated_tokens}  # fmt: skip


def error_answer(error: ApiError) -> tuple[int, dict]:
    """The status and body Anthropic answers this error with; a full queue is its 529 overloaded_error."""
    status = OVERLOADED if error.status == 429 else error.status
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    if isinstance(error, ContextTooLong):  # the words Claude Code reads to know it must compact
        return status, error_body(kind, f"prompt is too long: {error.tokens} tokens > {error.context} maximum")
    return status, error_body(kind, error.message, error.param)


def error_body(kind: str, message: str, param: str | None = None) -> dict:
    """Anthropic's error object; its message names the field at fault and is one line."""
    message = " ".join(message.splitlines())
    return {
        "type": "error",
        "error": {"type": kind, "message": f"{param}: {message}" if param and param not in message else message},
    }


def _message(
    message_id: str, model: str, content: list, reason: str | None, sequence: str | None, counts: dict
) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": counts}  # fmt: skip


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _tool_use_block(call) -> dict:
    """A tool_call.ToolCall as a tool_use block, its id in Anthropic's form."""
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
            "input": json.loads(call.arguments)}  # fmt: skip


# --- streaming -----------------------------------------------------------------------------------


async def message_events(request: MessagesRequest, answer, message_id: str, model: str, events):
    """Anthropic's server-sent events for a job's events; `answer` (app.Answer) splits text from tool calls."""
    start = _message(
        message_id, model, [], None, None, {"input_tokens": len(request.chat.prompt_ids), "output_tokens": 0}
    )
    yield _event("message_start", message=start)
    blocks = _StreamedBlocks()
    async for event in events:
        if isinstance(event, Piece):
            text, calls, _ = answer.add(event)
            for line in blocks.add(text, [call for _, call in calls]):
                yield line
        elif isinstance(event, Finished):
            text, calls, _ = answer.finish(cut=event.finish_reason == "length")
            for line in [*blocks.add(text, [call for _, call in calls]), *blocks.close()]:
                yield line
            reason, sequence = stop_reason(request, event, answer.sent_calls > 0)
            yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                         usage=usage(event.stats), akunu=akunu_stats(event.stats, request.tools_left_out))  # fmt: skip
            yield _event("message_stop")
        else:
            kind = "invalid_request_error" if event.client_error else "api_error"
            yield _event("error", error=error_body(kind, event.message, event.param)["error"])


class _StreamedBlocks:
    """Content blocks as they stream: text goes to an open text block (whitespace alone opens none, as a whole
    answer has no blank text block); each tool call is a whole tool_use block."""

    def __init__(self) -> None:
        self.index, self.text_open, self.held = 0, False, ""

    def add(self, text: str, calls) -> list[str]:
        lines = []
        if text and not self.text_open:
            self.held += text
            text = ""
            if self.held.strip():
                lines.append(_event("content_block_start", index=self.index, content_block=_text_block("")))
                self.text_open, text, self.held = True, self.held, ""
        if text:
            lines.append(_event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text}))
        for call in calls:
            lines += self.close()
            block = _tool_use_block(call)
            lines += [
                _event("content_block_start", index=self.index, content_block={**block, "input": {}}),
                _event("content_block_delta", index=self.index,
                       delta={"type": "input_json_delta", "partial_json": call.arguments}),
                _event("content_block_stop", index=self.index),
            ]  # fmt: skip
            self.index += 1
        return lines

    def close(self) -> list[str]:
        """Close the open text block, if there is one."""
        if not self.text_open:
            return []
        self.text_open, self.index = False, self.index + 1
        return [_event("content_block_stop", index=self.index - 1)]


def _event(kind: str, **body) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"
