"""What `generate` and `chat` share: loading a model with a progress bar, the prompt, the cost curve.

The engine and the model loader are imported inside each function, so the CLI starts
without MLX.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)

from akunu.cli.console import print_note, stderr_console
from akunu.drafters.specs import DraftLengthPolicy
from akunu.errors import AkunuError

_BYTE_STAGES = {"download", "extract", "verify"}


@contextlib.contextmanager
def progress_reporter() -> Iterator:
    """A `progress(stage, done, total)` callback drawing one rich bar per stage on stderr (TTY only)."""
    console = stderr_console()
    if not console.is_terminal:
        yield lambda stage, done, total: None
        return
    columns = (TextColumn("{task.description:>10}"), BarColumn(), _AmountColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        yield report


class _AmountColumn(ProgressColumn):
    """Bytes for download stages, `done/total` for the others (tensors, layers)."""

    def render(self, task):
        column = DownloadColumn() if task.description in _BYTE_STAGES else MofNCompleteColumn()
        return column.render(task)


def load(model: str | None, dtype, draft_models: Sequence[str] = (), shard="auto", check_ranks: bool = False):
    """The LoadedModel for a catalogue name, path or repo id (None: the default model).

    Draft models whose tokenizer differs from the target's are refused first, before any weights load.
    Under `mlx.launch` this rank's part of it (`shard`), rank 0 alone printing (akunu.distributed)."""
    from akunu import distributed
    from akunu.models import catalogue, load_model

    distributed.join(check_ranks=check_ranks)
    name = model or catalogue.DEFAULT_MODEL
    with progress_reporter() as progress:
        _check_draft_tokenizers(name, draft_models, progress)
        split = {} if distributed.group() is None else {"shard": getattr(shard, "value", shard)}  # alone: whole
        loaded = load_model(name, dtype=getattr(dtype, "value", dtype), progress=progress, **split)
    if loaded.sharded:
        print_note(loaded.sharded)
    return loaded


def _check_draft_tokenizers(target: str, draft_models: Sequence[str], progress) -> None:
    if not draft_models:
        return
    from akunu.drafters.draft_model import check_same_tokenizer
    from akunu.models import load_tokenizer

    target_tokenizer = load_tokenizer(target, progress=progress)
    for name in draft_models:
        check_same_tokenizer(target_tokenizer, load_tokenizer(name, progress=progress), name)


def join_ranks() -> None:
    """Under `mlx.launch`, join the group now (rank 0 alone prints from here on); `load` does it otherwise."""
    from akunu import distributed

    distributed.join()


def from_leader(make: Callable[[], object]) -> object:
    """`make()` run on rank 0 alone (what it reads is rank 0's: the port, the files), its JSON-able result on every
    rank; if it fails, rank 0 raises its error and the other ranks end quietly, as rank 0 says why."""
    result, failure = None, None
    if leads():
        try:
            result = make()
        except AkunuError as error:
            failure = error
    message = agreed({"result": result, "failed": failure is not None})
    if not message["failed"]:
        return message["result"]
    if failure is None:
        raise SystemExit(0)
    raise failure


def interruptible(responses):
    """A generation's responses where Ctrl-C on rank 0 stops every rank at the same pass, as KeyboardInterrupt on
    each (akunu.distributed.interruptible); alone, `responses` as they are."""
    from akunu import distributed

    return responses if alone() else distributed.interruptible(responses)


def end_gracefully(begin: Callable[[], None], within: float = 20.0) -> None:
    """Under `mlx.launch`, SIGTERM calls `begin()` to end the work in order rather than ending at once (see
    akunu.distributed.end_gracefully); the process still ends within `within` seconds."""
    from akunu import distributed

    distributed.end_gracefully(begin, within)


def alone() -> bool:
    """Whether this process runs without other ranks (not under `mlx.launch`)."""
    from akunu import distributed

    return distributed.group() is None


def leads() -> bool:
    """Rank 0 under `mlx.launch` (it owns the terminal, the port and the files), or a process alone."""
    from akunu import distributed

    return distributed.leads()


def leader_reads(read):
    """`read` (prompt -> line) as every rank takes it: rank 0's own, sent to the others; `read` when alone."""
    from akunu import distributed

    return read if alone() else distributed.leader_reads(read)


def agreed(value):
    """Rank 0's value on every rank under `mlx.launch` (what it read from its terminal, say); else `value`."""
    from akunu import distributed

    return distributed.agree(value)


def encode_prompt(
    tokenizer, text: str, *, system: str | None = None, raw: bool = False, parse_special: bool | None = None
) -> list[int]:
    """Prompt ids: the chat template around `text`, or `text` verbatim.

    Special-token text in the user's words is read as control tokens only when `parse_special` says so;
    by default only with `raw`, where the user writes the template's markup themselves.
    """
    special = raw if parse_special is None else parse_special
    if raw:
        return tokenizer.encode(text, parse_special=special)
    if not tokenizer.has_chat_template:
        print_note("this model has no chat template; the prompt is sent as raw text")
        return tokenizer.encode(f"{system}\n\n{text}" if system else text, parse_special=special)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.encode_chat(messages, parse_special=special)


def cost_curve(loaded, max_draft: int):
    """This model's pass costs on this backend (an `akunu.cost_curve.CostCurves`), wide enough
    for `max_draft` drafts, after the contexts the model has room for.

    Measured once per model, dtype and backend (seconds), then read from disk.
    """
    from akunu import cost_curve, distributed

    key, directory = cost_curve.curve_key(loaded.name, loaded.dtype), cost_curve.default_dir()
    contexts = cost_curve.contexts_within(loaded.context_length)
    if distributed.group() is not None:  # every rank runs the passes; rank 0's timings decide
        with pass_cost_progress("once") as progress:
            return distributed.shared_cost_curves(loaded.model, key, directory, max_draft + 1, contexts, progress)
    try:  # an unwritable AKUNU_HOME costs a measurement per run, never the run
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            with pass_cost_progress("once") as progress:
                return cost_curve.cached(
                    loaded.model, key, directory, max_width=max_draft + 1, contexts=contexts, progress=progress
                )
        reason = "not writable"
    except OSError as error:
        reason = error.strerror or str(error)
    print_note(f"cannot save the cost curve in {directory} ({reason}); measuring it for this run only")
    middling = min(contexts, key=lambda c: abs(c - cost_curve.CONTEXT))  # one context: a few seconds per run
    with pass_cost_progress("for this run") as progress:
        return cost_curve.measure_curves(
            loaded.model,
            max_draft + 1,
            cost_curve.QUICK_SWEEPS,
            (middling,),
            widths=cost_curve.QUICK_WIDTHS,
            progress=progress,
        )


@contextlib.contextmanager
def pass_cost_progress(how: str) -> Iterator:
    """A `progress(done, total)` callback for a cost-curve measurement: a live `k/N` line on a terminal,
    the first and the last line otherwise. Nothing is shown when the curve is read from disk."""
    label = f"measuring pass costs for this machine, {how}"
    console = stderr_console()
    if not console.is_terminal:

        def say(done: int, total: int) -> None:
            if done in (0, total):
                console.print(f"[dim]{label}: {done}/{total}[/]")

        yield say
        return
    columns = (TextColumn(f"[dim]{label}:[/]"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = None

        def report(done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task(label, total=total)
            bar.update(task, completed=done)

        yield report


def costs_for(loaded, config):
    """The cost curves when the config drafts adaptively; None otherwise (no measuring needed; exact mode's is flat)."""
    if config.spec.enabled and config.spec.draft_length != DraftLengthPolicy.fixed and not config.spec.exact:
        return cost_curve(loaded, config.spec.draft_tokens)
    return None


def stream(loaded, prompt_ids: list[int], config, *, prompt_cache=None, costs=None, drafter=None, constraint=None,
           between_chunks=None, share_passes=False, prefill_turns=False):  # fmt: skip
    """The engine's response stream for one generation (`drafter`: None for the default drafter;
    `constraint`: the grammar the output follows, akunu.grammar; `between_chunks`, `share_passes`, `prefill_turns`:
    see stream_generate; passes are not shared across ranks)."""
    from akunu import distributed
    from akunu.generate import stream_generate

    if distributed.group() is not None:
        responses = stream_generate(
            loaded.model, loaded.tokenizer, prompt_ids, config, prompt_cache=prompt_cache,
            context_length=loaded.context_length, costs=costs, drafter=distributed.drafter_for(drafter, config),
            constraint=constraint, between_chunks=between_chunks,
        )  # fmt: skip
        return distributed.guarded(responses)
    return stream_generate(
        loaded.model,
        loaded.tokenizer,
        prompt_ids,
        config,
        prompt_cache=prompt_cache,
        context_length=loaded.context_length,
        costs=costs,
        drafter=drafter,
        constraint=constraint,
        between_chunks=between_chunks,
        share_passes=share_passes,
        prefill_turns=prefill_turns,
    )


def tolerant_stdin() -> None:
    """Stray bytes on stdin become lone surrogates (as under a C locale), for text_input.check_text to name, not a traceback."""
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdin.reconfigure(errors="surrogateescape")


def stdin_is_terminal() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()
