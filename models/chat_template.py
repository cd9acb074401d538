"""Chat templates from model files, rendered the way Hugging Face does but inside a Jinja sandbox.

A template is untrusted input (it ships inside a downloaded model), so it runs in an
`ImmutableSandboxedEnvironment` where touching Python internals or mutating objects stops
rendering at once with a one-line `ModelError`; nothing it writes is ever executed.
Growth is bounded too: no value it builds, and not its output, may pass MAX_LENGTH characters,
and its ranges together may not pass MAX_RANGE_ITEMS, so it cannot exhaust memory or run on for long.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
from datetime import datetime
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from akunu.errors import ModelError

MAX_LENGTH = 16_000_000  # characters (or items) of any value or of the output: beyond any model's context
MAX_RANGE_ITEMS = 1_000_000  # all range() items of one render together
MAX_INT_BITS = 4096
_HUGE_WIDTH = re.compile(r"\d{8,}")  # a format width or precision of MAX_LENGTH's order
_range_budget: contextvars.ContextVar[list[int]] = contextvars.ContextVar("range_budget")


class ChatTemplate:
    """One model's chat template, compiled on first use."""

    def __init__(self, source: str):
        self.source = source
        self._template: jinja2.Template | None = None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        bos_token: str = "",
        eos_token: str = "",
        **variables: Any,
    ) -> str:
        """The prompt text for a conversation; any failure of the template is a one-line ModelError."""
        template = self._compiled()
        budget = _range_budget.set([MAX_RANGE_ITEMS])
        try:
            return _bounded_output(
                template.generate(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=bos_token,
                    eos_token=eos_token,
                    **variables,
                )
            )
        except SecurityError as error:
            raise ModelError(
                f"the model's chat template tried an unsafe operation and was stopped: {_one_line(error)}"
            ) from None
        except TemplateRaised as error:
            raise ModelError(f"the model's chat template rejected the conversation: {_one_line(error)}") from None
        except Exception as error:  # noqa: BLE001 - any failure inside an untrusted template is the model's fault
            raise ModelError(f"the model's chat template failed: {type(error).__name__}: {_one_line(error)}") from None
        finally:
            _range_budget.reset(budget)

    def _compiled(self) -> jinja2.Template:
        if self._template is None:
            try:
                self._template = _sandbox().from_string(self.source)
            except jinja2.TemplateSyntaxError as error:
                raise ModelError(
                    f"the model's chat template is not valid Jinja (line {error.lineno}): {_one_line(error)}"
                ) from None
            except Exception as error:  # noqa: BLE001
                raise ModelError(f"the model's chat template cannot be compiled: {_one_line(error)}") from None
        return self._template


class TemplateRaised(jinja2.TemplateError):
    """The template called `raise_exception(...)`, e.g. because roles do not alternate."""


class _BoundedConcat(CodeGenerator):
    """`a ~ b` is not one of the sandbox's intercepted operators: its result is checked like theirs."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded(")
        super().visit_Concat(node, frame)
        self.write(")")


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox returns an Undefined for a forbidden attribute and only fails if it is used later;
    failing at the access itself means no unsafe value ever reaches the template.
    Operators, calls and filters that can grow a value are checked before they run, results after."""

    code_generator_class = _BoundedConcat
    intercepted_binops = frozenset(["*", "+", "%", "**"])

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} object is not allowed")

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        _check_binop(operator_, left, right)
        return self.bounded(super().call_binop(context, operator_, left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        name, owner = getattr(obj, "__name__", ""), getattr(obj, "__self__", None)
        _check_call(name, (owner, *args) if isinstance(owner, str) else args, kwargs)
        return self.bounded(super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        if getattr(value, "__name__", "") in ("format", "format_map"):  # checked here: the call sees only a wrapper
            _check_call("format", (getattr(value, "__self__", None),), {})
        return super().wrap_str_format(value)

    @staticmethod
    def bounded(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            raise SecurityError(
                f"the template built a number of {value.bit_length()} bits (the limit is {MAX_INT_BITS})"
            )
        if isinstance(value, (str, list, tuple, dict)) and _weight(value) > MAX_LENGTH:
            raise SecurityError(f"the template built a value of over {MAX_LENGTH} characters")
        return value


def _weight(value: Any) -> int:
    """Characters (items for other sequences) a value holds; a list of strings weighs what they hold."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(len(item) if isinstance(item, str) else 1 for item in value)
    return len(value) if isinstance(value, dict) else 1


def _check_binop(operator_: str, left: Any, right: Any) -> None:
    """Refuse what would pass the limits before Python builds it."""
    if operator_ == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
        left, right = right, left
    if operator_ == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
        estimate = _weight(left) * right
    elif operator_ == "+" and isinstance(left, (str, list, tuple)):
        estimate = _weight(left) + _weight(right) if isinstance(right, (str, list, tuple)) else 0
    elif operator_ == "*" and isinstance(left, int) and isinstance(right, int):
        estimate = 0 if left.bit_length() + right.bit_length() <= MAX_INT_BITS else math.inf
    elif operator_ == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        estimate = 0 if right * math.log2(abs(left)) <= MAX_INT_BITS else math.inf
    elif operator_ == "%" and isinstance(left, str):
        _check_call("format", (left, *(right if isinstance(right, tuple) else (right,))), {})
        estimate = 0
    else:
        estimate = 0
    if estimate > MAX_LENGTH:
        raise SecurityError(
            f"the template's {operator_!r} would build a value beyond the limit ({MAX_LENGTH} characters)"
        )


def _check_call(name: str, args: tuple, kwargs: dict) -> None:
    """A call or filter may not take a size beyond the limit, a format width of that order, or replace its way past it."""
    values = (*args, *kwargs.values())
    if any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_LENGTH for v in values):
        raise SecurityError(f"the template passed {name or 'a call'} a number beyond the limit ({MAX_LENGTH})")
    if name in ("format", "format_map") and args and isinstance(args[0], str) and _HUGE_WIDTH.search(args[0]):
        raise SecurityError("the template asked for a format width beyond the limit")
    if name == "replace":
        text = [v for v in values if isinstance(v, str)]
        if len(text) >= 3 and _replaced_length(*text[:3]) > MAX_LENGTH:
            raise SecurityError(
                f"the template's replace would build a value beyond the limit ({MAX_LENGTH} characters)"
            )


def _replaced_length(text: str, old: str, new: str) -> int:
    count = text.count(old) if old else len(text) + 1
    return len(text) + count * (len(new) - len(old))


def _bounded_filter(name: str, function: Any) -> Any:
    @functools.wraps(function)  # keeps jinja's pass_context/pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_call(name, args, kwargs)
        return _StrictSandbox.bounded(function(*args, **kwargs))

    return bounded


def _budgeted_range(*args: int) -> range:
    """range() that draws on the render's whole budget, so nested loops cannot multiply it."""
    items = range(*args)
    budget = _range_budget.get([MAX_RANGE_ITEMS])
    budget[0] -= len(items)
    if budget[0] < 0:
        raise SecurityError(f"the template's ranges exceed {MAX_RANGE_ITEMS} items in all")
    return items


def _bounded_output(pieces) -> str:
    rendered, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > MAX_LENGTH:
            raise SecurityError(f"the rendered prompt passed {MAX_LENGTH} characters")
        rendered.append(piece)
    return "".join(rendered)


class _GenerationBlock(Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _sandbox() -> ImmutableSandboxedEnvironment:
    # Same settings and helpers as transformers' chat template renderer.
    environment = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock])
    environment.filters["tojson"] = _tojson
    environment.filters.update({name: _bounded_filter(name, f) for name, f in environment.filters.items()})
    environment.globals["range"] = _budgeted_range
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # HF's variant: no HTML escaping and non-ASCII kept as is, unlike Jinja's built-in filter.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateRaised(str(message))


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _one_line(error: BaseException) -> str:
    text = str(error.message if isinstance(error, jinja2.TemplateError) and error.message else error)
    return " ".join(text.split())[:300]
