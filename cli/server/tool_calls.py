"""Tool calls as each model family writes them, read back into OpenAI's `tool_calls`.

Families: Qwen/Hermes `<tool_call>{"name", "arguments"}</tool_call>`, Llama 3.x bare JSON
`{"name", "parameters"}`, Mistral `[TOOL_CALLS][{...}]` (or `[TOOL_CALLS]name[ARGS]{...}`), and
gpt-oss harmony `<|channel|>commentary to=functions.NAME ... <|message|>{...}<|call|>` (`HarmonyStream`).
`CallStream` does the same while text streams in, holding back what may be the start of a call.
A call whose JSON does not parse stays text: nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from akunu.cli.harmony import HarmonyStream

HERMES, LLAMA3, MISTRAL, HARMONY = "hermes", "llama3", "mistral", "harmony"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ForcedCall:
    """What `tool_choice` required / named forces the output to be: `prefix` + JSON valid for `schema` + `suffix`."""

    prefix: str
    schema: dict
    suffix: str
    separator: str | None = None  # between several calls, when the family writes more than one


def family_of(chat_template: str | None) -> str:
    """The tool-call family a chat template writes (Hermes when it does not say)."""
    template = chat_template or ""
    if "<|channel|>" in template or "to=functions" in template:
        return HARMONY
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|start_header_id|>" in template and "<tool_call>" not in template:
        return LLAMA3
    return HERMES


def parse(family: str, text: str, *, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; content is None when the answer is only calls.
    `cut`: max_tokens ended the answer, so a trailing fragment of a call's opening is a call cut short, not content."""
    content, calls = _PARSERS[family](text)
    if not calls:
        return (content if family == HARMONY else text), []  # harmony's channel markup is never content
    if cut:
        content = without_cut_opening(family, content)
    return (content.strip() or None), calls


def without_cut_opening(family: str, text: str) -> str:
    """`text` without a trailing proper prefix of the family's call opening (what a cut left of the next call)."""
    openings = CallStream._OPENINGS.get(family, ())
    cut = max((k for o in openings for k in range(1, len(o)) if text.endswith(o[:k])), default=0)
    return text[: len(text) - cut]


def forced_call(family: str, functions: list[dict], name: str | None) -> ForcedCall:
    """The output `tool_choice` forces: a call of `name`, or of any of `functions` when None ("required")."""
    chosen = [f for f in functions if name is None or f["name"] == name]
    if family == HARMONY:  # the name is written before the JSON: one function's call at a time
        function = chosen[0]
        return ForcedCall(f"<|channel|>commentary to=functions.{function['name']} <|constrain|>json<|message|>",
                          _parameters(function), "<|call|>")  # fmt: skip
    arguments = "parameters" if family == LLAMA3 else "arguments"
    # where each function's parameters sit in the call schema, for its references to resolve against
    at = lambda i: f"/properties/{arguments}" if len(chosen) == 1 else f"/anyOf/{i}/properties/{arguments}"
    calls = [_call_schema(f["name"], arguments, rebased(_parameters(f), at(i))) for i, f in enumerate(chosen)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if family == MISTRAL:
        return ForcedCall("[TOOL_CALLS][", schema, "]", separator=None)
    if family == LLAMA3:
        return ForcedCall("", schema, "")
    return ForcedCall("<tool_call>\n", schema, "\n</tool_call>", separator="\n")


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


# Keywords whose values are data, not schemas (a "$ref" in them is no reference), and those whose values map
# names to schemas (a name such as "const" is no keyword).
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def rebased(schema, pointer: str):
    """`schema` with its local references ("#", "#/$defs/...") pointing into where it is nested (`pointer`,
    a JSON pointer), so they resolve against the schema the caller wrote, as Pydantic's `$defs` expect."""
    if isinstance(schema, list):
        return [rebased(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = "#" + pointer + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            moved[key] = {name: rebased(item, pointer) for name, item in value.items()}
        else:
            moved[key] = value if key in _DATA_KEYWORDS else rebased(value, pointer)
    return moved


def _call_schema(name: str, arguments: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, arguments: parameters},
            "required": ["name", arguments], "additionalProperties": False}  # fmt: skip


# --- whole answers ------------------------------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


_FENCED = re.compile(r"\s*```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```\s*", re.DOTALL)


def _hermes(text: str) -> tuple[str, list[ToolCall]]:
    if _OPEN not in text:  # a tokenizer that hides <tool_call> as a special token leaves the bare JSON;
        fenced = _FENCED.fullmatch(text)  # small Qwen coders often fence that JSON as a ```json block
        return _llama3(fenced.group(1) if fenced else text)
    calls, kept = [], []
    for match in _HERMES_CALL.finditer(text):
        call = _call_from_json(match.group(1), "arguments")
        if call is None:
            return text, []
        calls.append(call)
    for piece in _HERMES_CALL.split(text)[::2]:
        kept.append(piece)
    return "".join(kept), calls


def _llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, position = [], json.JSONDecoder(), 0
    while position < len(body):
        try:
            value, end = decoder.raw_decode(body, position)
        except ValueError:
            return text, []
        call = _call_from_value(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \t\n;":  # calls may be separated by ";"
            position += 1
    return "", calls


def _mistral(text: str) -> tuple[str, list[ToolCall]]:
    content, marker, rest = text.partition("[TOOL_CALLS]")
    if not marker:
        return text, []
    calls = []
    for part in rest.split("[TOOL_CALLS]"):
        part = part.strip()
        if part.startswith("["):  # v3: a JSON list of {"name", "arguments"}
            try:
                values = json.loads(part)
            except ValueError:
                return text, []
            found = [_call_from_value(v, "arguments") for v in values] if isinstance(values, list) else [None]
        else:  # v11+: name[ARGS]{...}
            name, args_marker, arguments = part.partition("[ARGS]")
            found = (
                [_call_from_value({"name": name.strip(), "arguments": _json_or_none(arguments)}, "arguments")]
                if args_marker
                else [None]
            )
        if None in found:
            return text, []
        calls += found
    return content, calls


def _harmony(text: str) -> tuple[str, list[ToolCall]]:
    """The whole answer through the stream reader, so both give the same; a call that does not parse stays text."""
    stream = HarmonyStream(_harmony_call)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more


def _harmony_call(name: str, body: str) -> ToolCall | None:
    return _call_from_value({"name": name, "arguments": _json_or_none(body)}, "arguments")


def _call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    return _call_from_value(_json_or_none(text), arguments_key)


def _call_from_value(value, arguments_key: str) -> ToolCall | None:
    """A call from {"name": ..., KEY: {...}} (either of "arguments" / "parameters" is read)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


_PARSERS = {HERMES: _hermes, LLAMA3: _llama3, MISTRAL: _mistral, HARMONY: _harmony}


# --- streaming ----------------------------------------------------------------------------------


class CallStream:
    """Text in as it streams; out: content safe to show now, and calls once each is whole.

    Hermes calls are read one by one as each closes, and harmony's messages as `HarmonyStream` reads them;
    the other families write calls that run to the end of the answer, so once their opening is seen the
    rest is held and read by `parse` at the end.
    """

    _OPENINGS = {HERMES: ("<tool_call>",), MISTRAL: ("[TOOL_CALLS]",), LLAMA3: ("{", "<|python_tag|>")}

    def __init__(self, family: str) -> None:
        self.family, self.pending, self.held = family, "", False
        self.started = False  # anything but whitespace was shown (llama 3 calls come only first)
        self.calls_seen = False
        self.harmony = HarmonyStream(_harmony_call) if family == HARMONY else None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.harmony:
            return self.harmony.feed(text)
        self.pending += text
        shown, calls = "", []
        while True:
            if not self.held:
                at = self._opening()
                if at < 0:
                    keep = self._undecided()
                    cut = len(self.pending) - keep
                    shown, self.pending = shown + self._show(self.pending[:cut]), self.pending[cut:]
                    return shown, calls
                shown, self.pending, self.held = shown + self._show(self.pending[:at]), self.pending[at:], True
            if self.family != HERMES or (end := self.pending.find(_CLOSE)) < 0:
                return shown, calls
            block, self.pending, self.held = self.pending[: end + len(_CLOSE)], self.pending[end + len(_CLOSE) :], False
            call = _call_from_json(block[len(_OPEN) : -len(_CLOSE)].strip(), "arguments")
            if call is None:
                shown += self._show(block)
            else:
                calls.append(call)
                self.calls_seen = True

    def finish(self, *, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """What is left: the held calls, or the held text when it was not a call after all
        (`cut`: max_tokens ended the answer; after calls, a fragment of an opening is dropped as in `parse`)."""
        if self.harmony:
            return self.harmony.finish()
        rest, self.pending = self.pending, ""
        if cut and self.calls_seen:
            rest = without_cut_opening(self.family, rest)
        if not rest:
            return "", []
        content, calls = parse(self.family, rest, cut=cut)
        return content or "", calls

    def _openings(self) -> tuple[str, ...]:
        return () if self.family == LLAMA3 and self.started else self._OPENINGS[self.family]

    def _opening(self) -> int:
        body = self.pending.lstrip()
        if self.family == LLAMA3:  # a call is the whole answer: it opens before anything else
            return len(self.pending) - len(body) if not self.started and body.startswith(self._openings()) else -1
        if self.family == HERMES and not self.started and body.startswith(("{", "```")):  # bare JSON: see _hermes
            return len(self.pending) - len(body)
        found = [i for i in (self.pending.find(o) for o in self._openings()) if i >= 0]
        return min(found, default=-1)

    def _undecided(self) -> int:
        """How many trailing characters may still begin a call."""
        if self.family == LLAMA3:
            body = self.pending.lstrip()
            undecided = not self.started and any(o.startswith(body) for o in self._openings())
            return len(self.pending) if undecided else 0
        if self.family == HERMES and not self.started and "```".startswith(self.pending.strip()):
            return len(self.pending)
        return max((k for o in self._openings() for k in range(1, min(len(o), len(self.pending)) + 1)
                    if self.pending.endswith(o[:k])), default=0)  # fmt: skip

    def _show(self, text: str) -> str:
        self.started = self.started or bool(text.strip())
        return text


# --- the request's side -------------------------------------------------------------------------


TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # the names tools may have, in either API


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    functions: list[dict]  # each {"name", "description"?, "parameters"?}
    choice: str  # "auto", "required" or "named" ("none" gives no ToolRequest at all)
    name: str | None = None  # the function `tool_choice` names
    parallel: bool = True  # `parallel_tool_calls`: False keeps the first call only

    def template_tools(self) -> list[dict]:
        """The tools as chat templates expect them (the OpenAI request's own shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def forced(self, family: str) -> ForcedCall | None:
        return forced_call(family, self.functions, self.name) if self.choice != "auto" else None


def tool_request(body: dict) -> ToolRequest | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`; None without tools or with tool_choice "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolRequestError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolRequestError("'tools' must be a list of {type: function, function: {name, parameters}}", "tools")
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise ToolRequestError("tool names must be unique", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if choice is None or choice in ("auto", "required"):
        return ToolRequest(functions, choice or "auto", parallel=parallel is not False)
    if choice == "none":
        return None
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function"
        else None
    )
    if not isinstance(name, str) or name not in names:
        raise ToolRequestError(f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}} naming one of {names}",
                               "tool_choice")  # fmt: skip
    return ToolRequest(functions, "named", name, parallel=False)


def _function(tool, i: int) -> dict:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolRequestError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}} with a name of "
                               "at most 64 letters, digits, '_', '.' or '-'", f"tools[{i}]")  # fmt: skip
    if not isinstance(function.get("parameters", {}), dict) or not isinstance(function.get("description", ""), str):
        raise ToolRequestError(
            f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters"
        )
    return {key: function[key] for key in ("name", "description", "parameters") if key in function}
