"""The `--draft` spec strings (parsed by `akunu.drafters.make_drafter`) and the draft-length policies,
in a module light enough for the CLI to show them in its help without loading MLX."""

from enum import Enum

DEFAULT_SPEC = "suffix+ngram"
SPEC_HELP = "ngram, lookup, suffix, recycle, recycle:N, model:NAME|PATH, layer-skip:N, A+B, hybrid:SPEC or tree:N"


def draft_model_names(spec: str) -> list[str]:
    """The draft models a spec names (`model:NAME`, also inside `A+B` and `hybrid:`), parsed as make_drafter does."""
    first, plus, rest = spec.partition("+")
    if plus and first and rest:
        return draft_model_names(first) + draft_model_names(rest)
    kind, _, argument = spec.partition(":")
    if kind == "hybrid" and argument:
        return draft_model_names(argument)
    return [argument] if kind == "model" and argument else []


class DraftLengthPolicy(str, Enum):
    """How many tokens a round drafts (`akunu.draft_length`); one spelling for engine, CLI, bench and server."""

    adaptive = "adaptive"  # recent acceptance weighed against this backend's measured pass costs
    entropy = "entropy"  # EGAG: more drafts where the model's next-token entropy is low
    fixed = "fixed"  # always the most tokens allowed
