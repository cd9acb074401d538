"""The real engine for the runner: akunu's decoding (plain, adaptive and fixed speculation), mlx-lm's and llama.cpp's.

Every method is timed by the same code, from the tokens as they stream out: prefill ends at the
first token, decode tok/s counts the tokens after it over the time after it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from akunu.bench.runner import DRAFTER_PREFIX, LLAMA_CPP, MLX_LM, PLAIN, PLAIN_EXACT, SPEC, SPEC_EXACT, SPEC_FIXED, Run
from akunu.bench.workloads import Prompt
from akunu.drafters.specs import DraftLengthPolicy


def timed_tokens(start: float, tokens: Iterable[int]) -> tuple[list[int], float, float]:
    """Drain `tokens`; return them with the prefill and decode seconds seen from outside."""
    out: list[int] = []
    first = last = start
    for token in tokens:
        last = time.perf_counter()
        if not out:
            first = last
        out.append(token)
    return out, first - start, last - first


class ModelEngine:
    """Runs each benchmark method on one loaded model and tokenizer."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_tokens: int = 128,
        temp: float = 0.0,
        draft_tokens: int = 32,
        draft_length: DraftLengthPolicy = DraftLengthPolicy.adaptive,
        costs=None,  # akunu.cost_curve.CostCurves, or one relative curve
        context_length: int | None = None,
        seed: int | None = None,
        llama_cpp=None,  # an akunu.bench.llama_cpp.LlamaCppEngine for the LLAMA_CPP method
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_tokens, self.temp, self.draft_tokens = max_tokens, temp, draft_tokens
        self.draft_length = draft_length  # the policy of the speculative runs other than the fixed one
        self.costs, self.context_length = costs, context_length
        self.seed = seed if seed is not None else 0
        self.llama_cpp = llama_cpp
        self._mlx_tokenizer = None
        self._drafters: dict = {}

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt as the model sees it in a chat: the user message inside the chat template."""
        if not getattr(self.tokenizer, "has_chat_template", False):
            return self.tokenizer.encode(prompt.text)
        return self.tokenizer.encode_chat([{"role": "user", "content": prompt.text}])

    def run(self, method: str, prompt_ids: list[int]) -> Run:
        if method == MLX_LM:
            return self._run_mlx_lm(prompt_ids)
        if method == LLAMA_CPP and self.llama_cpp is not None:
            return self.llama_cpp.run(prompt_ids)
        if method.startswith(DRAFTER_PREFIX):
            return self._run_akunu(prompt_ids, self.draft_length, self._drafter(method[len(DRAFTER_PREFIX) :]))
        fixed = DraftLengthPolicy.fixed
        policy_by_method = {
            PLAIN: None,
            SPEC: self.draft_length,
            SPEC_FIXED: fixed,
            PLAIN_EXACT: None,
            SPEC_EXACT: self.draft_length,
        }
        if method not in policy_by_method:  # None: no speculation
            raise ValueError(f"unknown benchmark method {method!r}")
        return self._run_akunu(prompt_ids, policy_by_method[method], exact=method in (PLAIN_EXACT, SPEC_EXACT))

    def top2_gap(self, reference: str, prompt_ids: list[int], tokens: list[int], index: int) -> float:
        """The top-two logit gap `reference` (plain or exact plain decoding) saw when choosing tokens[index]."""
        from akunu.exact import exact_model, top2_gap

        model = exact_model(self.model, self.draft_tokens) if reference == PLAIN_EXACT else self.model
        return top2_gap(model, prompt_ids, tokens, index)

    def _drafter(self, spec: str):
        """One drafter per spec for the whole benchmark (a draft model loads once; `start` resets it)."""
        from akunu.drafters import make_drafter
        from akunu.models import load_model
        from akunu.sampling import SamplingParams

        if spec not in self._drafters:
            self._drafters[spec] = make_drafter(spec, self, params=SamplingParams(temp=self.temp), load=load_model)
        return self._drafters[spec]

    def _run_akunu(
        self, prompt_ids: list[int], policy: DraftLengthPolicy | None, drafter=None, exact: bool = False
    ) -> Run:
        from akunu.distributed import traffic
        from akunu.generate import GenerationConfig, SpecConfig, stream_generate
        from akunu.sampling import SamplingParams

        speculation = SpecConfig(
            enabled=policy is not None,
            draft_tokens=self.draft_tokens,
            draft_length=policy or self.draft_length,
            exact=exact,
        )
        sampling = SamplingParams(temp=self.temp, seed=self.seed)
        config = GenerationConfig(max_tokens=self.max_tokens, sampling=sampling, spec=speculation)
        start = time.perf_counter()
        responses = stream_generate(
            self.model,
            self.tokenizer,
            prompt_ids,
            config,
            context_length=self.context_length,
            costs=self.costs,
            drafter=drafter,
        )
        final: dict = {}

        def tokens() -> Iterator[int]:
            for response in responses:
                final["stats"] = response.stats  # each response's own snapshot; the last one has every count
                if response.token is not None:
                    final.setdefault("traffic", traffic.snapshot())  # from the first token on: decoding's
                    yield response.token

        ids, prefill_seconds, decode_seconds = timed_tokens(start, tokens())
        s = final["stats"]
        (collectives, sent), (before, sent_before) = traffic.snapshot(), final.get("traffic", traffic.snapshot())
        return Run(
            ids, len(prompt_ids), prefill_seconds, decode_seconds,
            forward_passes=s.forward_passes, drafted=s.drafted, accepted=s.accepted,
            accepted_lengths={int(k): v for k, v in s.accepted_lengths.items()}, drafting_seconds=s.drafting_seconds,
            collectives=collectives - before, bytes_sent=sent - sent_before,
        )  # fmt: skip

    def _run_mlx_lm(self, prompt_ids: list[int]) -> Run:
        import mlx.core as mx
        from mlx_lm.generate import stream_generate
        from mlx_lm.sample_utils import make_sampler

        from akunu import backends

        if self._mlx_tokenizer is None:
            self._mlx_tokenizer = self.tokenizer.to_mlx_lm()
        mx.random.seed(self.seed)
        start = time.perf_counter()
        # On akunu's stream, not a stream of mlx-lm's own: a second compute thread would take turns with
        # the first at akunu's kernels' thread pool. A lone mlx-lm process has one compute thread too.
        responses = stream_generate(
            self.model, self._mlx_tokenizer, prompt_ids, max_tokens=self.max_tokens, sampler=make_sampler(temp=self.temp),
            stream=mx.default_stream(mx.default_device()),
        )  # fmt: skip

        def tokens() -> Iterator[int]:
            # mlx-lm repeats the last token on its final response: the limit token (kept) or EOS (dropped).
            for response in responses:
                if response.finish_reason is None or response.finish_reason == "length":
                    yield int(response.token)

        with backends.unpatched(self.model):  # mlx-lm as shipped, not with akunu's faster step
            ids, prefill_seconds, decode_seconds = timed_tokens(start, tokens())
        return Run(ids, len(prompt_ids), prefill_seconds, decode_seconds)
