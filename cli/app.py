"""The `akunu` command: a Typer app whose commands are thin calls into the engine and the catalogue.

Nothing here imports MLX: `akunu --help` must start fast, so each command imports the engine
and the model loader when it runs.
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.20 carries its own copy of click
    from typer._click.core import Command, Context
    from typer._click.exceptions import ClickException
except ImportError:
    from click import ClickException, Command, Context

from akunu import __version__
from akunu.cli import chat, generate, models_command, serve
from akunu.cli.console import debug_enabled, print_error
from akunu.errors import AkunuError

# Commands whose module is imported only when they run, with the short help shown until then.
LAZY_COMMANDS = {
    "bench": ("akunu.cli.bench", "Measure speculative against plain decoding on real workloads."),
}


class AkunuGroup(TyperGroup):
    """The root group: lazy commands, and every user mistake as one `error:` line instead of a traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, (_, short_help) in LAZY_COMMANDS.items():
            self.commands.setdefault(name, _Placeholder(name, help=short_help))

    def resolve_command(self, ctx: Context, args: list[str]):
        name = args[0] if args else None
        if isinstance(self.commands.get(name), _Placeholder):
            self.commands[name] = _import_command(name)
        return super().resolve_command(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra: Any):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except AkunuError as error:
            if debug_enabled():
                raise
            print_error(str(error))
            code = error.exit_code
        except ClickException as error:  # usage errors: one line, and where to look
            if error.format_message():  # empty after a bare `akunu`, whose help is already shown
                hint = f" (see '{error.ctx.command_path} --help')" if getattr(error, "ctx", None) else ""
                print_error(f"{error.format_message()}{hint}")
            code = error.exit_code
        except typer.Abort:
            code = 130
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


class _Placeholder(TyperCommand):
    """Stands in for a lazy command in `akunu --help` without importing it."""


def _import_command(name: str) -> Command:
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
    return command


EXAMPLES = """[bold]Examples[/]
  akunu chat                              chat with the default model
  akunu generate "Write a haiku on rain"  text on stdout, stats on stderr
  akunu models                            the catalogue, and what is cached
  akunu bench --max-tokens 64 --limit 2   speculative vs plain, measured here
  akunu serve                             an OpenAI-compatible server on 127.0.0.1:8080
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
app.add_typer(models_command.app, name="models")


def main() -> None:
    app()
