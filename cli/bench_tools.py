"""`akunu bench llama-cpp`, `kernel`, `memory`, `serve-load`, `long-prompt` and `serve-models`: agreement with
llama.cpp, the product kernels by rows, peak memory, a concurrent load on `akunu serve`, short requests beside a long
prompt, and one server's models loading and unloading.

The measuring lives in `akunu.bench` (agreement, llama_cpp, kernel_rows, memory, serve_load); this module
parses options and prints. `register` adds the commands to `akunu bench`.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from akunu.cli import options, runtime
from akunu.cli.bench_tables import print_header, table_console
from akunu.cli.console import print_note, stderr_console
from akunu.errors import AkunuError, ModelError, OptionsError

LLAMA_CPP_EXAMPLES = """[bold]Examples[/]
  akunu bench llama-cpp --model qwen2.5-coder-0.5b --dtype quantized   the shipped text, 1,640 tokens
  akunu bench llama-cpp --model my-model.gguf --text notes.txt --tokens 512"""
KERNEL_EXAMPLES = """[bold]Examples[/]
  akunu bench kernel                              4, 5 and 8 bits by 1, 4, 16 and 33 rows
  akunu bench kernel --bits 5,8 --centered --mlx   zero points at mid-range (Q5_0, Q8_0), beside MLX's product
  akunu bench kernel --float32 --rows 1,2,5,9     the float32 decode kernel too"""
MEMORY_EXAMPLES = """[bold]Examples[/]
  akunu bench memory                               the default model
  akunu bench memory --model qwen2.5-coder-0.5b --dtype float32"""
SERVE_LOAD_EXAMPLES = """[bold]Examples[/]
  akunu bench serve-load                                   starts akunu serve on loopback, 16 clients x 4 requests
  akunu bench serve-load --base-url http://127.0.0.1:8080/v1 --clients 4"""
SERVE_MODELS_EXAMPLES = """[bold]Examples[/]
  akunu bench serve-models                                 smollm2-135m stays loaded, qwen2.5-coder-0.5b loads
  akunu bench serve-models --models gemma3-270m,smollm2-135m --keep-alive 5"""
SERVE_EXAMPLES = """[bold]Examples[/]
  akunu bench serve                                        1, 2, 4 and 8 clients, side by side and one at a time
  akunu bench serve --model qwen2.5-coder-0.5b --clients 4 --categories code-edit"""


def register(app: typer.Typer) -> None:
    app.command("llama-cpp", epilog=LLAMA_CPP_EXAMPLES)(llama_cpp)
    app.command("kernel", epilog=KERNEL_EXAMPLES)(kernel)
    app.command("memory", epilog=MEMORY_EXAMPLES)(memory)
    app.command("serve-load", epilog=SERVE_LOAD_EXAMPLES)(serve_load)
    app.command("serve", epilog=SERVE_EXAMPLES)(serve)
    app.command("serve-models", epilog=SERVE_MODELS_EXAMPLES)(serve_models)
    app.command("prompt-cache", epilog=PROMPT_CACHE_EXAMPLES)(prompt_cache)
    app.command("long-prompt", epilog=LONG_PROMPT_EXAMPLES)(long_prompt)


# akunu bench llama-cpp -------------------------------------------------------------------------


TextFile = Annotated[
    Path | None, typer.Option(help="A UTF-8 text file to score. Default: the Declaration of Independence (shipped).")
]
Tokens = Annotated[
    int, typer.Option(min=2, help="Score at most the text's first N tokens (and at most the model's context).")
]


def llama_cpp(
    model: options.Model = None,
    dtype: options.Dtype = options.WeightsDtype.auto,
    text: TextFile = None,
    tokens: Tokens = 2048,
) -> None:
    """Compare akunu with llama.cpp on one GGUF: next-token agreement and perplexity, teacher-forced over a text.

    Both read llama.cpp's token ids for the text; at every position, is akunu's top token llama.cpp's, and what is each one's perplexity. Needs llama-cpp-python.
    """
    from akunu.bench import agreement
    from akunu.bench import llama_cpp as llama

    if llama.llama_cpp_version() is None:
        raise AkunuError("akunu bench llama-cpp needs llama-cpp-python: pip install llama-cpp-python")
    content, name = agreement.read_text(text)
    loaded = runtime.load(model, dtype)
    if loaded.path.suffix.lower() != ".gguf" or not loaded.path.is_file():
        raise OptionsError(f"llama.cpp reads GGUF files; {loaded.name} is not one ({loaded.path})")
    print_header(loaded, f"llama-cpp-python {llama.llama_cpp_version()} on {loaded.path.name}")
    ids, theirs = _llama_cpp_predictions(loaded, content, name, tokens)
    with stderr_console().status(f"akunu scoring {len(ids) - 1} positions…"):
        result = agreement.compare(agreement.akunu_predictions(loaded.model, ids), theirs)
    same = loaded.tokenizer.encode(content, add_bos=False)[: len(ids)] == ids
    out = table_console()
    out.print(f"text: {escape(name)}, {len(ids):,} tokens ({result.positions:,} positions); akunu's tokenizer "
              + ("gives llama.cpp's ids" if same else "gives other ids"))  # fmt: skip
    out.print(f"next-token agreement with llama.cpp: {result.share:.2%} ({result.agreed:,}/{result.positions:,})")
    change = result.akunu_perplexity / result.llama_cpp_perplexity - 1
    out.print(f"perplexity: akunu {result.akunu_perplexity:.4f}, llama.cpp {result.llama_cpp_perplexity:.4f}"
              f" (akunu {change:+.2%})")  # fmt: skip


def _llama_cpp_predictions(loaded, content: str, name: str, tokens: int):
    """llama.cpp's ids for the text (at most `tokens`, and the context) and its predictions at each of them."""
    from akunu.bench import agreement
    from akunu.bench import llama_cpp as llama

    try:
        ids = llama.tokenize(loaded.path, content)[: min(tokens, loaded.context_length or tokens)]
        if len(ids) < 2:
            raise agreement.TextError(f"{name} is {len(ids)} token(s) long: scoring needs at least 2")
        with stderr_console().status(f"llama.cpp scoring {len(ids) - 1} positions…"):
            return ids, llama.teacher_forced(loaded.path, ids)
    except AkunuError:
        raise
    except Exception as error:  # llama.cpp's loader raises ValueError, among others
        raise ModelError(f"llama.cpp cannot read {loaded.path.name}: {error}") from None


# akunu bench kernel ----------------------------------------------------------------------------


def _counts(value: str) -> list[int]:
    """A comma-separated list of positive integers."""
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of whole numbers") from None
    if any(count < 1 for count in counts):
        raise typer.BadParameter(f"{value!r}: every number must be at least 1")
    return counts


class ScaleType(str, Enum):
    float32 = "float32"
    float16 = "float16"


# --bits and --rows arrive as text and leave their callback as lists of ints.
Bits = Annotated[str, typer.Option(callback=_counts, help="Bit widths of quantized weights, comma-separated.")]
Rows = Annotated[str, typer.Option(callback=_counts, help="Rows of x, comma-separated.")]
Layers = Annotated[int, typer.Option(min=1, max=64, help="Sets of Qwen2.5-0.5B's layer products.")]
Reps = Annotated[int, typer.Option(min=1, help="Repetitions; the best one counts.")]
Scales = Annotated[ScaleType, typer.Option(help="The quantized weights' scales and biases.")]
Centered = Annotated[
    bool, typer.Option("--centered", help="Zero points at mid-range (GGUF's Q4_0, Q5_0, Q8_0): read without biases.")
]
Float32 = Annotated[bool, typer.Option("--float32", help="Also float32 weights (the float32 decode kernel).")]
Mlx = Annotated[bool, typer.Option("--mlx", help="Also time MLX's own quantized_matmul on the same weights.")]
CpuTime = Annotated[
    bool, typer.Option("--cpu-time", help="Time the process's CPU seconds, not the wall clock (steadier when shared).")
]


def kernel(
    bits: Bits = "4,5,8",
    rows: Rows = "1,4,16,33",
    layers: Layers = 4,
    reps: Reps = 5,
    scales: Scales = ScaleType.float32,
    centered: Centered = False,
    float32: Float32 = False,
    mlx: Mlx = False,
    cpu_time: CpuTime = False,
) -> None:
    """Time akunu's quantized x @ Wᵀ kernel by rows of x: milliseconds, and GB/s of weights read, against the copy bandwidth.

    The weights are random, in Qwen2.5-0.5B's layer shapes, enough layers of them to stream from memory as in a decode step. Row counts above the kernel's limit time what a prefill does: dequantize, then one float32 product.
    """
    import time

    from akunu.backends.cpu import quantized
    from akunu.bench import kernel_rows as lib

    if not bits and not float32:
        raise OptionsError("nothing to time: give --bits or --float32")
    lib.check_quantized(bits)  # before any weights are made
    clock = time.process_time if cpu_time else time.perf_counter
    layouts = [lambda b=b: lib.quantized_weights(b, layers, _mlx_dtype(scales), centered) for b in bits]
    layouts += [lambda: lib.float32_weights(layers)] if float32 else []
    timings = []
    with stderr_console().status("timing the products…"):
        bandwidth = lib.copy_bandwidth(clock)
        for make in layouts:
            weights = make()
            timings += lib.time_rows(weights, rows, reps, mlx=mlx, clock=clock)
            del weights  # one layout in memory at a time
    out = table_console()
    float32_kernel = (
        "akunu's" if lib.float32_kernel_built() else "MLX's BLAS (akunu's float32 kernel is not built here)"
    )
    out.print(f"[bold]akunu bench kernel[/] · quantized products: {escape(quantized.describe())}"
              + (f" · float32 products: {float32_kernel}" if float32 else ""))  # fmt: skip
    out.print(f"[dim]{layers} layer(s) of Qwen2.5-0.5B's products · best of {reps} · "
              f"{'CPU' if cpu_time else 'wall-clock'} time · copy bandwidth {bandwidth:.1f} GB/s (read + write)[/]")  # fmt: skip
    out.print(_kernel_table(timings, mlx=mlx))


def _mlx_dtype(scales: ScaleType):
    import mlx.core as mx

    return getattr(mx, scales.value)


def _kernel_table(timings, *, mlx: bool) -> Table:
    table = Table(title="x @ Wᵀ by rows of x")
    for column in ("weights", "rows", "ms", "GB/s", "÷ 1 row", *(["MLX ms"] if mlx else [])):
        table.add_column(column, justify="left" if column == "weights" else "right")
    for t in timings:
        ratio = "–" if t.per_one_row is None else f"{t.per_one_row:.2f}"
        theirs = ["–" if t.mlx_seconds is None else f"{t.mlx_seconds * 1e3:.1f}"] if mlx else []
        table.add_row(t.weights, str(t.rows), f"{t.seconds * 1e3:.2f}", f"{t.gigabytes_per_second:.1f}", ratio, *theirs)
    return table


# akunu bench memory ----------------------------------------------------------------------------


GenerateTokens = Annotated[int, typer.Option("--max-tokens", min=1, help="New tokens of the greedy generate.")]


def memory(
    model: options.Model = None,
    dtype: options.Dtype = options.WeightsDtype.auto,
    max_tokens: GenerateTokens = 64,
) -> None:
    """Peak resident memory of loading a model and a short greedy generate, stage by stage, against the model's file size.

    The peak is this process's; run one model per command.
    """
    import mlx.core as mx

    from akunu.bench import memory as lib

    mx.eval(mx.zeros(1))
    stages = [lib.stage("imports")]
    loaded = runtime.load(model, dtype)
    stages.append(lib.stage("load"))
    stats = lib.plain_generate(loaded, max_tokens)
    stages.append(lib.stage("generate"))
    out = table_console()
    out.print(f"[bold]akunu bench memory[/] · model [bold]{escape(loaded.name)}[/] · dtype {loaded.dtype}"
              f" [dim]({escape(str(loaded.dtype_reason))})[/]")  # fmt: skip
    out.print(_stage_table(stages))
    size, peak = lib.file_mib(loaded.path), stages[-1].peak_mib
    on_disk = f"on disk {size:.0f} MiB, peak {peak / size:.2f}× that · " if size else ""
    out.print(f"{on_disk}weights in memory {lib.weights_mib(loaded.model):.0f} MiB · "
              f"decode {stats.decode_tps:.1f} tok/s ({stats.generated_tokens} tokens, plain greedy)")  # fmt: skip


def _stage_table(stages) -> Table:
    table = Table()
    for column in ("after", "resident MiB", "peak MiB"):
        table.add_column(column, justify="right")
    for stage in stages:
        resident = "–" if stage.resident_mib is None else f"{stage.resident_mib:.0f}"
        table.add_row(stage.name, resident, f"{stage.peak_mib:.0f}")
    return table


# akunu bench serve-load ------------------------------------------------------------------------


def _http_url(value: str | None) -> str | None:
    if value is not None and not value.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{value!r} is not an http:// or https:// URL")
    return value


BaseUrl = Annotated[
    str | None,
    typer.Option(
        callback=_http_url,
        show_default=False,
        help="A running server's API root, e.g. http://127.0.0.1:8080/v1. Default: start akunu serve on loopback.",
    ),
]
# Not options.Model: AKUNU_MODEL already reaches a started server, and must not clash with --base-url.
ServerModel = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", show_default=False, help="The model a started server loads (default: akunu serve's own)."
    ),
]
Clients = Annotated[int, typer.Option(min=1, max=256, help="Clients sending at once.")]
Requests = Annotated[int, typer.Option(min=1, help="Requests per client, one after another.")]
AnswerTokens = Annotated[int, typer.Option("--max-tokens", min=1, help="New tokens per answer.")]
ApiKey = Annotated[
    str | None,
    typer.Option(envvar="AKUNU_API_KEY", show_default=False, help="The server's API key, if it needs one."),
]


def serve_load(
    base_url: BaseUrl = None,
    model: ServerModel = None,
    clients: Clients = 16,
    requests: Requests = 4,
    max_tokens: AnswerTokens = 32,
    api_key: ApiKey = None,
) -> None:
    """Load-test akunu serve: clients send greedy chat requests all at once; each answer must equal the same request sent alone.

    Prints latency percentiles and throughput; exits with status 1 if a request went unanswered or got another answer.
    """
    from akunu.bench import serve_load as lib

    if base_url is not None and model is not None:
        raise OptionsError("--model picks the model of a server this command starts; a --base-url server has its own")
    process, log = None, None
    try:
        if base_url is None:
            log = lib.server_log()
            with stderr_console().status("starting akunu serve on loopback…"):
                process, base_url = lib.start_server(model, queue_depth=clients, log=log)
        with stderr_console().status(f"{clients} clients × {requests} requests, then each request alone…"):
            result = lib.run(lib.Client(base_url, api_key), clients=clients, requests=requests, max_tokens=max_tokens)
    finally:
        if process is not None:
            lib.stop_server(process)
        if log is not None:
            log.close()
    _print_load(result, base_url, max_tokens)
    if not result.passed:
        raise typer.Exit(1)


def _print_load(result, base_url: str, max_tokens: int) -> None:
    out = table_console()
    out.print(f"[bold]akunu bench serve-load[/] · {escape(base_url)} · {result.clients} clients · "
              f"{result.requests} requests of ≤ {max_tokens} tokens")  # fmt: skip
    if result.latencies:
        passes = "" if result.forward_passes is None else f" · {result.forward_passes} forward passes"
        out.print(f"latency p50 {result.percentile(0.5):.2f} s, p95 {result.percentile(0.95):.2f} s, max "
                  f"{max(result.latencies):.2f} s · {len(result.latencies) / result.wall_seconds:.2f} answers/s"
                  f" over {result.wall_seconds:.1f} s{passes}")  # fmt: skip
    answered = len(result.latencies) - len(result.mismatched)
    out.print(f"{answered}/{result.requests} answered as when sent alone")
    for line in result.failures[:5]:
        print_note(f"no answer: {line}")
    for c, r in result.mismatched[:5]:
        print_note(f"client {c}, request {r}: its answer under load differs from the same request sent alone")


# akunu bench serve-models ----------------------------------------------------------------------


def _two_models(value: str) -> list[str]:
    models = [part.strip() for part in value.split(",") if part.strip()]
    if len(models) != 2 or models[0] == models[1]:
        raise typer.BadParameter(f"{value!r} is not two different models, comma-separated")
    return models


def serve_models(
    models: Annotated[
        str,
        typer.Option(help="Two models, comma-separated: the first stays loaded, the second loads and unloads."),
    ] = "smollm2-135m,qwen2.5-coder-0.5b",
    requests: Annotated[int, typer.Option(min=1, help="Requests per measured case.")] = 4,
    max_tokens: AnswerTokens = 24,
    keep_alive: Annotated[
        float, typer.Option(min=0.5, help="The second model's keep_alive, seconds: it unloads after this idle.")
    ] = 3.0,
) -> None:
    """One akunu serve with two models, clients alternating: time to first token for a loaded model, for one loading
    (and for the loaded one while the other loads), and for one loaded again after its keep_alive unloaded it;
    the server's resident memory before, during and after the load and the unload.
    """
    from akunu.bench import serve_load, serve_models
    from akunu.machine import cpu_name

    first, second = _two_models(models)
    log = serve_load.server_log()
    try:
        with stderr_console().status(f"akunu serve with {first} and {second} on loopback…"):
            result = serve_models.run(first, second, requests=requests, max_tokens=max_tokens,
                                      keep_alive=keep_alive, log=log)  # fmt: skip
    finally:
        log.close()
    _print_serve_models(result, first, second, cpu_name(), max_tokens)
    if not result.same_after_reload:
        print_note(f"{second}'s greedy answer after its reload differs from before")
        raise typer.Exit(1)


def _print_serve_models(result, first: str, second: str, cpu: str, max_tokens: int) -> None:
    out = table_console()
    out.print(f"[bold]akunu bench serve-models[/] · {escape(first)} (A, stays loaded) and {escape(second)} (B) · "
              f"≤ {max_tokens} tokens, greedy, streamed · {escape(cpu)}")  # fmt: skip
    table = Table(box=None, header_style="bold")
    for column in ("case", "requests", "first token p50", "max", "longest stall"):
        table.add_column(column, justify="left" if column == "case" else "right")

    def row(case: str, answers) -> None:
        if answers:
            firsts = sorted(a.first_token for a in answers)
            table.add_row(case, str(len(answers)), f"{result.p50(answers):.2f} s", f"{firsts[-1]:.2f} s",
                          f"{max(a.longest_gap for a in answers):.2f} s")  # fmt: skip

    row("A loaded, nothing loading (before and after)", result.loaded)
    row("A loaded, while B loads", result.during_load)
    row("B loading (its first request)", [result.loading])
    row("B loaded", result.b_loaded)
    row("B loaded again after an unload", [result.reloaded])
    out.print(table)
    bound = result.load_seconds + result.p50(result.b_loaded)
    out.print(f"B's load {result.load_seconds:.2f} s + its loaded first token {result.p50(result.b_loaded):.2f} s = "
              f"{bound:.2f} s; its first token while loading {result.loading.first_token:.2f} s "
              f"({result.loading.first_token / bound:.2f}×)")  # fmt: skip
    out.print("resident memory: " + " · ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in result.resident.items()))


# akunu bench serve -----------------------------------------------------------------------------


def _counts(value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or max(counts) > 64:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of client counts from 1 to 64")
    return counts


def serve(
    model: ServerModel = None,
    clients: Annotated[str, typer.Option(help="Client counts to measure, comma-separated.")] = "1,2,4,8",
    requests: Annotated[int, typer.Option(min=1, help="Requests per client, one after another.")] = 2,
    max_tokens: AnswerTokens = 64,
    categories: Annotated[
        str | None, typer.Option(help="Only prompts of these shipped categories, comma-separated (default: all).")
    ] = None,
) -> None:
    """Concurrent streaming clients against akunu serve, side by side (--parallel) and one at a time (--parallel 1).

    Per client count: aggregate tok/s, per-request tok/s, time to first token (p50, p95) and tokens per pass; exits
    with status 1 if a greedy answer side by side differs from the same request one at a time.
    """
    from akunu.bench import serve_clients, serve_load
    from akunu.bench.workloads import select, shipped_workload

    counts = _counts(clients)
    workload = select(shipped_workload(), categories.split(",") if categories else None)
    log = serve_load.server_log()
    try:
        with stderr_console().status(f"two akunu serve on loopback, then {', '.join(map(str, counts))} clients…"):
            rounds, mismatched = serve_clients.run(model, workload, counts, requests, max_tokens, log)
    finally:
        log.close()
    _print_serve(rounds, model, requests, max_tokens)
    for clients_at, request in mismatched[:5]:
        print_note(f"{clients_at} clients, request {request}: the answer side by side differs from one at a time")
    if mismatched:
        raise typer.Exit(1)


def _print_serve(rounds, model: str | None, requests: int, max_tokens: int) -> None:
    out = table_console()
    out.print(f"[bold]akunu bench serve[/] · {escape(model or 'the default model')} · {requests} requests per client "
              f"of ≤ {max_tokens} tokens · greedy")  # fmt: skip
    table = Table(box=None, header_style="bold")
    for column in ("clients", "requests run", "aggregate tok/s", "per request tok/s", "first token p50",
                   "p95", "tokens/pass"):  # fmt: skip
        table.add_column(column, justify="left" if column == "requests run" else "right")
    for r in rounds:
        per_pass = "–" if r.tokens_per_pass is None else f"{r.tokens_per_pass:.2f}"
        table.add_row(str(r.clients), r.mode, f"{r.aggregate_tps:.1f}", f"{r.request_tps:.1f}",
                      f"{r.first_token(0.5):.2f} s", f"{r.first_token(0.95):.2f} s", per_pass)  # fmt: skip
    out.print(table)


# akunu bench prompt-cache ----------------------------------------------------------------------


PROMPT_CACHE_EXAMPLES = """[bold]Examples[/]
  akunu bench prompt-cache --model qwen2.5-coder-0.5b        10 turns through each API
  akunu bench prompt-cache --turns 4 --max-tokens 16        a shorter run on the default model"""
Turns = Annotated[int, typer.Option(min=1, help="Turns of the shipped agent transcript to replay (at most 11).")]


def prompt_cache(model: ServerModel = None, turns: Turns = 10, max_tokens: AnswerTokens = 32) -> None:
    """What akunu serve's prompt caches save a coding agent: time to first token of a 4,000-token agent prompt cold, from memory and after a restart (from disk); then an agent transcript replayed through /v1/messages and /v1/responses.

    Per turn: prompt tokens, new tokens, tokens prefilled within one server and with a restart before the turn, tokens per pass. akunu serve is started on loopback 4 + 2 × turns times, with an empty prompt cache folder of its own (AKUNU_PROMPT_CACHE); models stay in the user's cache.
    """
    from akunu.bench import prompt_cache_bench as lib
    from akunu.bench import serve_load

    session = lib.shipped_session()
    if turns > session.max_turns:
        raise OptionsError(f"--turns: the shipped transcript has {session.max_turns} turns")
    log = serve_load.server_log()
    try:
        with stderr_console().status("starting akunu serve on loopback…") as status:
            result = lib.run(lib.Servers(model, log), session, turns=turns, max_tokens=max_tokens,
                             progress=status.update)  # fmt: skip
    finally:
        log.close()
    _print_prompt_cache(result, model, max_tokens)


def _print_prompt_cache(result, model: str | None, max_tokens: int) -> None:
    out = table_console()
    firsts = result.first_tokens
    out.print(f"[bold]akunu bench prompt-cache[/] · {escape(model or 'the default model')} · agent prompt "
              f"{firsts.prompt_tokens:,} tokens (system prompt, tools, task) · greedy, streamed")  # fmt: skip
    cold, memory, disk = (a.first_token for a in (firsts.cold, firsts.memory, firsts.disk))
    out.print(f"time to first token: cold {cold:.2f} s · again, from memory {memory:.2f} s · after a restart, "
              f"from disk {disk:.2f} s ({disk / cold:.1%} of cold) · prefilled {firsts.cold.prefilled:,}, "
              f"{firsts.memory.prefilled:,}, {firsts.disk.prefilled:,} tokens")  # fmt: skip
    for path, turns in result.replays.items():
        out.print(f"\n{path} · {len(turns)} turns of ≤ {max_tokens} tokens")
        out.print(_turn_table(turns))
        same = sum(t.in_run.text == t.restarted.text for t in turns)
        out.print(f"answers after a restart equal those in one server: {same}/{len(turns)}")


def _turn_table(turns) -> Table:
    table = Table(box=None, header_style="bold")
    for column in ("turn", "prompt", "new", "prefilled, one server", "prefilled, after a restart", "tokens/pass"):
        table.add_column(column, justify="right")
    previous = 0
    for turn in turns:
        per_pass = turn.in_run.stats.get("tokens_per_pass")
        table.add_row(str(turn.number), f"{turn.prompt_tokens:,}", f"{turn.prompt_tokens - previous:,}",
                      f"{turn.in_run.prefilled:,}", f"{turn.restarted.prefilled:,}",
                      "–" if per_pass is None else f"{per_pass:.2f}")  # fmt: skip
        previous = turn.prompt_tokens
    return table


# akunu bench long-prompt -----------------------------------------------------------------------


LONG_PROMPT_EXAMPLES = """[bold]Examples[/]
  akunu bench long-prompt --model qwen2.5-coder-0.5b        a 7,000-token prompt, then a short request every 5 s
  akunu bench long-prompt --long-tokens 2000 --shorts 4 --every 2"""


def long_prompt(
    model: ServerModel = None,
    long_tokens: Annotated[int, typer.Option(min=64, help="About how many tokens the long prompt has.")] = 7000,
    shorts: Annotated[int, typer.Option(min=2, help="Short requests beside it (and as many alone).")] = 6,
    every: Annotated[float, typer.Option(min=0.1, help="Seconds between the short requests.")] = 5.0,
    parallel: Annotated[int, typer.Option(min=2, help="The server's --parallel.")] = 4,
) -> None:
    """Short requests beside a long prompt on akunu serve --parallel: their time to first token against the same requests alone (before and after, on the same server).

    A short request is admitted at once and prefills in turns with the long prompt, so it is answered long before
    the long prompt's first token; the table says how many were.
    """
    from akunu.bench import long_prompt_load as lib
    from akunu.bench import serve_load

    log = serve_load.server_log()
    try:
        with stderr_console().status(f"akunu serve --parallel {parallel}: a {long_tokens:,}-token prompt, then "
                                     f"{shorts} short requests every {every:g} s…"):  # fmt: skip
            result = lib.run(model, log, long_tokens=long_tokens, shorts=shorts, every=every, parallel=parallel)
    finally:
        log.close()
    out = table_console()
    out.print(f"[bold]akunu bench long-prompt[/] · {escape(model or 'the default model')} · --parallel {parallel} · "
              f"long prompt {result.long_prompt_tokens or '?'} tokens, first token after "
              f"{result.long_first_token:.1f} s")  # fmt: skip
    table = Table(box=None, header_style="bold")
    for column in ("short requests", "first token p50", "max"):
        table.add_column(column, justify="left" if column == "short requests" else "right")
    for label, seconds in (("alone", result.alone), ("beside the long prompt", result.beside)):
        table.add_row(label, f"{result.p50(seconds):.2f} s", f"{max(seconds):.2f} s")
    out.print(table)
    out.print(
        f"{result.during_prefill}/{len(result.beside)} short requests answered before the long prompt's first token"
    )
