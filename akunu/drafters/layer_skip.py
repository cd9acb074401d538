"""Self-speculative drafting: the first N layers of the target, then its final norm and head.

No second model and no copied weights: the drafter calls the target's own modules. mlx-lm's
llama and Gemma-3 forwards run `zip(layers, cache)`, so handing them a cache of N layers runs
exactly the first N layers and then the final norm and head.

The drafter keeps its own N-layer cache. The target's cache for layers < N holds the same
K/V for committed positions, but sharing it would need the target's cache inside the
drafter and a second rollback of the same arrays; a separate N-layer cache keeps each
rollback local, at the cost of running the prompt through N layers once more.
"""

from __future__ import annotations

import mlx.nn as nn

from akunu.drafters.draft_model import ModelDrafter, weight_bytes
from akunu.drafters.tree import SUPPORTED, model_kind
from akunu.errors import OptionsError
from akunu.kv_cache import make_cache
from akunu.sampling import SamplingParams


class _FirstLayersCache(list):
    """The caches of the first N layers. Indexing past them gives None, so a forward that
    looks up a later layer's cache only to build a mask it will not use still works."""

    def __getitem__(self, index):
        if isinstance(index, int) and index >= len(self):
            return None
        return super().__getitem__(index)


def layer_skip_drafter(model: nn.Module, layers: int, params: SamplingParams = SamplingParams()) -> ModelDrafter:
    total = len(model.layers)
    kind = model_kind(model)
    if kind not in SUPPORTED:
        raise OptionsError(f"layer-skip drafting supports {', '.join(SUPPORTED)} models, not {kind}")
    if not 1 <= layers < total:
        raise OptionsError(f"layer-skip:N needs 1 <= N < {total} (the model's layer count), got {layers}")
    cache = _FirstLayersCache(make_cache(model)[:layers])
    per_layer = [weight_bytes(layer) for layer in model.layers]
    shared = weight_bytes(model) - sum(per_layer)  # embedding, final norm and head: every step reads them
    cost = (sum(per_layer[:layers]) + shared) / (sum(per_layer) + shared)
    return ModelDrafter(model, cache, params, cost)  # the short cache is what makes it exit early
