"""`akunu bench`: speculative against plain decoding and against mlx-lm, on real text, in one run.

The measuring lives in `akunu.bench`; this module parses options, draws the progress bar and
prints the tables.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from akunu.cli import options, runtime
from akunu.cli.console import print_note, stderr_console
from akunu.errors import OptionsError

EXAMPLES = """[bold]Examples[/]
  akunu bench --max-tokens 64 --limit 2            a quick look: 2 prompts per category
  akunu bench --json bench.json --plot bench.png   the full run, every measurement kept
  akunu bench --categories code-edit,chat --repeats 3
  akunu bench --workload my-prompts.jsonl          your own prompts: {"category": ..., "prompt": ...} per line
  akunu bench --cost-curve                         forward-pass time for 1..33 tokens on this backend
  akunu bench --cost-curve --context 4096          the same after 4k tokens of context only (shown, not stored)"""

WORKLOAD_PANEL, RUN_PANEL, OUTPUT_PANEL = "Workload", "Runs", "Output"

class LengthPolicy(str, Enum):
    acceptance = "acceptance"
    entropy = "entropy"


# Wide enough for every column when the table goes to a file or a pipe.
FILE_WIDTH = 185


def bench(
    model: options.Model = None,
    dtype: options.Dtype = options.WeightsDtype.auto,
    workload: Annotated[
        Optional[Path],
        typer.Option(
            rich_help_panel=WORKLOAD_PANEL,
            help="A JSONL file of your own prompts, one {\"category\": ..., \"prompt\": ...} object per line"
            " (\"id\" optional). Default: the shipped workloads.",
        ),
    ] = None,
    categories: Annotated[
        Optional[list[str]],
        typer.Option(
            "--categories",
            "-c",
            rich_help_panel=WORKLOAD_PANEL,
            help="Only these categories, comma-separated or repeated (shipped: code-edit, summarize, rag, json, chat).",
        ),
    ] = None,
    limit: Annotated[
        Optional[int], typer.Option(min=1, rich_help_panel=WORKLOAD_PANEL, help="At most N prompts per category.")
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(min=2, rich_help_panel=RUN_PANEL, help="New tokens per generation.")
    ] = 128,
    repeats: Annotated[
        int, typer.Option(min=1, rich_help_panel=RUN_PANEL, help="Measured passes per prompt, after one warm-up.")
    ] = 1,
    temp: options.Temp = 0.0,
    seed: options.Seed = None,
    draft_tokens: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            rich_help_panel=RUN_PANEL,
            help="The most tokens drafted per pass: the adaptive run's ceiling and the fixed-length run's length.",
        ),
    ] = 32,
    length_policy: Annotated[
        LengthPolicy,
        typer.Option(
            rich_help_panel=RUN_PANEL,
            help="How the adaptive run picks its draft length: acceptance (against the measured pass costs) or"
            " entropy (EGAG: from the model's next-token entropy).",
        ),
    ] = LengthPolicy.acceptance,
    drafters: Annotated[
        Optional[list[str]],
        typer.Option(
            "--drafter",
            rich_help_panel=RUN_PANEL,
            help="Also run speculation with this drafter (repeatable): ngram, lookup, layer-skip:N, hybrid:SPEC, A+B,"
            " model:NAME, tree:N."
            " Each gets a row in a drafter table, against plain and the default drafter.",
        ),
    ] = None,
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            rich_help_panel=RUN_PANEL,
            help="Also run plain and speculative decoding in exact mode (every pass padded to one width: at most 3 drafts and the last token), on the"
            " same prompts: its cost, and greedy mismatches in both modes.",
        ),
    ] = False,
    mlx_lm: Annotated[
        bool,
        typer.Option("--mlx-lm/--no-mlx-lm", rich_help_panel=RUN_PANEL, help="Also time mlx-lm's own plain decoding."),
    ] = True,
    fixed: Annotated[
        bool,
        typer.Option("--fixed/--no-fixed", rich_help_panel=RUN_PANEL, help="Also time speculation that always drafts --draft-tokens."),
    ] = True,
    per_prompt: Annotated[
        bool, typer.Option("--per-prompt", rich_help_panel=OUTPUT_PANEL, help="Also print a row for every prompt.")
    ] = False,
    json_path: Annotated[
        Optional[Path],
        typer.Option("--json", rich_help_panel=OUTPUT_PANEL, help="Write every raw measurement (and token ids) to this file."),
    ] = None,
    plot_path: Annotated[
        Optional[Path],
        typer.Option(
            "--plot",
            rich_help_panel=OUTPUT_PANEL,
            help="Draw speedup by category and the accepted-length histogram into this PNG (needs akunu\\[plot]).",
        ),
    ] = None,
    cost_curve: Annotated[
        bool,
        typer.Option(
            "--cost-curve",
            help="Instead of the benchmark: time a forward pass of 1..33 tokens after 64, 512 and 2048 tokens of context, "
            "show it, and store it for adaptive drafting.",
        ),
    ] = False,
    context: Annotated[
        Optional[int],
        typer.Option(
            "--context",
            min=1,
            help="With --cost-curve: time the passes after this many tokens of context only (shown, not stored: "
            "adaptive drafting reads the curves measured at the usual contexts).",
        ),
    ] = None,
) -> None:
    """Measure speculative against plain decoding, and against mlx-lm, on realistic prompts.

    For every prompt, in one process and alternating order: plain decoding, speculative decoding (adaptive draft length), speculative with a fixed draft length, and mlx-lm's plain stream_generate. Decode tok/s excludes prefill; speedups are medians of per-prompt ratios.

    At temperature 0 the speculative tokens must equal the plain tokens: a mismatch is printed and makes the command exit with status 1.
    """
    from akunu import bench as lib
    from akunu.bench.engine import ModelEngine

    if context is not None and not cost_curve:
        raise OptionsError("--context goes with --cost-curve")
    if cost_curve:
        loaded = runtime.load(model, dtype)
        if context is not None and loaded.context_length and context + 33 > loaded.context_length:
            raise OptionsError(f"--context {context} leaves no room for a 33-token pass in the model's {loaded.context_length}")
        _print_header(loaded, "")
        show_cost_curve(loaded, draft_tokens, context)
        return
    prompts = lib.select(
        lib.load_workload(workload) if workload else lib.shipped_workload(), _split_categories(categories), limit
    )
    if plot_path is not None:
        from akunu.bench.report import require_matplotlib

        require_matplotlib()  # before the long run, not after it
    loaded = runtime.load(model, dtype)
    config = f"{'greedy' if temp == 0 else f'temp {temp}'} · {max_tokens} new tokens · {repeats} repeat(s) after a warm-up · drafts ≤ {draft_tokens} ({length_policy.value})"
    machine = _print_header(loaded, config)
    engine = ModelEngine(
        loaded.model, loaded.tokenizer, max_tokens=max_tokens, temp=temp, draft_tokens=draft_tokens, length_policy=length_policy.value,
        costs=runtime.cost_curve(loaded, draft_tokens), context_length=loaded.context_length, seed=seed,
    )  # fmt: skip
    methods = [lib.PLAIN, lib.SPEC] + ([lib.SPEC_FIXED] if fixed else [])
    methods += [lib.MLX_LM] if mlx_lm and _has_mlx_lm_tokenizer(loaded) else []
    methods += [lib.drafter_method(spec) for spec in _split_categories(drafters) or []]
    methods += [lib.PLAIN_EXACT, lib.SPEC_EXACT] if exact else []
    result = _run_with_progress(prompts, engine, methods, repeats, check_tokens=temp == 0)
    summaries = lib.summarize(result)
    out = _table_console()
    if per_prompt:
        out.print(per_prompt_table(result))
    out.print(summary_table(summaries, has_mlx=lib.MLX_LM in methods))
    if drafters:
        out.print(drafter_table(lib.summarize_drafters(result)))
    if exact:
        out.print(exact_table(lib.summarize_exact(result)))
    _print_checks(out, result, temp)
    settings = {
        "max_tokens": max_tokens, "repeats": repeats, "temp": temp, "seed": seed, "draft_tokens": draft_tokens, "length_policy": length_policy.value,
        "methods": methods, "workload": str(workload) if workload else "shipped", "prompts": len(prompts),
        "command": " ".join(["akunu", *sys.argv[1:]]),
    }  # fmt: skip
    if json_path is not None:
        from akunu.bench.report import result_record, write_json

        write_json(json_path, result_record(result, summaries, machine, settings))
        print_note(f"raw measurements written to {json_path}")
    if plot_path is not None:
        from akunu.bench.report import write_plot

        write_plot(plot_path, result, summaries, title=f"akunu bench · {loaded.name} · {machine['backend']}")
        print_note(f"chart written to {plot_path}")
    if result.failing_mismatches:
        raise typer.Exit(1)


def _split_categories(values: list[str] | None) -> list[str] | None:
    names = [name.strip() for value in values or [] for name in value.split(",") if name.strip()]
    return names or None


def _has_mlx_lm_tokenizer(loaded) -> bool:
    try:
        loaded.tokenizer.to_mlx_lm()
    except (NotImplementedError, ImportError, AttributeError) as error:
        print_note(f"no mlx-lm baseline for this model: {error or type(error).__name__}")
        return False
    return True


def _table_console() -> Console:
    return Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else FILE_WIDTH)


def _print_header(loaded, config: str) -> dict:
    from akunu.bench.machine import describe_machine

    machine = describe_machine(loaded.name, loaded.dtype, getattr(loaded, "dtype_reason", ""))
    out = _table_console()
    out.print(f"[bold]akunu bench[/] · model [bold]{escape(loaded.name)}[/] · dtype {machine['dtype']}"
              f" [dim]({escape(str(machine['dtype_reason']))})[/]")  # fmt: skip
    out.print(
        f"[dim]{machine['platform']} · {escape(str(machine['cpu']))} · {machine['cores']} cores · backend {machine['backend']}"
        f" · BLAS {escape(str(machine['blas']))} · mlx {machine['mlx']} · mlx-lm {machine['mlx_lm']}"
        + (f" · CPU kernels: {escape(str(machine['cpu_kernels']))}" if machine.get("cpu_kernels") else "")
        + "[/]"
    )
    if config:
        out.print(f"[dim]{config}[/]")
    return machine


def _run_with_progress(prompts, engine, methods, repeats, *, check_tokens: bool):
    from akunu.bench import run_benchmark

    err = stderr_console()
    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("warm-up", total=len(prompts) * repeats * len(methods))

        def measured(m) -> None:
            progress.update(task, advance=1, description=f"{m.category:>10} {m.prompt_id} · {m.method} {m.run.decode_tps:.1f} tok/s")

        def mismatch(m) -> None:
            if m.informational:
                return
            err.print(f"[bold red]MISMATCH[/] {m.prompt_id} (pass {m.repeat}): {_describe_mismatch(m)}")

        return run_benchmark(
            prompts, engine, methods=methods, repeats=repeats, check_tokens=check_tokens,
            on_measurement=measured, on_mismatch=mismatch,
            on_warmup=lambda method: progress.update(task, description=f"warm-up · {method}"),
        )  # fmt: skip


def _number(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _speedup(value: float | None, target: float = 1.0) -> str:
    if value is None:
        return "–"
    colour = "green" if value >= target else "red"
    return f"[{colour}]{value:.2f}×[/]"


def _bounds(bound: float | None, anchored: float | None) -> str:
    """The copy bound, and in brackets the one whose copies continue the sequence's last token."""
    return "–" if bound is None else f"{bound:.2f} ({_number(anchored, '.2f')})"


def summary_table(summaries, *, has_mlx: bool) -> Table:
    table = Table(title="decode tok/s (prefill excluded); speedups are medians of per-prompt ratios", title_justify="left")
    for name, justify in (
        ("category", "left"), ("prompts", "right"), ("plain tok/s", "right"), ("spec tok/s", "right"),
        ("speedup", "right"), ("accept", "right"), ("tok/pass", "right"), ("copy bound", "right"), ("drafting", "right"),
        ("fixed-draft speedup", "right"),
        ("mlx-lm tok/s", "right"), ("ours vs mlx-lm", "right"), ("prefill tok/s", "right"), ("mismatches", "right"),
    ):  # fmt: skip
        table.add_column(name, justify=justify, no_wrap=True)
    for s in summaries:
        overall = s.category == "overall"
        if overall:
            table.add_section()
        table.add_row(
            f"[bold]{s.category}[/]" if overall else s.category,
            str(s.prompts),
            _number(s.plain_tps, ".1f"),
            _number(s.spec_tps, ".1f"),
            _speedup(s.speedup),
            _number(s.acceptance and 100 * s.acceptance, ".0f", "%") if s.acceptance is not None else "–",
            _number(s.tokens_per_pass, ".2f"),
            _bounds(s.copy_bound, s.anchored_bound),
            _number(None if s.drafting_share is None else 100 * s.drafting_share, ".2f", "%"),
            _speedup(s.fixed_speedup),
            _number(s.mlx_tps, ".1f") if has_mlx else "–",
            _speedup(s.vs_mlx) if has_mlx else "–",
            _number(s.prefill_tps, ".0f"),
            f"[bold red]{s.mismatches}[/]" if s.mismatches else "0",
        )
    return table


def drafter_table(rows) -> Table:
    """Other drafters per category: tok/s, speedup over plain and over the default drafter."""
    table = Table(title="drafters (adaptive draft length; speedups are medians of per-prompt ratios)", title_justify="left")
    for name in ("category", "drafter", "tok/s", "vs plain", "vs default", "accept", "tok/pass", "mismatches"):
        table.add_column(name, justify="left" if name in ("category", "drafter") else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            f"[bold]{r.category}[/]" if r.category == "overall" else r.category,
            r.drafter,
            _number(r.tps, ".1f"),
            _speedup(r.speedup),
            _speedup(r.vs_default),
            _number(r.acceptance and 100 * r.acceptance, ".0f", "%") if r.acceptance is not None else "–",
            _number(r.tokens_per_pass, ".2f"),
            f"[bold red]{r.mismatches}[/]" if r.mismatches else "0",
        )
    return table


def per_prompt_table(result) -> Table:
    from akunu.bench import MLX_LM, PLAIN, SPEC, SPEC_FIXED

    table = Table(title="per prompt (median over passes)", title_justify="left")
    for name in ("prompt", "prompt tok", "plain", "spec", "speedup", "accept", "tok/pass", "fixed", "mlx-lm"):
        table.add_column(name, justify="left" if name == "prompt" else "right", no_wrap=True)
    by_prompt: dict[str, dict[str, list]] = {}
    for m in result.measurements:
        by_prompt.setdefault(m.prompt_id, {}).setdefault(m.method, []).append(m.run)
    for prompt_id, runs in by_prompt.items():
        tps = {method: sorted(r.decode_tps for r in rs)[len(rs) // 2] for method, rs in runs.items()}
        spec_runs = runs.get(SPEC, [])
        drafted = sum(r.drafted for r in spec_runs)
        passes = sum(r.forward_passes for r in spec_runs)
        table.add_row(
            prompt_id,
            str(runs[PLAIN][0].prompt_tokens) if PLAIN in runs else "–",
            _number(tps.get(PLAIN), ".1f"),
            _number(tps.get(SPEC), ".1f"),
            _speedup(tps[SPEC] / tps[PLAIN] if tps.get(SPEC) and tps.get(PLAIN) else None),
            f"{sum(r.accepted for r in spec_runs) / drafted:.0%}" if drafted else "–",
            f"{sum(r.generated - 1 for r in spec_runs) / passes:.2f}" if passes else "–",
            _number(tps.get(SPEC_FIXED), ".1f"),
            _number(tps.get(MLX_LM), ".1f"),
        )
    return table


def _print_checks(out: Console, result, temp: float) -> None:
    if not result.checked:
        out.print(f"[yellow]tokens not compared: at temperature {temp} speculative sampling may pick other tokens[/]")
        return
    from akunu.exact import NEAR_TIE_GAP

    counted, failing = result.counted_mismatches, result.failing_mismatches
    if counted:
        style = "bold red" if failing else "yellow"
        out.print(
            f"[{style}]{'✗' if failing else '!'} {len(counted)} greedy mismatch(es), {len(counted) - len(failing)} at a near-tie"
            f" (top-two gap ≤ {NEAR_TIE_GAP:g}, which the default mode allows; see README 'exactness')[/]"
        )
        for m in counted:
            out.print(f"[{'yellow' if m.near_tie else 'red'}]  {m.prompt_id} pass {m.repeat}: {_describe_mismatch(m)}[/]")
    else:
        out.print("[green]✓ 0 greedy mismatches: speculative tokens equal plain tokens on every prompt[/]")
    informational = [m for m in result.mismatches if m.informational]
    if informational:
        out.print(
            f"[dim]information: mlx-lm's tokens differ from ours on {len(informational)} generation(s)"
            f" (first at token {min(m.index for m in informational)}); the same model can round differently[/]"
        )
    elif any(m.method == "mlx-lm" for m in result.measurements):
        out.print("[dim]information: mlx-lm's tokens equal ours on every prompt[/]")


def _describe_mismatch(m) -> str:
    gap = "" if m.top2_gap is None else f"; top-two logit gap there {m.top2_gap:.3g}{', a near-tie' if m.near_tie else ''}"
    return f"{m.method} differs from {m.reference} at token {m.index} ({m.got} instead of {m.expected}{gap})"


def exact_table(rows) -> Table:
    """Exact mode against the default: tok/s, cost, speedup, and greedy mismatches in each mode."""
    table = Table(title="exact mode (passes of one width) against the default", title_justify="left")
    columns = (
        "category", "plain tok/s", "exact plain", "exact/default", "spec tok/s", "exact spec", "exact/default", "exact speedup",
        "mismatches default (near-ties)", "mismatches exact",
    )  # fmt: skip
    for name in columns:
        table.add_column(name, justify="left" if name == "category" else "right")
    for r in rows:
        table.add_row(
            r.category, _number(r.plain_tps, ".1f"), _number(r.plain_exact_tps, ".1f"), _number(r.plain_cost, ".2f", "×"),
            _number(r.spec_tps, ".1f"), _number(r.spec_exact_tps, ".1f"), _number(r.spec_cost, ".2f", "×"),
            _speedup(r.exact_speedup), f"{r.mismatches} ({r.near_ties})",
            f"[bold red]{r.exact_mismatches}[/]" if r.exact_mismatches else "0",
        )  # fmt: skip
    return table


def show_cost_curve(loaded, draft_tokens: int, context: int | None = None) -> None:
    """Measure afresh after each usual context, print ms and relative cost by width k, and store
    the curves for adaptive drafting (a curve at another `context` is shown only)."""
    from akunu import cost_curve
    from akunu.bench.cost_table import measure_and_save
    from akunu.draft_length import best_length

    key = cost_curve.curve_key(loaded.name, loaded.dtype)
    contexts = (context,) if context else cost_curve.contexts_within(loaded.context_length)
    after = ", ".join(map(str, contexts))
    with stderr_console().status(f"timing forward passes of 1..33 tokens after {after} tokens of context…"):
        if context is None:
            curves, path = measure_and_save(loaded.model, key, cost_curve.default_dir(), contexts)
        else:
            curves, path = cost_curve.measure_curves(loaded.model, cost_curve.MAX_WIDTH, contexts=contexts), None
    out = _table_console()
    out.print(_cost_table(curves, key, after))
    for c in contexts:
        picks = [f"{a:.0%} → {best_length(a, curves.at(c), draft_tokens)}" for a in (0.2, 0.4, 0.6, 0.8, 0.9)]
        out.print(f"after {c} tokens, adaptive drafting (≤ {draft_tokens}) drafts, by acceptance: " + ", ".join(picks))
    if path:
        out.print(f"[dim]saved to {path}; adaptive drafting reads it at each generation's context[/]")
    else:
        usual = ", ".join(map(str, cost_curve.CONTEXTS))
        out.print(f"[dim]not stored: adaptive drafting reads curves measured at {usual} tokens (akunu bench --cost-curve)[/]")


def _cost_table(curves, key: str, after: str) -> Table:
    from akunu.bench.cost_table import cost_table_rows

    contexts = sorted(curves.seconds)
    table = Table(title=f"forward-pass time by width k, after {after} tokens of context", caption=key, title_justify="left")
    table.add_column("k", justify="right")
    for name in [f"ms @{c}" for c in contexts] + [f"relative @{c}" for c in contexts]:
        table.add_column(name, justify="right")
    for k, ms, relative in cost_table_rows(curves):
        table.add_row(str(k), *(f"{m:.1f}" for m in ms), *(f"{r:.2f}" for r in relative))
    return table


# The lazy loader in app.py prefers a module-level `app`: a one-command Typer carrying the examples.
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(name="bench", epilog=EXAMPLES)(bench)
