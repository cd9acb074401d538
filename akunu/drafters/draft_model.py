"""Draft-model speculative decoding (Leviathan et al.): a smaller model proposes, the target verifies.

The drafter keeps its own KV cache in step with the committed sequence: after each round it
trims the drafted-but-rejected positions and, when asked to draft again, feeds only what it
has not seen yet. All draft tokens of a round are chained lazily and read with one sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from akunu import backends
from akunu.drafters.base import Draft, Drafter
from akunu.errors import OptionsError
from akunu.forward import prefill
from akunu.kv_cache import common_prefix, make_cache, rewind
from akunu.sampling import Draws, SamplingParams, target_logprobs

Forward = Callable[..., mx.array]  # forward(tokens (1, L) uint32, cache=...) -> logits (1, L, V)


class ModelDrafter(Drafter):
    """Drafts by running `forward` autoregressively over its own cache.

    Greedy drafts are the argmax and carry no distribution; sampled drafts are drawn from
    the drafter's processed distribution under the same SamplingParams as the target, and
    that distribution q is returned so verification can use min(1, p/q).
    """

    def __init__(
        self, forward: Forward, cache: list, params: SamplingParams = SamplingParams(), cost_per_token: float = 0.0
    ) -> None:
        self.forward = forward
        self.cache = cache
        self.params = params
        self.draws = Draws.for_drafts(params.seed)  # a seeded request's drafts are its own, beside other requests
        self.cost_per_token = cost_per_token  # one draft step, in 1-token target passes
        self.sequence: list[int] = []  # the committed tokens
        self.fed = 0  # how many of them the cache holds
        self.pending: list[int] = []  # drafted tokens the cache holds past `fed`

    def start(self, context: Sequence[int]) -> None:
        # Keep the cached prefix this context shares with the last one (a chat's earlier turns).
        self._trim_to(self.fed)  # drafts of an interrupted round
        self._trim_to(common_prefix(self.sequence[: self.fed], context[:-1]))
        self.sequence = list(context)

    def update(self, tokens: Sequence[int]) -> None:
        kept = common_prefix(self.pending, tokens[:-1])  # the last token is fed next round, whatever was drafted
        rewind(self.cache, len(self.pending) - kept)  # drop the drafts the target rejected
        self.fed += kept
        self.pending = []
        self.sequence.extend(tokens)

    def draft(self, n: int) -> Draft:
        if n < 1:
            return Draft([])
        unseen = self.sequence[self.fed :]
        logits = prefill(self.forward, self.cache, unseen)
        self.fed += len(unseen)
        tokens, probs = [], []
        for i in range(n):
            token, q = self._pick(logits)
            tokens.append(token)
            probs.append(q)
            if i < n - 1:  # the last draft is fed next round, if it is accepted
                logits = self.forward(token.reshape(1, 1), cache=self.cache)[0, -1]
        if self.params.greedy:
            mx.eval(tokens)
            stacked = None
        else:
            stacked = mx.stack(probs)
            mx.eval(tokens, stacked)
        drafted = [int(t.item()) for t in tokens]
        self.pending = drafted[: n - 1]
        return Draft(drafted, stacked)

    def _pick(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        if self.params.greedy:
            return backends.argmax(logits), None
        logprobs = target_logprobs(logits, self.params)
        return mx.random.categorical(logprobs, key=self.draws.key()).astype(mx.uint32), mx.exp(logprobs)

    def _trim_to(self, length: int) -> None:
        held = self.fed + len(self.pending)
        rewind(self.cache, held - length)
        self.fed, self.pending = min(self.fed, length), []


def vocabulary_of(tokenizer) -> list[str] | None:
    """The token texts, for comparing two tokenizers; None when the tokenizer cannot list them."""
    size = getattr(tokenizer, "vocab_size", None)
    if size is None or not hasattr(tokenizer, "token_text"):
        return None
    return [tokenizer.token_text(i) for i in range(size)]


def check_same_vocabulary(target, draft, draft_name: str) -> None:
    """Refuse a draft model whose logits or token texts differ from the target's.

    `target` and `draft` are loaded models (`.model`, `.tokenizer`); verification compares
    p and q token by token, so the two must index the very same vocabulary.
    """
    target_size, draft_size = target.model.args.vocab_size, draft.model.args.vocab_size
    if target_size != draft_size:
        raise OptionsError(
            f"draft model {draft_name} has a vocabulary of {draft_size} tokens but the target has {target_size}; "
            "a draft model must use the same tokenizer"
        )
    check_same_tokenizer(target.tokenizer, draft.tokenizer, draft_name)


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_name: str) -> None:
    """Refuse a draft model whose token texts differ from the target's (a check that needs no weights)."""
    target_vocab, draft_vocab = vocabulary_of(target_tokenizer), vocabulary_of(draft_tokenizer)
    if target_vocab is None or draft_vocab is None or target_vocab == draft_vocab:
        return
    if len(target_vocab) != len(draft_vocab):
        raise OptionsError(
            f"draft model {draft_name} has a vocabulary of {len(draft_vocab)} tokens but the target has "
            f"{len(target_vocab)}; a draft model must use the same tokenizer"
        )
    first = next(i for i, (a, b) in enumerate(zip(target_vocab, draft_vocab)) if a != b)
    raise OptionsError(
        f"draft model {draft_name} uses a different tokenizer (token {first} differs); "
        "a draft model must use the same tokenizer as the target"
    )


def weight_bytes(module: nn.Module) -> int:
    """Bytes of weights a forward pass reads: what a memory-bound decode step costs."""
    return sum(array.nbytes for _, array in tree_flatten(module.parameters()))


def model_drafter(draft_model, params: SamplingParams = SamplingParams(), target=None) -> ModelDrafter:
    """A drafter over a whole second model (an mlx-lm Model) with a fresh trimmable cache; with the
    `target` model, its draft steps are costed by weight bytes against the target's."""
    cost = weight_bytes(draft_model) / weight_bytes(target) if target is not None else 0.0
    return ModelDrafter(draft_model, make_cache(draft_model), params, cost)
