"""`make_drafter`: the drafter a `--draft` spec names (the grammar is in `akunu.drafters`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from akunu.drafters.base import Drafter, NGramDrafter
from akunu.drafters.draft_model import ModelDrafter, check_same_vocabulary, model_drafter
from akunu.drafters.hybrid import HybridDrafter
from akunu.drafters.layer_skip import layer_skip_drafter
from akunu.drafters.lookup import LookupDrafter
from akunu.drafters.specs import DEFAULT_SPEC, SPEC_HELP
from akunu.drafters.suffix import SuffixDrafter
from akunu.errors import OptionsError
from akunu.sampling import SamplingParams


def make_drafter(
    spec: str,
    target=None,
    *,
    params: SamplingParams = SamplingParams(),
    ngram_order: int = 4,
    window: int = 512,
    ngram_cache: Path | None = None,
    tree: int | None = None,
    load: Callable | None = None,
) -> Drafter:
    """The drafter a spec names. `target` is the loaded target model (`.model`, `.tokenizer`);
    `tree` (nodes per tree) verifies n-gram drafts as token trees; `load(name)` loads a draft
    model (`akunu.models.load_model`, given by the caller: the engine does not load models)."""
    if tree is not None:
        if spec not in (DEFAULT_SPEC, "ngram") or ngram_cache is not None:
            raise OptionsError("--tree works with the plain n-gram drafter only (no --draft, no --ngram-cache)")
        if tree < 1:
            raise OptionsError(f"--tree needs at least 1 node (got {tree})")
        from akunu.drafters.tree import NGramTreeDrafter

        return NGramTreeDrafter(max_order=ngram_order, window=window, max_nodes=tree)
    same = dict(params=params, ngram_order=ngram_order, window=window, ngram_cache=ngram_cache, load=load)
    first, plus, rest = spec.partition("+")
    if plus and first and rest:
        return HybridDrafter(make_drafter(first, target, **same), make_drafter(rest, target, **same))
    kind, _, argument = spec.partition(":")
    if kind == "tree":  # `tree:N`, the bench's name for `ngram` with --tree N
        try:
            nodes = int(argument)
        except ValueError:
            raise OptionsError(f"tree:N needs a node count N, got {argument!r}") from None
        return make_drafter("ngram", target, ngram_order=ngram_order, window=window, tree=nodes)
    if kind == "ngram" and not argument:
        return _ngram(ngram_order, window, ngram_cache)
    if kind == "lookup" and not argument:
        return LookupDrafter()
    if kind == "suffix" and not argument:
        return SuffixDrafter()
    if kind == "recycle":
        return _recycle(argument)
    if kind == "hybrid" and argument:
        return make_drafter(f"ngram+{argument}", target, **same)
    if target is None:
        raise OptionsError(f"--draft {spec} needs the target model")
    if kind == "layer-skip":
        try:
            layers = int(argument)
        except ValueError:
            raise OptionsError(f"--draft layer-skip:N needs a layer count N, got {argument!r}") from None
        return layer_skip_drafter(target.model, layers, params)
    if kind == "model" and argument:
        return _draft_model(argument, target, params, load)
    raise OptionsError(f"unknown drafter {spec!r}; expected {SPEC_HELP}")


def _recycle(argument: str) -> Drafter:
    from akunu.drafters.recycle import TEMPLATE, RecycleDrafter

    if not argument:
        return RecycleDrafter()
    if not argument.isdigit() or not 1 <= int(argument) <= len(TEMPLATE):
        raise OptionsError(f"recycle:N needs a tree of N = 1..{len(TEMPLATE)} nodes, got {argument!r}")
    return RecycleDrafter(tree_nodes=int(argument))


def _ngram(order: int, window: int, cache_file: Path | None) -> Drafter:
    if cache_file is None:
        return NGramDrafter(max_order=order, window=window)
    from akunu.drafters.ngram_cache import CachedNGramDrafter

    return CachedNGramDrafter(cache_file, max_order=order, window=window)


def _draft_model(name: str, target, params: SamplingParams, load: Callable | None) -> ModelDrafter:
    if load is None:
        raise ValueError("make_drafter needs `load` to build a draft model")
    draft = load(name)
    check_same_vocabulary(target, draft, name)
    return model_drafter(draft.model, params, target=target.model)
