"""OpenAI's Responses API (`/v1/responses`, what Codex speaks) over the chat-completions machinery: input items
become the chat messages the chat route builds (tool calls and their outputs included), `text.format` its
`response_format`, and the answer and its stream go back as a Response object and Responses events.

Responses are kept in memory (the last MAX_STORED) so that `previous_response_id` continues one. Unknown fields
are ignored, as are those the model never sees (`prompt_cache_key`, `client_metadata`, `metadata`); a known one
this server does not implement and that would change the answer (`include` beyond reasoning, background mode,
stored prompts, conversations) is a 400 naming it. `namespace` tools are groups of function tools: each is
offered as `namespace.name`, and its calls come back with `name` and `namespace` apart. Built-in tools
(web_search and the like), which Codex sends with every request, are left out of the prompt and named in the
answer's `akunu.tools_left_out`. `reasoning` is accepted: answers come without reasoning items. Sampling
defaults to greedy, as on the chat route.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from akunu.cli.server.openai_api import ApiError, ParsedRequest, akunu_stats, chat_request, check_text
from akunu.cli.server.tool_calls import TOOL_NAME, ToolRequest
from akunu.cli.server.worker import Finished, Piece

log = logging.getLogger("akunu.serve")
MAX_STORED = 256  # responses kept for previous_response_id; the oldest goes first
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
SKIPPED_ITEMS = ("reasoning",)  # earlier reasoning a client sends back: never shown to the model
UNSUPPORTED = {
    "background": lambda v: v is not False,
    "include": lambda v: not isinstance(v, list) or not all(str(x).startswith("reasoning.") for x in v),
    "prompt": lambda v: True,
    "conversation": lambda v: True,
    "truncation": lambda v: v != "disabled",
    "top_logprobs": lambda v: v != 0,
    "max_tool_calls": lambda v: True,
}
CHAT_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ParsedRequest
    history: list[dict]  # the conversation as chat messages, without `instructions`: what a follow-up continues
    store: bool
    echo: dict  # the request's settings, which a Response object repeats
    created_at: int
    tools_left_out: tuple[str, ...] = ()  # "name (why)" of each tool the prompt does not offer
    namespaces: dict = dataclasses.field(default_factory=dict)  # "namespace.name" offered -> (namespace, name)


class ResponseStore:
    """The conversations of the last `limit` stored responses, by id (parsing runs off the event loop: locked)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit or MAX_STORED
        self.lock, self.conversations = threading.Lock(), OrderedDict()

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self.lock:
            self.conversations[response_id] = messages
            while len(self.conversations) > self.limit:
                self.conversations.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        with self.lock:
            return self.conversations.get(response_id)


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def parse_responses(body: dict, loaded, base_config, stored: ResponseStore) -> ResponsesRequest:
    check_text(body)
    for name, changes_meaning in UNSUPPORTED.items():
        if body.get(name) is not None and changes_meaning(body[name]):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    for name in ("store", "stream"):
        if not isinstance(body.get(name, False), bool):
            raise ApiError(400, f"'{name}' must be true or false", param=name)
    history = _input(body.get("input"), _previous(body.get("previous_response_id"), stored))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", param="instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    (tools, left_out, namespaces), response_format = _tools(body), _response_format(body.get("text"))
    options = {name: body[name] for name in ("temperature", "top_p", "stream") if name in body}
    options.update(max_tokens=body.get("max_output_tokens"), response_format=response_format)
    try:
        chat = chat_request(options, [*system, *history], tools, loaded, base_config)
    except ApiError as error:
        raise _in_responses_terms(error) from None
    chat = dataclasses.replace(chat, grammar_param=CHAT_NAMES.get(chat.grammar_param, chat.grammar_param))
    store = body.get("store") is not False
    if left_out:
        log.info("/v1/responses: tools left out of the prompt: %s", ", ".join(left_out))
    echo = _echo(body, response_format, store)
    return ResponsesRequest(chat, history, store, echo, int(time.time()), left_out, namespaces)


def _in_responses_terms(error: ApiError) -> ApiError:
    """A chat route's error, naming the field as a Responses request names it."""
    error.message = error.message.replace("response_format", "text.format")
    for chat_name, name in CHAT_NAMES.items():
        error.message = error.message.replace(f"'{chat_name}'", f"'{name}'")
    error.param = CHAT_NAMES.get(error.param, error.param)
    return error


def _previous(response_id, stored: ResponseStore) -> list[dict]:
    if response_id is None:
        return []
    if not isinstance(response_id, str):
        raise ApiError(400, "'previous_response_id' must be a string", param="previous_response_id")
    conversation = stored.get(response_id)
    if conversation is None:
        raise ApiError(400, f"previous_response_id: no stored response has the id {_shown(response_id)} "
                       f"(this server keeps the last {stored.limit} stored responses)",
                       param="previous_response_id", code="previous_response_not_found")  # fmt: skip
    return conversation


def _echo(body: dict, response_format: dict | None, store: bool) -> dict:
    text_format = (body.get("text") or {}).get("format") if response_format else None
    return {
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
        "store": store, "temperature": body.get("temperature", 0.0), "tools": body.get("tools") or [],
        "text": {"format": text_format or {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
        "top_p": body.get("top_p", 1.0), "truncation": "disabled", "user": body.get("user"),
    }  # fmt: skip


def _shown(value) -> str:
    """A request's value in an error message: a string quoted and cut short, anything else by its type."""
    if isinstance(value, str):
        return json.dumps(value[:80])
    return "null" if value is None else f"a {type(value).__name__}"


# --- input items ---------------------------------------------------------------------------------


def _input(items, earlier: list[dict]) -> list[dict]:
    """The conversation: the `earlier` one (previous_response_id's) and the input as chat messages. A string is
    one user message; function calls join the assistant turn before; an output answers an earlier call."""
    if isinstance(items, str):
        return [*earlier, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    messages = list(earlier)
    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, at))
        elif kind == "function_call":
            _add_call(messages, _function_call(item, at))
        elif kind == "function_call_output":
            messages.append(_function_output(item, at))
            if messages[-1]["tool_call_id"] not in _call_ids(messages):
                raise ApiError(400, f"No tool call found for function call output with call_id "
                               f"{messages[-1]['tool_call_id'][:80]}.", param=f"{at}.call_id")  # fmt: skip
        elif kind not in SKIPPED_ITEMS:
            raise ApiError(400, f"{at}.type {_shown(kind)} is not supported here; this server takes message, "
                           "function_call and function_call_output items", param=f"{at}.type")  # fmt: skip
    return messages


def _call_ids(messages: list[dict]) -> set[str]:
    return {call["id"] for message in messages for call in message.get("tool_calls", ())}


def _message(item: dict, at: str) -> dict:
    role = item.get("role")
    role = ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise ApiError(400, f"{at}.role must be user, assistant, system or developer", param=f"{at}.role")
    return {"role": role, "content": _text(item.get("content"), f"{at}.content")}


def _text(content, param: str) -> str:
    """A string, or text parts joined as the chat route joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{param} must be a string or a list of input_text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ApiError(400, f"{param}[{j}].type {_shown(kind)} is not supported here; this server takes "
                           "input_text and output_text parts", param=f"{param}[{j}].type")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: dict, at: str) -> dict:
    """An earlier call, as the chat route reads one: its arguments become an object, for the template's `tojson`."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if isinstance(item.get("namespace"), str) and isinstance(name, str):  # as the namespace's tools are offered
        name = f"{item['namespace']}.{name}"
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise ApiError(400, f"{at} must be a function_call item with a call_id, a name and arguments (a JSON string)",
                       param=at)  # fmt: skip
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError(400, f"{at}.arguments must be a JSON object's text", param=f"{at}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def _add_call(messages: list[dict], call: dict) -> None:
    if messages and messages[-1]["role"] == "assistant":
        messages[-1] = {**messages[-1], "tool_calls": [*messages[-1].get("tool_calls", []), call]}
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _function_output(item: dict, at: str) -> dict:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise ApiError(400, f"{at}.call_id must be the call_id of the function_call this answers",
                       param=f"{at}.call_id")  # fmt: skip
    return {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{at}.output")}


# --- tools and text.format -----------------------------------------------------------------------


def _tools(body: dict) -> tuple[ToolRequest | None, tuple[str, ...], dict]:
    """The function tools as a ToolRequest (None without tools or with tool_choice none), as on the chat route;
    "name (why)" of each tool left out; and the namespaces' tools by the names they are offered under."""
    tools, parallel = body.get("tools"), body.get("parallel_tool_calls")
    kind, name = _tool_choice(body.get("tool_choice"))
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {type: function, name, parameters}", param="tools")
    functions, left_out, namespaces = [], [], {}
    for i, tool in enumerate(tools or ()):
        kind_of_tool = tool.get("type") if isinstance(tool, dict) else None
        if kind_of_tool == "namespace":
            for function in _namespace(tool, f"tools[{i}]"):
                namespaces[function["name"]] = (tool["name"], function["name"].removeprefix(tool["name"] + "."))
                functions.append(function)
        elif kind_of_tool in (None, "function"):
            functions.append(_function(tool, f"tools[{i}]"))
        else:
            left_out.append(f"{tool.get('name', kind_of_tool)} ({kind_of_tool}: a built-in tool, which this server "
                            "does not run)")  # fmt: skip
    if not functions:
        if kind in ("required", "named"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None, tuple(left_out), namespaces
    names = [function["name"] for function in functions]
    if len(set(names)) < len(names):
        raise ApiError(400, "tool names must be unique", param="tools")
    if kind == "named" and name not in names:
        raise ApiError(400, f"tool_choice.name {_shown(name)} is none of the tools", param="tool_choice.name")
    request = (
        None if kind == "none" else ToolRequest(functions, kind, name, parallel=parallel is not False and not name)
    )
    return request, tuple(left_out), namespaces


def _namespace(tool: dict, at: str) -> list[dict]:
    """A namespace's function tools, each named `namespace.name`, the group's description before the first's."""
    name, members, description = tool.get("name"), tool.get("tools"), tool.get("description")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ApiError(400, f"{at}.name must be 1 to 64 letters, digits, '_', '.' or '-'", param=f"{at}.name")
    if not isinstance(members, list) or not members:
        raise ApiError(400, f"{at}.tools must be a non-empty list of function tools", param=f"{at}.tools")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{at}.description must be a string", param=f"{at}.description")
    functions = []
    for j, member in enumerate(members):
        if not isinstance(member, dict) or member.get("type") != "function":
            raise ApiError(400, f"{at}.tools[{j}] must be a function tool", param=f"{at}.tools[{j}].type")
        function = _function(member, f"{at}.tools[{j}]")
        function["name"] = f"{name}.{function['name']}"
        if j == 0 and description:
            function["description"] = f"{description}\n\n{function.get('description', '')}".strip()
        functions.append(function)
    return functions


def _tool_choice(choice) -> tuple[str, str | None]:
    """(auto, none, required or named; the named function)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return "named", choice["name"]
    raise ApiError(400, "tool_choice must be auto, none, required or {type: function, name}", param="tool_choice")


def _function(tool, at: str) -> dict:
    """A function tool as the function the chat template is given."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f"{at} must be {{type: function, name, parameters}}", param=f"{at}.type")
    name, description, parameters = tool.get("name"), tool.get("description"), tool.get("parameters")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ApiError(400, f"{at}.name must be 1 to 64 letters, digits, '_', '.' or '-'", param=f"{at}.name")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError(400, f"{at}.parameters must be a JSON schema object", param=f"{at}.parameters")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{at}.description must be a string", param=f"{at}.description")
    function = {"name": name, "description": description, "parameters": parameters}
    return {key: value for key, value in function.items() if value is not None}


def _response_format(text) -> dict | None:
    """`text.format` as the chat route's `response_format` (None for plain text)."""
    if text is not None and not isinstance(text, dict):
        raise ApiError(400, "'text' must be an object such as {format: {type: json_schema, ...}}", param="text")
    form = (text or {}).get("format")
    kind = form.get("type") if isinstance(form, dict) else None
    if form is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": kind}
    if kind != "json_schema":
        raise ApiError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")
    if not isinstance(form.get("schema"), dict):
        raise ApiError(400, "text.format.schema must be a JSON schema object", param="text.format.schema")
    if not isinstance(form.get("strict", False), (bool, type(None))):
        raise ApiError(400, "text.format.strict must be true or false", param="text.format.strict")
    spec = {"name": form.get("name"), "schema": form["schema"], "strict": form.get("strict")}
    return {"type": kind, "json_schema": spec}


# --- the response --------------------------------------------------------------------------------


def response_body(
    request: ResponsesRequest, response_id: str, model: str, text: str | None, calls, finished: Finished, stored
) -> dict:
    items = [_message_item(_new_id("msg"), text)] if text and text.strip() else []
    calls = [_call_item(call, request.namespaces) for call in calls]
    return finished_body(request, response_id, model, [*items, *calls], finished, stored)


def finished_body(request: ResponsesRequest, response_id: str, model: str, items: list[dict], finished: Finished,
                  stored: ResponseStore) -> dict:  # fmt: skip
    """The Response object of a finished answer, kept in `stored` when the request asks it to be."""
    if request.store:
        stored.put(response_id, [*request.history, _as_chat_message(items)])
    cut = finished.finish_reason == "length"  # by max_output_tokens, or earlier by the end of the model's context
    return {
        **_response(request, response_id, model, "incomplete" if cut else "completed", items),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output_text": _output_text(items), "usage": usage(finished.stats),
        "akunu": akunu_stats(finished.stats, request.tools_left_out),
    }  # fmt: skip


def usage(stats) -> dict:
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.prefilled_tokens},
        "output_tokens": stats.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def _response(request: ResponsesRequest, response_id: str, model: str, status: str, output: list[dict]) -> dict:
    return {"id": response_id, "object": "response", "created_at": request.created_at, "status": status,
            "error": None, "incomplete_details": None, "model": model, "output": output, "usage": None,
            **request.echo}  # fmt: skip


def _as_chat_message(items: list[dict]) -> dict:
    """The answer as the assistant message a follow-up's conversation holds."""
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": _offered_name(item), "arguments": json.loads(item["arguments"])}}
             for item in items if item["type"] == "function_call"]  # fmt: skip
    return {"role": "assistant", "content": _output_text(items), **({"tool_calls": calls} if calls else {})}


def _output_text(items: list[dict]) -> str:
    return "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [_text_part(text)]}  # fmt: skip


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _call_item(call, namespaces: dict) -> dict:
    """A tool_calls.ToolCall as a function_call item: its call_id is the chat route's call id; a namespace's
    tool is named apart from its namespace, as the API names it."""
    item = {"type": "function_call", "id": _new_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}  # fmt: skip
    if call.name in namespaces:
        item["namespace"], item["name"] = namespaces[call.name]
    return item


def _offered_name(item: dict) -> str:
    return f"{item['namespace']}.{item['name']}" if item.get("namespace") else item["name"]


# --- streaming -----------------------------------------------------------------------------------


async def response_events(request: ResponsesRequest, answer, response_id: str, model: str, events, stored):
    """The Responses events for a job's events; `answer` (app.Answer) splits text from tool calls."""
    stream = _StreamedItems(request.namespaces)
    for kind in ("response.created", "response.in_progress"):
        yield stream.event(kind, response=_response(request, response_id, model, "in_progress", []))
    async for event in events:
        if isinstance(event, Piece):
            text, calls, _ = answer.add(event)
            for line in stream.add(text, [call for _, call in calls]):
                yield line
        elif isinstance(event, Finished):
            text, calls, _ = answer.finish(cut=event.finish_reason == "length")
            for line in [*stream.add(text, [call for _, call in calls]), *stream.close_text()]:
                yield line
            body = finished_body(request, response_id, model, stream.items, event, stored)
            yield stream.event(f"response.{body['status']}", response=body)
        else:
            code = "invalid_request_error" if event.client_error else "server_error"
            yield stream.event("error", code=code, message=event.message, param=event.param)
            failed = _response(request, response_id, model, "failed", stream.items)
            failed["error"] = {"code": code, "message": event.message}
            yield stream.event("response.failed", response=failed)


class _StreamedItems:
    """Output items as they stream, every event numbered: text goes to an open message item (whitespace alone
    opens none, as a whole answer has no blank message); each tool call is a whole function_call item."""

    def __init__(self, namespaces: dict) -> None:
        self.items, self.sequence_number, self.namespaces = [], 0, namespaces
        self.text, self.held, self.message_id = None, "", None  # text: the open message's, None when none is open

    def event(self, kind: str, **body) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.sequence_number, **body}, ensure_ascii=False)
        self.sequence_number += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def add(self, text: str, calls) -> list[str]:
        lines = []
        if text and self.text is None:
            self.held, text = self.held + text, ""
            if self.held.strip():
                lines, text, self.held = self._open_message(), self.held, ""
        if text:
            self.text += text
            lines.append(self.event("response.output_text.delta", **self._at(), delta=text, logprobs=[]))
        for call in calls:
            lines += [*self.close_text(), *self._call(_call_item(call, self.namespaces))]
        return lines

    def close_text(self) -> list[str]:
        """Close the open message, if there is one."""
        if self.text is None:
            return []
        item, at = _message_item(self.message_id, self.text), self._at()
        lines = [
            self.event("response.output_text.done", **at, text=self.text, logprobs=[]),
            self.event("response.content_part.done", **at, part=_text_part(self.text)),
            self.event("response.output_item.done", output_index=len(self.items), item=item),
        ]
        self.items.append(item)
        self.text = None
        return lines

    def _open_message(self) -> list[str]:
        self.message_id, self.text = _new_id("msg"), ""
        opened = {**_message_item(self.message_id, ""), "status": "in_progress", "content": []}
        return [
            self.event("response.output_item.added", output_index=len(self.items), item=opened),
            self.event("response.content_part.added", **self._at(), part=_text_part("")),
        ]

    def _at(self) -> dict:
        return {"item_id": self.message_id, "output_index": len(self.items), "content_index": 0}

    def _call(self, item: dict) -> list[str]:
        at = {"item_id": item["id"], "output_index": len(self.items)}
        lines = [
            self.event("response.output_item.added", output_index=len(self.items),
                       item={**item, "arguments": "", "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=len(self.items), item=item),
        ]  # fmt: skip
        self.items.append(item)
        return lines
