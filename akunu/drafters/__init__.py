"""Every drafter, and `make_drafter` to build one from a spec.

`base`: the Drafter protocol, drafts and token trees, and the plain n-gram drafter (over `ngram`'s
predictor); `ngram_cache`: its tables kept on disk; `tree`: n-gram token trees and their verification;
`lookup`, `suffix`, `recycle`, `draft_model`, `layer_skip`, `hybrid`: the other draft sources; `specs`: the spec
strings, light enough for the CLI's help.

Specs (the CLI's `--draft`): `ngram` (the FNV n-gram tables), `lookup` (prompt lookup: the
continuation of the longest recurring run of 4-16 tokens), `suffix` (a suffix automaton: the
likeliest continuation of the longest earlier match, of any length), `recycle` (Token Recycling: the target's
own earlier top-k after each token, as a chain; `recycle:N` as trees of up to N nodes), `model:NAME|PATH` (a draft model with
the same tokenizer), `layer-skip:N` (the target's first N layers), `A+B` (A where it has a
draft, otherwise B), `hybrid:SPEC` (short for `ngram+SPEC`, e.g. `hybrid:layer-skip:8`) and
`tree:N` (n-gram drafts verified as token trees of up to N nodes, the CLI's `--tree N`).
The default is `suffix+ngram`.
"""

from akunu.drafters.specs import DEFAULT_SPEC, SPEC_HELP

__all__ = ["DEFAULT_SPEC", "SPEC_HELP", "make_drafter"]


def __getattr__(name: str):
    if name == "make_drafter":  # loaded on first use: the drafters need MLX, and the CLI's help only the specs
        from akunu.drafters.make import make_drafter

        return make_drafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
