"""The `akunu` command: a Typer app whose commands are thin calls into the engine and the catalogue.

Nothing here imports MLX: `akunu --help` must start fast, so each command imports the engine
and the model loader when it runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from akunu import __version__
from akunu.cli import chat, generate, models_command, ps, serve
from akunu.cli.console import debug_enabled, print_error
from akunu.errors import AkunuError, OptionsError

# Every usage error. typer >= 0.20 raises those of its private copy of click, so the class is
# found through a public subclass rather than imported.
ClickException = next(base for base in typer.BadParameter.__mro__ if base.__name__ == "ClickException")

# Commands whose module is imported only when they run, with the short help shown until then.
LAZY_COMMANDS = {
    "bench": ("akunu.cli.bench", "Measure speculative against plain decoding on real workloads."),
}


class AkunuGroup(TyperGroup):
    """The root group: lazy commands, and every user mistake as one `error:` line instead of a traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for command in self.commands.values():
            check_text_options(command)
        for name, (_, short_help) in LAZY_COMMANDS.items():
            self.commands.setdefault(name, _Placeholder(name, help=short_help))

    def resolve_command(self, ctx: typer.Context, args: list[str]):
        name = args[0] if args else None
        if isinstance(self.commands.get(name), _Placeholder):
            self.commands[name] = _import_command(name)
        return super().resolve_command(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra: Any):
        args = list(sys.argv[1:] if args is None else args)
        json_target = _json_target(args)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except AkunuError as error:
            if debug_enabled():
                raise
            code = _fail(str(error), _kind(error), json_target, error.exit_code)
        except ClickException as error:  # usage errors: one line, and where to look
            code = error.exit_code
            if error.format_message():  # empty after a bare `akunu`, whose help is already shown
                hint = f" (see '{error.ctx.command_path} --help')" if getattr(error, "ctx", None) else ""
                _fail(f"{error.format_message()}{hint}", "usage", json_target, code)
        except typer.Abort:
            code = 130
        except UnicodeEncodeError as error:  # text that slipped past the checks above: still one line
            if debug_enabled():
                raise
            code = _fail(
                f"text that is not valid UTF-8 (byte {ord(error.object[error.start]) & 0xFF:#04x})",
                "usage",
                json_target,
                2,
            )
        except OSError as error:  # the machine's refusal (a full disk, a file where a folder should be), not a bug
            if debug_enabled():
                raise
            where = f": {error.filename}" if error.filename else ""
            code = _fail(f"{error.strerror or error}{where}", "system", json_target, 1)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


def _json_target(args: list[str]) -> str | Path | None:
    """Where `--json` sends its output, so that an error lands there as JSON too: stdout (generate) or the file (bench)."""
    words = args[: args.index("--")] if "--" in args else args
    command = words[0] if words else None
    for index, word in enumerate(words):
        if command == "generate" and word == "--json":
            return "stdout"
        if command == "bench" and word.startswith("--json="):
            return Path(word.partition("=")[2])
        if command == "bench" and word == "--json" and index + 1 < len(words):
            return Path(words[index + 1])
    return None


def _fail(message: str, kind: str, json_target: str | Path | None, code: int) -> int:
    """One `error:` line on stderr, and with --json the same error as one JSON object."""
    print_error(message)
    document = json.dumps({"error": {"message": message, "kind": kind}}, ensure_ascii=False)
    if json_target == "stdout":
        typer.echo(document)
    elif json_target is not None:
        with contextlib.suppress(OSError):
            Path(json_target).write_text(document + "\n", encoding="utf-8")
    return code


def _kind(error: AkunuError) -> str:
    """`model`, `prompt`, `options`, `workload`...: the error's class without `Error`."""
    name = type(error).__name__.removesuffix("Error").lower()
    return "error" if name == "akunu" else name


def check_text_options(command) -> None:
    """Every text option and argument of `command` (and its subcommands) arrives as valid UTF-8, or the run
    ends with one line naming it.

    Python hands stray bytes of argv over as lone surrogates, which fail wherever the text is encoded
    later. Paths are left alone (a file name may be any bytes), and so is the prompt (generate names it itself).
    """
    for sub in getattr(command, "commands", {}).values():
        check_text_options(sub)
    callback = command.callback
    if callback is None or getattr(callback, "_texts_checked", False):
        return
    params = [param for param in command.params if param.name != "prompt"]

    @functools.wraps(callback)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for param in params:
            _check_text(param, kwargs.get(param.name))
        return callback(*args, **kwargs)

    checked._texts_checked = True
    command.callback = checked


def _check_text(param, value: Any) -> None:
    from akunu.cli.text_input import check_text

    where = param.opts[0] if param.param_type_name == "option" else (param.name or "an argument").upper()
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(item, str):
            try:
                check_text(item, where)
            except AkunuError as error:
                raise OptionsError(str(error)) from None


class _Placeholder(TyperCommand):
    """Stands in for a lazy command in `akunu --help` without importing it."""


def _import_command(name: str) -> TyperCommand | TyperGroup:
    module_name = LAZY_COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise AkunuError(f"'akunu {name}' is not available in this build") from None
    if isinstance(getattr(module, "app", None), typer.Typer):
        command = typer.main.get_command(module.app)
    else:  # a plain command function named after the command
        single = typer.Typer()
        single.command(name=name)(getattr(module, name))
        command = typer.main.get_command(single)
    command.name = name
    check_text_options(command)
    return command


EXAMPLES = """[bold]Examples[/]
  akunu chat                              chat with the default model
  akunu generate "Write a haiku on rain"  text on stdout, stats on stderr
  akunu models                            the catalogue, and what is cached
  akunu bench --max-tokens 64 --limit 2   speculative vs plain, measured here
  akunu serve                             an OpenAI-compatible server on 127.0.0.1:8080
  akunu ps                                the models a running server has loaded
  akunu COMMAND --help                    options and examples of a command"""

app = typer.Typer(
    name="akunu",
    cls=AkunuGroup,
    epilog=EXAMPLES,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        parts = []
        for package in ("mlx", "mlx-lm"):
            try:
                parts.append(f"{package} {version(package)}")
            except PackageNotFoundError:
                parts.append(f"{package} missing")
        typer.echo(f"akunu {__version__} ({', '.join(parts)}, Python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Local LLM inference on MLX with n-gram speculative decoding.

    An n-gram predictor drafts the next tokens from the text so far; the model checks them all in one forward pass. The output is what plain decoding gives, only sooner.
    """


app.command(epilog=generate.EXAMPLES)(generate.generate)
app.command(epilog=chat.EXAMPLES)(chat.chat)
app.command(epilog=serve.EXAMPLES)(serve.serve)
app.command(epilog=ps.EXAMPLES)(ps.ps)
app.add_typer(models_command.app, name="models")


def main() -> None:
    app()
