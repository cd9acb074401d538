"""Options shared by `generate` and `chat`, and how they become the engine's GenerationConfig."""

from __future__ import annotations

import math
import os
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from akunu.drafters.specs import DraftLengthPolicy

MODEL_PANEL, SAMPLING_PANEL, SPEC_PANEL = "Model", "Sampling", "Speculative decoding"


def check_model_name(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise typer.BadParameter("is empty: give a catalogue name, a .gguf file, an MLX folder or a repo id")
    return value


Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        envvar="AKUNU_MODEL",
        callback=check_model_name,
        show_default=False,
        rich_help_panel=MODEL_PANEL,
        help="Catalogue name (see 'akunu models'), a .gguf file, an MLX model folder or a Hugging Face repo id."
        " Default: smollm2-135m.",
    ),
]


class WeightsDtype(str, Enum):
    auto = "auto"
    quantized = "quantized"
    float32 = "float32"


Dtype = Annotated[
    WeightsDtype,
    typer.Option(
        rich_help_panel=MODEL_PANEL,
        help="Weights in memory: quantized, float32, or auto (whichever decodes faster on this backend).",
    ),
]


class Sharding(str, Enum):
    auto = "auto"
    tensor = "tensor"
    pipeline = "pipeline"


DISTRIBUTED_PANEL = "Across machines (under mlx.launch)"
Shard = Annotated[
    Sharding,
    typer.Option(
        rich_help_panel=DISTRIBUTED_PANEL,
        help="How the ranks split the model: tensor (each holds part of every layer), pipeline (each runs some "
        "layers), or auto (tensor where the architecture has a tensor split, else pipeline).",
    ),
]
CheckRanks = Annotated[
    bool,
    typer.Option(
        "--check-ranks",
        rich_help_panel=DISTRIBUTED_PANEL,
        help="Debug: check each round that every rank drafted the same tokens; stop with one line if not.",
    ),
]
System = Annotated[
    str | None, typer.Option("--system", "-s", rich_help_panel=MODEL_PANEL, help="System prompt for the chat template.")
]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


Temp = Annotated[
    float,
    typer.Option(
        "--temp", "-t", min=0.0, callback=_finite, rich_help_panel=SAMPLING_PANEL, help="Temperature; 0 is greedy."
    ),
]
TopK = Annotated[
    int, typer.Option(min=0, rich_help_panel=SAMPLING_PANEL, help="Keep the k likeliest tokens; 0 keeps all.")
]
TopP = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=1.0,
        rich_help_panel=SAMPLING_PANEL,
        help="Nucleus sampling: keep the likeliest tokens up to this probability mass; 1 keeps all, 0 the likeliest alone.",
    ),
]
MinP = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=1.0,
        rich_help_panel=SAMPLING_PANEL,
        help="Drop tokens less likely than this fraction of the likeliest; 0 keeps all.",
    ),
]
MAX_SEED = 2**64 - 1  # MLX seeds are unsigned 64-bit
Seed = Annotated[
    int | None,
    typer.Option(min=0, max=MAX_SEED, rich_help_panel=SAMPLING_PANEL, help="Random seed, for repeatable sampling."),
]
Stop = Annotated[
    list[str] | None,
    typer.Option(
        "--stop",
        rich_help_panel=SAMPLING_PANEL,
        help="Stop before this text (repeatable). Escapes \\n and \\t are understood.",
    ),
]
Spec = Annotated[
    bool,
    typer.Option("--spec/--no-spec", rich_help_panel=SPEC_PANEL, help="Speculative decoding with n-gram drafts."),
]
DraftTokens = Annotated[
    int,
    typer.Option(
        min=1,
        max=64,
        rich_help_panel=SPEC_PANEL,
        help="The most tokens drafted per forward pass; the number drafted adapts to how often drafts land.",
    ),
]

Exact = Annotated[
    bool,
    typer.Option(
        "--exact",
        rich_help_panel=SPEC_PANEL,
        help="Exact mode: every forward pass is --draft-tokens + 1 wide and attention runs token by token, so greedy"
        " speculative output equals plain decoding on any backend, bit for bit. Slower; see the README.",
    ),
]


DraftLength = Annotated[
    DraftLengthPolicy,
    typer.Option(
        rich_help_panel=SPEC_PANEL,
        help="How many tokens to draft each pass: adaptive (recent acceptance against measured pass costs),"
        " entropy (EGAG: from the model's confidence) or fixed (always --draft-tokens).",
    ),
]


def check_writable_file(path: Path, option: str) -> None:
    """Fail before the model loads (and before an answer is lost) if `path` cannot be written."""
    from akunu.cli.text_input import check_save_target
    from akunu.errors import OptionsError

    check_save_target(path, option)  # a device, a FIFO or a folder
    folder = path.parent
    if not folder.is_dir():
        raise OptionsError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OptionsError(f"{option} {path}: not writable")


Draft = Annotated[
    str,
    typer.Option(
        rich_help_panel=SPEC_PANEL,
        help="The drafter: ngram (n-gram tables), lookup (continue the longest earlier 4-16 token run), suffix (the"
        " likeliest continuation of the longest earlier match), recycle (the model's own earlier top-k after each"
        " token; recycle:N as trees of N nodes), model:NAME|PATH,"
        " layer-skip:N (the model's first N layers), A+B (A where it has a draft, else B) or hybrid:SPEC (ngram+SPEC).",
    ),
]
DraftModel = Annotated[
    str | None,
    typer.Option(
        rich_help_panel=SPEC_PANEL, help="A draft model with the same tokenizer (same as --draft model:NAME)."
    ),
]
Tree = Annotated[
    int | None,
    typer.Option(
        min=1, max=32, rich_help_panel=SPEC_PANEL, help="Verify n-gram drafts as token trees of up to N nodes."
    ),
]


def unescape(text: str) -> str:
    """`\\n`, `\\t` and `\\\\` typed in a shell argument, as the characters they name."""
    return text.replace("\\\\", "\0").replace("\\n", "\n").replace("\\t", "\t").replace("\0", "\\")


def generation_config(
    *,
    max_tokens: int,
    temp: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed: int | None,
    stop: list[str] | None,
    spec: bool,
    draft_tokens: int,
    draft_length: DraftLengthPolicy = DraftLengthPolicy.adaptive,
    exact: bool = False,
):
    """The engine's GenerationConfig for the parsed options (imports the engine, hence MLX)."""
    from akunu.generate import GenerationConfig, SpecConfig
    from akunu.sampling import SamplingParams

    return GenerationConfig(
        max_tokens=max_tokens,
        sampling=SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed),
        spec=SpecConfig(
            enabled=spec,
            draft_tokens=draft_tokens,
            draft_length=draft_length,
            exact=exact,
        ),
        stop=tuple(unescape(s) for s in stop or ()),
    )
