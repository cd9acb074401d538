"""`akunu bench`: speculative against plain decoding and against mlx-lm, on real text, in one run;
`akunu bench cost-curve`: what a forward pass of 1..33 tokens costs on this backend; the other
subcommands (llama.cpp agreement, the kernel table, memory, a server load test) are in `bench_tools`.

The measuring lives in `akunu.bench`; this module parses options and draws the progress bar,
`bench_tables` draws the tables.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from akunu.cli import bench_tools, options, runtime
from akunu.cli.bench_tables import (
    cost_table,
    describe_mismatch,
    drafter_table,
    exact_table,
    per_prompt_table,
    print_checks,
    print_header,
    summary_table,
    table_console,
    traffic_table,
)
from akunu.cli.console import print_note, stderr_console
from akunu.drafters.specs import DraftLengthPolicy
from akunu.errors import OptionsError

EXAMPLES = """[bold]Examples[/]
  akunu bench --max-tokens 64 --limit 2            a quick look: 2 prompts per category
  akunu bench --json bench.json --plot bench.png   the full run, every measurement kept
  akunu bench --categories code-edit,chat --repeats 3
  akunu bench --workload my-prompts.jsonl          your own prompts: {"category": ..., "prompt": ...} per line
  akunu bench cost-curve                           forward-pass time for 1..33 tokens on this backend
  akunu bench llama-cpp --model M                  next-token agreement and perplexity against llama.cpp
  akunu bench kernel | memory | serve-load         the product kernels, peak memory, a server under load"""
COST_CURVE_EXAMPLES = """[bold]Examples[/]
  akunu bench cost-curve                  measured after 64, 512 and 2048 tokens, and stored
  akunu bench cost-curve --context 4096   after 4k tokens of context only (shown, not stored)"""

WORKLOAD_PANEL, RUN_PANEL, OUTPUT_PANEL = "Workload", "Runs", "Output"

Workload = Annotated[
    Path | None,
    typer.Option(
        rich_help_panel=WORKLOAD_PANEL,
        help='A JSONL file of your own prompts, one {"category": ..., "prompt": ...} object per line'
        ' ("id" optional). Default: the shipped workloads.',
    ),
]
Categories = Annotated[
    list[str] | None,
    typer.Option(
        "--categories",
        "-c",
        rich_help_panel=WORKLOAD_PANEL,
        help="Only these categories, comma-separated or repeated (shipped: code-edit, summarize, rag, json, chat).",
    ),
]
Limit = Annotated[
    int | None, typer.Option(min=1, rich_help_panel=WORKLOAD_PANEL, help="At most N prompts per category.")
]
MaxTokens = Annotated[int, typer.Option(min=2, rich_help_panel=RUN_PANEL, help="New tokens per generation.")]
Repeats = Annotated[
    int, typer.Option(min=1, rich_help_panel=RUN_PANEL, help="Measured passes per prompt, after one warm-up.")
]
DraftTokens = Annotated[
    int,
    typer.Option(
        min=1,
        max=64,
        rich_help_panel=RUN_PANEL,
        help="The most tokens drafted per pass: the speculative run's ceiling and the fixed-length run's length.",
    ),
]
DraftLength = Annotated[
    DraftLengthPolicy,
    typer.Option(
        rich_help_panel=RUN_PANEL,
        help="How the speculative run picks its draft length: adaptive (recent acceptance against measured pass costs),"
        " entropy (EGAG: from the model's confidence) or fixed.",
    ),
]
Drafters = Annotated[
    list[str] | None,
    typer.Option(
        "--drafter",
        rich_help_panel=RUN_PANEL,
        help="Also run speculation with this drafter (repeatable): ngram, lookup, recycle, recycle:N, layer-skip:N,"
        " hybrid:SPEC, A+B, model:NAME, tree:N. Each gets a row in a drafter table, against plain and the default drafter.",
    ),
]
Exact = Annotated[
    bool,
    typer.Option(
        "--exact",
        rich_help_panel=RUN_PANEL,
        help="Also run plain and speculative decoding in exact mode (every pass padded to one width: at most 3 drafts"
        " and the last token), on the same prompts: its cost, and greedy mismatches in both modes.",
    ),
]
MlxLm = Annotated[
    bool, typer.Option("--mlx-lm/--no-mlx-lm", rich_help_panel=RUN_PANEL, help="Also time mlx-lm's own plain decoding.")
]
LlamaCpp = Annotated[
    bool | None,
    typer.Option(
        "--llama-cpp/--no-llama-cpp",
        rich_help_panel=RUN_PANEL,
        help="Also time llama.cpp's plain decoding of the same GGUF file (needs llama-cpp-python; default: on when it is"
        " installed).",
    ),
]
Fixed = Annotated[
    bool,
    typer.Option(
        "--fixed/--no-fixed", rich_help_panel=RUN_PANEL, help="Also time speculation that always drafts --draft-tokens."
    ),
]
PerPrompt = Annotated[
    bool, typer.Option("--per-prompt", rich_help_panel=OUTPUT_PANEL, help="Also print a row for every prompt.")
]
JsonPath = Annotated[
    Path | None,
    typer.Option(
        "--json", rich_help_panel=OUTPUT_PANEL, help="Write every raw measurement (and token ids) to this file."
    ),
]
PlotPath = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        rich_help_panel=OUTPUT_PANEL,
        help="Draw speedup by category and the accepted-length histogram into this PNG (needs akunu\\[plot]).",
    ),
]
Context = Annotated[
    int | None,
    typer.Option(
        "--context",
        min=1,
        help="Time the passes after this many tokens of context only (shown, not stored: adaptive drafting reads the"
        " curves measured at the usual contexts).",
    ),
]

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.callback(invoke_without_command=True, epilog=EXAMPLES)
def bench(
    ctx: typer.Context,
    model: options.Model = None,
    dtype: options.Dtype = options.WeightsDtype.auto,
    workload: Workload = None,
    categories: Categories = None,
    limit: Limit = None,
    max_tokens: MaxTokens = 128,
    repeats: Repeats = 1,
    temp: options.Temp = 0.0,
    seed: options.Seed = None,
    draft_tokens: DraftTokens = 32,
    draft_length: DraftLength = DraftLengthPolicy.adaptive,
    drafters: Drafters = None,
    exact: Exact = False,
    mlx_lm: MlxLm = True,
    llama_cpp: LlamaCpp = None,
    fixed: Fixed = True,
    per_prompt: PerPrompt = False,
    json_path: JsonPath = None,
    plot_path: PlotPath = None,
    shard: options.Shard = options.Sharding.auto,
    check_ranks: options.CheckRanks = False,
) -> None:
    """Measure speculative against plain decoding, and against mlx-lm, on realistic prompts.

    For every prompt, in one process and alternating order: plain decoding, speculative decoding (adaptive draft length), speculative with a fixed draft length, mlx-lm's plain stream_generate and, for a GGUF model with llama-cpp-python installed, llama.cpp's plain decoding. Decode tok/s excludes prefill; speedups are medians of per-prompt ratios.

    At temperature 0 the speculative tokens must equal the plain tokens: a mismatch is printed and makes the command exit with status 1.
    """
    from akunu import bench as lib

    if ctx.invoked_subcommand is not None:
        return
    workload_prompts = lib.load_workload(workload) if workload else lib.shipped_workload()
    prompts = lib.select(workload_prompts, _split_categories(categories), limit)
    if plot_path is not None:
        from akunu.bench.report import require_matplotlib

        require_matplotlib()  # before the long run, not after it
    loaded = runtime.load(model, dtype, (), shard, check_ranks)
    if not runtime.alone():  # llama.cpp and mlx-lm's loop are one-process baselines
        llama_cpp, mlx_lm = False, False
    sampling = "greedy" if temp == 0 else f"temp {temp}"
    config = f"{sampling} · {max_tokens} new tokens · {repeats} repeat(s) after a warm-up · drafts ≤ {draft_tokens} ({draft_length.value})"
    llama_version, llama_line = _llama_cpp_status(loaded, llama_cpp, temp)
    machine = print_header(loaded, config, llama_line)
    engine = _engine(loaded, prompts, max_tokens=max_tokens, temp=temp, seed=seed, draft_tokens=draft_tokens,
                     draft_length=draft_length, llama_version=llama_version)  # fmt: skip
    methods = _methods(loaded, fixed=fixed, mlx_lm=mlx_lm, drafters=drafters, exact=exact)
    methods += [lib.LLAMA_CPP] if engine.llama_cpp is not None else []
    result = _run_with_progress(prompts, engine, methods, repeats, check_tokens=temp == 0)
    summaries = _print_tables(result, methods, per_prompt=per_prompt, temp=temp)
    if not runtime.alone():
        table_console().print(traffic_table(result))
    settings = {
        "max_tokens": max_tokens, "repeats": repeats, "temp": temp, "seed": seed, "draft_tokens": draft_tokens,
        "draft_length": draft_length.value, "methods": methods, "workload": str(workload) if workload else "shipped",
        "prompts": len(prompts), "command": " ".join(["akunu", *sys.argv[1:]]),
        "llama_cpp": {"version": llama_version, "threads": engine.llama_cpp.threads} if engine.llama_cpp else None,
    }  # fmt: skip
    _write_files(result, summaries, machine, settings, json_path=json_path, plot_path=plot_path, name=loaded.name)
    if result.failing_mismatches:
        raise typer.Exit(1)


@app.command("cost-curve", epilog=COST_CURVE_EXAMPLES)
def cost_curve(
    model: options.Model = None,
    dtype: options.Dtype = options.WeightsDtype.auto,
    draft_tokens: DraftTokens = 32,
    context: Context = None,
) -> None:
    """Time a forward pass of 1..33 tokens after 64, 512 and 2048 tokens of context, show it, and store it for adaptive drafting."""
    loaded = runtime.load(model, dtype)
    if context is not None and loaded.context_length and context + 33 > loaded.context_length:
        raise OptionsError(
            f"--context {context} leaves no room for a 33-token pass in the model's {loaded.context_length}"
        )
    print_header(loaded, "")
    show_cost_curve(loaded, draft_tokens, context)


bench_tools.register(app)


def _engine(loaded, prompts, *, max_tokens, temp, seed, draft_tokens, draft_length, llama_version):
    """akunu's engine for the run, with llama.cpp opened on the model's GGUF where it runs."""
    from akunu.bench.engine import ModelEngine

    engine = ModelEngine(
        loaded.model, loaded.tokenizer, max_tokens=max_tokens, temp=temp, draft_tokens=draft_tokens, draft_length=draft_length,
        costs=runtime.cost_curve(loaded, draft_tokens), context_length=loaded.context_length, seed=seed,
    )  # fmt: skip
    if llama_version:
        engine.llama_cpp = _open_llama_cpp(loaded, engine, prompts, max_tokens, seed)
    return engine


def _methods(loaded, *, fixed: bool, mlx_lm: bool, drafters: list[str] | None, exact: bool) -> list[str]:
    from akunu import bench as lib

    methods = [lib.PLAIN, lib.SPEC] + ([lib.SPEC_FIXED] if fixed else [])
    methods += [lib.MLX_LM] if mlx_lm and _has_mlx_lm_tokenizer(loaded) else []
    methods += [lib.drafter_method(spec) for spec in _split_categories(drafters) or []]
    return methods + ([lib.PLAIN_EXACT, lib.SPEC_EXACT] if exact else [])


def _llama_cpp_status(loaded, wanted: bool | None, temp: float) -> tuple[str | None, str]:
    """llama-cpp-python's version when llama.cpp will run (else None), and the header's line about it."""
    from akunu.bench.llama_cpp import llama_cpp_version, machine_threads

    if wanted is False:
        return None, "llama.cpp: not run (--no-llama-cpp)"
    version = llama_cpp_version()
    if version is None:
        if wanted:
            raise OptionsError("--llama-cpp needs llama-cpp-python: pip install llama-cpp-python")
        return None, "llama.cpp: not found (pip install llama-cpp-python to compare with it)"
    if loaded.path.suffix.lower() != ".gguf" or not loaded.path.is_file():
        return None, f"llama.cpp: llama-cpp-python {version} found; not run: the model is not a GGUF file"
    if temp != 0:
        return None, f"llama.cpp: llama-cpp-python {version} found; not run: it is timed greedy, this run samples"
    line = f"llama.cpp: llama-cpp-python {version} found; its plain greedy decoding of {loaded.path.name}"
    return version, line + f" on {machine_threads()} threads runs in turn"


def _open_llama_cpp(loaded, engine, prompts, max_tokens: int, seed: int | None):
    """llama.cpp on the model's GGUF, loaded now with room for the longest prompt; None (and a note) if it cannot load it."""
    from akunu.bench.llama_cpp import LlamaCppEngine

    llama = LlamaCppEngine(
        loaded.path, max_tokens=max_tokens, stop_ids=loaded.tokenizer.eos_ids, context_length=loaded.context_length,
        seed=seed or 0,
    )  # fmt: skip
    try:
        llama.open(max((len(engine.encode(p)) for p in prompts), default=0))
    except Exception as error:  # llama.cpp's loader raises ValueError, among others
        print_note(f"no llama.cpp column: it could not load {loaded.path.name} ({error})")
        return None
    return llama


def _print_tables(result, methods: list[str], *, per_prompt: bool, temp: float):
    """The summary (and per-prompt, drafter and exact-mode tables where asked for) and the greedy checks."""
    from akunu import bench as lib
    from akunu.bench.runner import DRAFTER_PREFIX

    summaries = lib.summarize(result)
    out = table_console()
    if per_prompt:
        out.print(per_prompt_table(result))
    out.print(summary_table(summaries, has_mlx=lib.MLX_LM in methods, has_llama_cpp=lib.LLAMA_CPP in methods))
    if any(method.startswith(DRAFTER_PREFIX) for method in methods):
        out.print(drafter_table(lib.summarize_drafters(result)))
    if lib.SPEC_EXACT in methods:
        out.print(exact_table(lib.summarize_exact(result)))
    print_checks(out, result, temp)
    return summaries


def _write_files(
    result, summaries, machine: dict, settings: dict, *, json_path: Path | None, plot_path: Path | None, name: str
):
    if json_path is not None:
        from akunu.bench.report import result_record, write_json

        write_json(json_path, result_record(result, summaries, machine, settings))
        print_note(f"raw measurements written to {json_path}")
    if plot_path is not None:
        from akunu.bench.report import write_plot

        write_plot(plot_path, result, summaries, title=f"akunu bench · {name} · {machine['backend']}")
        print_note(f"chart written to {plot_path}")


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


def _run_with_progress(prompts, engine, methods, repeats, *, check_tokens: bool):
    from akunu.bench import run_benchmark

    err = stderr_console()
    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("warm-up", total=len(prompts) * repeats * len(methods))

        def measured(m) -> None:
            progress.update(
                task, advance=1, description=f"{m.category:>10} {m.prompt_id} · {m.method} {m.run.decode_tps:.1f} tok/s"
            )

        def mismatch(m) -> None:
            if m.informational:
                return
            err.print(f"[bold red]MISMATCH[/] {m.prompt_id} (pass {m.repeat}): {describe_mismatch(m)}")

        return run_benchmark(
            prompts, engine, methods=methods, repeats=repeats, check_tokens=check_tokens,
            on_measurement=measured, on_mismatch=mismatch,
            on_warmup=lambda method: progress.update(task, description=f"warm-up · {method}"),
        )  # fmt: skip


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
    out = table_console()
    out.print(cost_table(curves, key, after))
    for c in contexts:
        picks = [f"{a:.0%} → {best_length(a, curves.at(c), draft_tokens)}" for a in (0.2, 0.4, 0.6, 0.8, 0.9)]
        out.print(f"after {c} tokens, adaptive drafting (≤ {draft_tokens}) drafts, by acceptance: " + ", ".join(picks))
    if path:
        out.print(f"[dim]saved to {path}; adaptive drafting reads it at each generation's context[/]")
    else:
        usual = ", ".join(map(str, cost_curve.CONTEXTS))
        out.print(
            f"[dim]not stored: adaptive drafting reads curves measured at {usual} tokens (akunu bench cost-curve)[/]"
        )
