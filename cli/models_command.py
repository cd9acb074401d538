"""`akunu models`: the catalogue with what is cached, `pull` to fetch a model, `rm` to delete one, `verify`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from akunu.cli.console import stdout_console

app = typer.Typer(
    help="List the model catalogue, with what is cached; fetch or remove models.",
    epilog="[bold]Examples[/]\n  akunu models\n  akunu models pull gemma3-270m\n  akunu models verify\n"
    "  akunu models rm gemma3-270m",
    invoke_without_command=True,
    no_args_is_help=False,
)

Name = Annotated[str, typer.Argument(show_default=False, help="A catalogue name, as 'akunu models' lists them.")]
OptionalName = Annotated[
    str | None, typer.Argument(show_default=False, help="A catalogue name; every cached model if omitted.")
]


@app.callback()
def models(ctx: typer.Context) -> None:
    """List the model catalogue: cached or not, size on disk and path."""
    if ctx.invoked_subcommand is None:
        list_models()


@app.command("list")
def list_models() -> None:
    """List the model catalogue: cached or not, size on disk and path."""
    from akunu.cli.runtime import progress_reporter
    from akunu.models import catalogue

    console = stdout_console()
    _note_cleaned(catalogue.clean_stale_downloads())
    console.print(f"model cache: {escape(str(catalogue.home() / 'models'))}")
    width = max(len(name) for name in catalogue.KNOWN) + len(" (default)")
    for name, known in catalogue.KNOWN.items():
        with progress_reporter() as progress:
            state = catalogue.cache_state(name, progress=progress)
        label = f"{name} (default)" if name == catalogue.DEFAULT_MODEL else name
        status = {
            "ok": "[green]cached[/]",
            "corrupt": f"[red]corrupt[/] [dim](akunu models pull {escape(name)} fetches it again)[/]",
            "missing": f"not cached [dim](akunu models pull {escape(name)})[/]",
        }[state]
        console.print(f"\n[bold]{escape(label):<{width}}[/]  {human_size(known.size):>9}  {status}")
        console.print(f"  [dim]{escape(known.description)}[/]")
        if state != "missing":
            console.print(f"  {escape(str(catalogue.model_path(name)))}")
    console.print("\n[dim]--model also takes a .gguf file, an MLX model folder or a Hugging Face repo id.[/]")


@app.command()
def pull(name: Name) -> None:
    """Fetch a catalogue model into the cache (checked against its pinned sha256)."""
    from akunu.cli.runtime import progress_reporter
    from akunu.models import catalogue

    with progress_reporter() as progress:
        path, before = catalogue.pull(name, progress=progress)
    verb = {"ok": "already cached", "corrupt": "was corrupt; fetched again", "missing": "fetched"}[before]
    stdout_console().print(f"{escape(name)} {verb}: {escape(str(path))} ({human_size(path.stat().st_size)})")


@app.command("rm")
def remove(name: Name) -> None:
    """Delete a cached model (it can be pulled again)."""
    from akunu.models import catalogue

    catalogue.entry(name)  # an unknown name is an error, with suggestions
    folder = catalogue.model_path(name).parent
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0
    if not catalogue.remove(name):
        stdout_console().print(f"{escape(name)} is not cached; nothing to remove")
        return
    stdout_console().print(f"removed {escape(name)} from {escape(str(folder))} (freed {human_size(size)})")


@app.command()
def verify(name: OptionalName = None) -> None:
    """Hash cached models again and compare with their pinned sha256."""
    from akunu.cli.runtime import progress_reporter
    from akunu.errors import ModelError
    from akunu.models import catalogue

    names = [name] if name else list(catalogue.KNOWN)
    results = {}
    for each in names:
        with progress_reporter() as progress:
            results[each] = catalogue.verify(each, progress=progress)
    if name and results[name] == "missing":
        raise ModelError(f"{name} is not cached; nothing to verify (akunu models pull {name})")
    console = stdout_console()
    for each, state in results.items():
        if state == "ok":
            console.print(f"{escape(each)}: [green]ok[/] (sha256 {catalogue.KNOWN[each].sha256[:16]}…)")
        elif state == "corrupt":
            console.print(f"{escape(each)}: [red]corrupt[/]; run 'akunu models pull {escape(each)}' to fetch it again")
    if not any(state != "missing" for state in results.values()):
        console.print("no model is cached; nothing to verify")
    if "corrupt" in results.values():
        raise typer.Exit(1)


def _note_cleaned(freed: int) -> None:
    if freed:
        from akunu.cli.console import print_note

        print_note(f"removed interrupted downloads ({human_size(freed)})")


def human_size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
