"""`akunu generate`: one prompt in, text on stdout, statistics on stderr (or one JSON object)."""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from akunu.cli import display, harmony, options, runtime, text_input
from akunu.cli.console import print_note, print_warning, stderr_console, stdout_console
from akunu.drafters.specs import DEFAULT_SPEC
from akunu.errors import AkunuError, Interrupted, OptionsError, PromptError

EXAMPLES = """[bold]Examples[/]
  akunu generate "Write a Python function that returns the fibonacci numbers up to n."
  echo "Summarize: ..." | akunu generate - > summary.txt
  akunu generate -f prompt.txt --temp 0.7 --top-p 0.9 --seed 1 --max-tokens 400
  akunu generate --raw "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
  akunu generate --json --no-spec "Name three rivers." | jq .decode_tps
  akunu generate --verbose "Repeat this list: apples, pears, plums"   (accepted drafts highlighted)
  akunu generate --json-schema person.json "Invent a person."   (the output is JSON valid for the schema)"""

OUTPUT_PANEL = "Input and output"
CONVERT_HINT = "; convert it to UTF-8 first, e.g. with iconv -f latin1 -t utf-8"


def generate(
    prompt: Annotated[
        str | None, typer.Argument(show_default=False, help="The prompt. '-' or nothing reads it from stdin.")
    ] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option("--prompt-file", "-f", rich_help_panel=OUTPUT_PANEL, help="Read the prompt from this file."),
    ] = None,
    model: options.Model = None,
    dtype: options.Dtype = options.WeightsDtype.auto,
    system: options.System = None,
    raw: Annotated[
        bool,
        typer.Option(
            "--raw",
            rich_help_panel=OUTPUT_PANEL,
            help="Send the prompt verbatim, special tokens included: no chat template.",
        ),
    ] = False,
    parse_special: Annotated[
        bool | None,
        typer.Option(
            "--parse-special/--no-parse-special",
            show_default=False,
            rich_help_panel=OUTPUT_PANEL,
            help="Read special-token text in the prompt (e.g. <|im_start|>) as control tokens. Default: on with --raw;"
            " off otherwise, where the chat template alone writes them.",
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(min=1, rich_help_panel=options.SAMPLING_PANEL, help="The most tokens to generate.")
    ] = 256,
    temp: options.Temp = 0.0,
    top_k: options.TopK = 0,
    top_p: options.TopP = 1.0,
    min_p: options.MinP = 0.0,
    seed: options.Seed = None,
    stop: options.Stop = None,
    spec: options.Spec = True,
    draft_tokens: options.DraftTokens = 32,
    draft_length: options.DraftLength = options.DraftLengthPolicy.adaptive,
    exact: options.Exact = False,
    draft: options.Draft = DEFAULT_SPEC,
    draft_model: options.DraftModel = None,
    ngram_cache: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel=options.SPEC_PANEL,
            help="Keep n-gram counts in this file across runs; drafts fall back on them (off by default).",
        ),
    ] = None,
    tree: options.Tree = None,
    json_schema: Annotated[
        Path | None,
        typer.Option(
            "--json-schema",
            rich_help_panel=OUTPUT_PANEL,
            help="Constrain the output to JSON valid for the JSON schema in this file (drafting stays on).",
        ),
    ] = None,
    json_object: Annotated[
        bool, typer.Option("--json-object", rich_help_panel=OUTPUT_PANEL, help="Constrain the output to a JSON object.")
    ] = False,
    json_output: Annotated[
        bool,
        typer.Option("--json", rich_help_panel=OUTPUT_PANEL, help="Print one JSON object: text, token ids and stats."),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            rich_help_panel=OUTPUT_PANEL,
            help="Highlight accepted draft tokens; print every statistic.",
        ),
    ] = False,
    shard: options.Shard = options.Sharding.auto,
    check_ranks: options.CheckRanks = False,
) -> None:
    """Generate text for one prompt, with the model's chat template unless --raw.

    The text goes to stdout and the statistics to stderr, so `> out.txt` captures only the text.
    """
    if json_output and verbose:
        raise OptionsError("--json and --verbose cannot be combined: --json already carries every statistic")
    if raw and system:
        raise OptionsError("--system needs the chat template, which --raw turns off")
    text, source = read_prompt(prompt, prompt_file)
    if system is not None:
        text_input.check_text(system, "--system")
    if ngram_cache is not None:
        options.check_writable_file(ngram_cache, "--ngram-cache")
    schema = read_schema(json_schema, json_object)
    config = options.generation_config(
        max_tokens=max_tokens, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, stop=stop, spec=spec,
        draft_tokens=draft_tokens, draft_length=draft_length, exact=exact,
    )  # fmt: skip
    with _interrupt_as_error(json_output):
        loaded = runtime.load(model, dtype, draft_models_of(draft, draft_model), shard, check_ranks)
        config.sampling.validate(loaded.tokenizer.vocab_size)
        check_fits(loaded, **{source: text, "--system": system})
        prompt_ids = runtime.encode_prompt(loaded.tokenizer, text, system=system, raw=raw, parse_special=parse_special)
        prompt_ids = runtime.agreed(prompt_ids)  # rank 0's stdin, under mlx.launch
        drafter = make_drafter_for(loaded, config, draft, draft_model, ngram_cache, tree)
        constraint = make_constraint(loaded, schema)
    if verbose:
        describe_run(loaded, config)
    try:
        answer_only = not raw and harmony.writes_harmony(getattr(loaded.tokenizer, "chat_template", None))
        run(loaded, prompt_ids, config, json_output=json_output, verbose=verbose, drafter=drafter,
            constraint=constraint, answer_only=answer_only)  # fmt: skip
    finally:
        if drafter is not None:  # the persistent n-gram cache learns from this run
            _save_ngram_cache(drafter, ngram_cache)


@contextlib.contextmanager
def _interrupt_as_error(json_output: bool):
    """With --json, Ctrl-C before any output is an error object, so a script reading stdout never gets nothing."""
    try:
        yield
    except KeyboardInterrupt:
        if not json_output:
            raise
        raise Interrupted("interrupted") from None


def _save_ngram_cache(drafter, path: Path) -> None:
    """The answer is out already: a failed save is a note, not an error."""
    try:
        drafter.save()
    except OSError as error:
        print_note(f"cannot save the n-gram cache to {path}: {error.strerror or error}")
    except AkunuError as error:  # a device or a FIFO, never replaced by a file
        print_note(str(error))


def draft_models_of(draft: str, draft_model: str | None) -> list[str]:
    """The draft models --draft-model or a --draft spec name, checked against the target before anything loads."""
    from akunu.drafters.specs import draft_model_names

    return [draft_model] if draft_model is not None else draft_model_names(draft)


def make_drafter_for(
    loaded, config, draft: str, draft_model: str | None, ngram_cache: Path | None, tree: int | None, load=None
):
    """The drafter the options ask for; None keeps the engine's default (suffix+ngram). `load` loads a draft model."""
    from akunu.drafters import make_drafter
    from akunu.models import load_model

    if draft_model is not None:
        if draft != DEFAULT_SPEC:
            raise OptionsError("give either --draft-model or --draft, not both")
        draft = f"model:{draft_model}"
    if draft == DEFAULT_SPEC and ngram_cache is None and tree is None:
        return None
    if not config.spec.enabled:
        raise OptionsError("--draft, --draft-model, --ngram-cache and --tree need speculative decoding; drop --no-spec")
    spec = config.spec
    with warnings.catch_warnings(record=True) as caught:  # e.g. an unreadable n-gram cache: the run goes on
        warnings.simplefilter("always")
        drafter = make_drafter(
            draft, loaded, params=config.sampling, ngram_order=spec.ngram_order, window=spec.window,
            ngram_cache=ngram_cache, tree=tree, load=load or load_model,
        )  # fmt: skip
    for warning in caught:
        print_warning(str(warning.message))
    return drafter


def read_schema(path: Path | None, json_object: bool) -> dict | None:
    """The JSON schema --json-schema or --json-object asks for (read before the model loads), or None."""
    from akunu.grammar import parse_schema_file

    if path is not None and json_object:
        raise OptionsError("give either --json-schema or --json-object, not both")
    if json_object:
        return {"type": "object"}
    if path is None:
        return None
    try:
        text = text_input.read_text_file(path, text_input.READ_LIMIT, "the JSON schema file", CONVERT_HINT)
    except AkunuError as error:  # a missing or unreadable schema is bad input, as an invalid one is: exit 2
        raise OptionsError(str(error)) from None
    return parse_schema_file(text, f"the JSON schema file {path}")


def make_constraint(loaded, schema: dict | None):
    """The grammar the output must follow, for the loaded model's vocabulary."""
    if schema is None:
        return None
    from akunu.grammar import Constraint

    return Constraint.json_schema(schema, loaded.tokenizer)


def read_prompt(prompt: str | None, prompt_file: Path | None) -> tuple[str, str]:
    """The prompt text from the argument, a file or stdin, and where it came from; a PromptError if there is none.

    Read before the model loads, up to what the longest context takes; `check_fits` holds it to the model's bound.
    """
    if prompt_file is not None and prompt is not None:
        raise OptionsError("give the prompt as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        source = f"the prompt file {prompt_file}"
        text = text_input.read_text_file(prompt_file, text_input.READ_LIMIT, "the prompt file", CONVERT_HINT)
    elif prompt is None or prompt == "-":
        if runtime.stdin_is_terminal() and prompt is None:
            raise OptionsError("no prompt: give it as an argument, with --prompt-file, or on stdin ('-')")
        source = "the prompt on stdin"
        text = text_input.read_stdin(text_input.READ_LIMIT, source, CONVERT_HINT)
    else:
        source = "the prompt"
        text = text_input.check_text(prompt, source, CONVERT_HINT)
    if not text.strip():
        raise PromptError("the prompt is empty")
    return text, source


def check_fits(loaded, **texts: str | None) -> None:
    """Each text (keyword: where it came from) within the bytes the loaded model's context can take."""
    limit = text_input.text_limit(loaded.context_length)
    for source, text in texts.items():
        if text is not None:
            text_input.check_length(text, limit, source)


def run(
    loaded,
    prompt_ids: list[int],
    config,
    *,
    json_output: bool,
    verbose: bool,
    drafter=None,
    constraint=None,
    answer_only: bool = False,
) -> None:
    """Stream one generation to stdout; Ctrl-C keeps what was generated and exits 130.
    `answer_only`: the model writes harmony, whose markup and reasoning the user does not see."""
    from akunu import distributed

    out = stdout_console()
    pieces, tokens, stats, finish, decode_traffic = [], [], None, None, None
    try:
        costs = runtime.costs_for(loaded, config)
        responses = runtime.stream(loaded, prompt_ids, config, costs=costs, drafter=drafter, constraint=constraint)
        responses = runtime.interruptible(responses)  # under mlx.launch, Ctrl-C stops every rank at one pass
        for response in harmony.final_channel(responses) if answer_only else responses:
            pieces.append(response.text)
            if response.token is not None:
                tokens.append(response.token)
                decode_traffic = decode_traffic or distributed.traffic.snapshot()  # from the first token on
            stats, finish = response.stats, response.finish_reason or finish
            if json_output or not response.text:
                continue
            if verbose:
                out.print(Text(response.text, style=display.DRAFT_STYLE if response.from_draft else ""), end="")
            else:
                sys.stdout.write(response.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        finish = "interrupted"
    text = "".join(pieces)
    if json_output:
        if stats is None and finish == "interrupted":
            raise Interrupted("interrupted")
        if stats is not None:
            result = display.result_json(loaded.name, text, tokens, stats, finish, config)
            if distributed.group() is not None:
                result["split"] = display.split_json(loaded.sharded, stats, decode_traffic)
            typer.echo(json.dumps(result, ensure_ascii=False))
    else:
        if not text.endswith("\n"):
            sys.stdout.write("\n")
        report(stats, finish, verbose)
    if finish == "interrupted":
        raise typer.Exit(130)


def report(stats, finish: str | None, verbose: bool) -> None:
    if stats is None:
        return
    err = stderr_console()
    if verbose:
        err.print(display.stats_table(stats, "statistics", finish))
    else:
        err.print(f"[dim]{display.summary_line(stats, finish)}[/]")


def describe_run(loaded, config) -> None:
    """The --verbose header: model, weights, backend, speculation settings."""
    from akunu import backends

    err = stderr_console()
    backend = backends.describe()
    kernels = f" · CPU kernels: {backend['cpu_kernels']}" if backend.get("cpu_kernels") else ""
    kernels += f" · quantized products: {backend['quantized_kernel']}" if backend.get("quantized_kernel") else ""
    err.print(f"[dim]{loaded.describe()} · {getattr(loaded, 'dtype_reason', '')} · BLAS: {backend['blas']}{kernels}[/]")
    spec = config.spec
    mode = f"on, up to {spec.draft_tokens} drafts, {spec.draft_length.value}" if spec.enabled else "off"
    if spec.exact:
        from akunu.exact import exact_width

        mode += f"; exact mode (every pass {exact_width(spec.draft_tokens)} tokens wide)"
    err.print(f"[dim]speculative decoding {mode}; accepted draft tokens are[/] [{display.DRAFT_STYLE}]highlighted[/]")
