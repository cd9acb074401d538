"""Chat templates from model files, rendered the way Hugging Face does but inside a Jinja sandbox.

A template is untrusted input (it ships inside a downloaded model), so it runs in an
`ImmutableSandboxedEnvironment` where touching Python internals or mutating objects stops
rendering at once with a one-line `ModelError`; nothing it writes is ever executed.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from akunu.errors import ModelError


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
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
                **variables,
            )
        except SecurityError as error:
            raise ModelError(
                f"the model's chat template tried an unsafe operation and was stopped: {_one_line(error)}"
            ) from None
        except TemplateRaised as error:
            raise ModelError(f"the model's chat template rejected the conversation: {_one_line(error)}") from None
        except Exception as error:  # noqa: BLE001 - any failure inside an untrusted template is the model's fault
            raise ModelError(f"the model's chat template failed: {type(error).__name__}: {_one_line(error)}") from None

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


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox returns an Undefined for a forbidden attribute and only fails if it is used later;
    failing at the access itself means no unsafe value ever reaches the template."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} object is not allowed")


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
