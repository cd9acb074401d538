"""The tables and lines `akunu bench` prints: run header, summary, drafters, per prompt, exact mode,
greedy checks and the cost curve."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Wide enough for every column when the table goes to a file or a pipe.
FILE_WIDTH = 240


def table_console() -> Console:
    return Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else FILE_WIDTH)


def print_header(loaded, config: str, llama_cpp: str = "") -> dict:
    from akunu.machine import describe_machine

    machine = describe_machine(loaded.name, loaded.dtype, getattr(loaded, "dtype_reason", ""))
    out = table_console()
    out.print(f"[bold]akunu bench[/] · model [bold]{escape(loaded.name)}[/] · dtype {machine['dtype']}"
              f" [dim]({escape(str(machine['dtype_reason']))})[/]")  # fmt: skip
    out.print(
        f"[dim]{machine['platform']} · {escape(str(machine['cpu']))} · {machine['cores']} cores · backend {machine['backend']}"
        f" · BLAS {escape(str(machine['blas']))} · mlx {machine['mlx']} · mlx-lm {machine['mlx_lm']}"
        + (f" · CPU kernels: {escape(str(machine['cpu_kernels']))}" if machine.get("cpu_kernels") else "")
        + (
            f" · quantized products: {escape(str(machine['quantized_kernel']))}"
            if machine.get("quantized_kernel")
            else ""
        )
        + "[/]"
    )
    if config:
        out.print(f"[dim]{config}[/]")
    if llama_cpp:
        out.print(f"[dim]{escape(llama_cpp)}[/]")
    return machine


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


def summary_table(summaries, *, has_mlx: bool, has_llama_cpp: bool = False) -> Table:
    title = "decode tok/s (prefill excluded); speedups are medians of per-prompt ratios"
    title += "; ours vs llama.cpp: plain / speculative against its plain" if has_llama_cpp else ""
    table = Table(title=title, title_justify="left")
    for name, justify in (
        ("category", "left"), ("prompts", "right"), ("plain tok/s", "right"), ("spec tok/s", "right"),
        ("speedup", "right"), ("accept", "right"), ("tok/pass", "right"), ("copy bound", "right"), ("drafting", "right"),
        ("fixed-draft speedup", "right"),
        ("mlx-lm tok/s", "right"), ("ours vs mlx-lm", "right"),
        *((("llama.cpp tok/s", "right"), ("ours vs llama.cpp", "right")) if has_llama_cpp else ()),
        ("prefill tok/s", "right"), ("mismatches", "right"),
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
            *(
                (_number(s.llama_cpp_tps, ".1f"), f"{_speedup(s.vs_llama_cpp)} / {_speedup(s.spec_vs_llama_cpp, 2.0)}")
                if has_llama_cpp
                else ()
            ),
            _number(s.prefill_tps, ".0f"),
            f"[bold red]{s.mismatches}[/]" if s.mismatches else "0",
        )
    return table


def drafter_table(rows) -> Table:
    """Other drafters per category: tok/s, speedup over plain and over the default drafter."""
    table = Table(
        title="drafters (adaptive draft length; speedups are medians of per-prompt ratios)", title_justify="left"
    )
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
    from akunu.bench import LLAMA_CPP, MLX_LM, PLAIN, SPEC, SPEC_FIXED

    table = Table(title="per prompt (median over passes)", title_justify="left")
    for name in (
        "prompt",
        "prompt tok",
        "plain",
        "spec",
        "speedup",
        "accept",
        "tok/pass",
        "fixed",
        "mlx-lm",
        "llama.cpp",
    ):
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
            _number(tps.get(LLAMA_CPP), ".1f"),
        )
    return table


def print_checks(out: Console, result, temp: float) -> None:
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
            out.print(
                f"[{'yellow' if m.near_tie else 'red'}]  {m.prompt_id} pass {m.repeat}: {describe_mismatch(m)}[/]"
            )
    else:
        out.print("[green]✓ 0 greedy mismatches: speculative tokens equal plain tokens on every prompt[/]")
    for baseline in ("mlx-lm", "llama.cpp"):
        _print_baseline_check(out, result, baseline)


def _print_baseline_check(out: Console, result, baseline: str) -> None:
    """Whether a baseline's greedy tokens equal our plain ones (information: another engine may round differently)."""
    differing = [m for m in result.mismatches if m.informational and m.method == baseline]
    if differing:
        out.print(
            f"[dim]information: {baseline}'s tokens differ from ours on {len(differing)} generation(s)"
            f" (first at token {min(m.index for m in differing)}); the same model can round differently[/]"
        )
    elif any(m.method == baseline for m in result.measurements):
        out.print(f"[dim]information: {baseline}'s tokens equal ours on every prompt[/]")


def describe_mismatch(m) -> str:
    gap = (
        ""
        if m.top2_gap is None
        else f"; top-two logit gap there {m.top2_gap:.3g}{', a near-tie' if m.near_tie else ''}"
    )
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


def cost_table(curves, key: str, after: str) -> Table:
    from akunu.bench.cost_table import cost_table_rows

    contexts = sorted(curves.seconds)
    table = Table(
        title=f"forward-pass time by width k (a chain; a tree of the root and k - 1 nodes), after {after} tokens of context",
        caption=key,
        title_justify="left",
    )
    table.add_column("k", justify="right")
    trees = contexts if curves.has_trees else []
    names = [f"ms @{c}" for c in contexts] + [f"tree ms @{c}" for c in trees]
    for name in names + [f"relative @{c}" for c in contexts] + [f"tree @{c}" for c in trees]:
        table.add_column(name, justify="right")
    for k, ms, relative, tree_ms, tree_relative in cost_table_rows(curves):
        times = (f"{m:.1f}" for m in [*ms, *tree_ms])
        table.add_row(str(k), *times, *(f"{r:.2f}" for r in [*relative, *tree_relative]))
    return table


def traffic_table(result) -> Table:
    """Under mlx.launch: each method's decode speed, tokens per pass, and what it costs between the ranks."""
    from statistics import median

    from akunu.distributed import size

    table = Table(title=f"between the ranks ({size()} processes), per generated token", title_justify="left")
    for column in ("method", "tok/s", "tok/pass", "round trips", "bytes rank 0 sends"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for method in dict.fromkeys(m.method for m in result.measurements):
        runs = [m.run for m in result.measurements if m.method == method]
        passes = sum(r.forward_passes for r in runs)
        tokens = sum(max(r.generated - 1, 0) for r in runs)  # the first token comes from prefill
        if not passes or not tokens:
            continue
        trips, sent = sum(r.collectives for r in runs) / tokens, sum(r.bytes_sent for r in runs) / tokens
        rate = median(r.decode_tps for r in runs)
        table.add_row(method, f"{rate:.1f}", f"{tokens / passes:.2f}", f"{trips:.1f}", f"{sent / 1024:.1f} KiB")
    return table
