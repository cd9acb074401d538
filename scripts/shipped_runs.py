"""What the scripts that run shipped prompts through akunu's engine share: their options, and the
model with the cost curves `akunu generate` would draft against (run as `python scripts/X.py`, so
this folder is on the import path)."""

from __future__ import annotations

import argparse

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
from akunu.cli.runtime import cost_curve as stored_cost_curves
from akunu.generate import SpecConfig
from akunu.models import load_model


def options(description: str | None, categories: str) -> argparse.ArgumentParser:
    """--model, --categories (comma-separated), --limit per category and --max-tokens."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--categories", default=categories)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    return parser


def load_with_curves(model: str):
    """The loaded model and the cost curves `akunu generate` reads (measured and stored first if there are none)."""
    loaded = load_model(model)
    return loaded, stored_cost_curves(loaded, SpecConfig().draft_tokens)
