"""Several generations' decode passes run as one forward pass (akunu.shared_pass), as `akunu serve --parallel`
runs them: each request's greedy output is its output alone (up to near-ties), sampling keeps each request's
distribution, and passes that cannot share run alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import mlx.core as mx
import pytest

from akunu import shared_pass
from akunu.decode import Pass
from akunu.drafters.draft_model import model_drafter
from akunu.drafters.specs import DraftLengthPolicy
from akunu.forward import PrefillChunk
from akunu.generate import GenerationConfig, SpecConfig, generate, stream_generate
from akunu.sampling import SamplingParams
from tests.fakes import FakeTokenizer
from tests.greedy_checks import assert_same_or_near_tie
from tests.stats_tools import PROMPT, exact_model_probs, fits
from tests.tiny import tiny_gemma3, tiny_llama
from tests.tiny_archs import tiny_model

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]


def side_by_side(model, prompts, configs, stats: list | None = None, drafters=None) -> list[list[int]]:
    """Each prompt's generation, all driven as the server drives them: each runs to its next pass, then the
    passes run together. `stats` gets each generation's final statistics."""
    drafters = drafters or [None] * len(prompts)
    streams = {i: stream_generate(model, FakeTokenizer(), p, c, share_passes=True, drafter=d)
               for i, (p, c, d) in enumerate(zip(prompts, configs, drafters))}  # fmt: skip
    tokens: list[list[int]] = [[] for _ in prompts]
    while streams:
        passes = []
        for i, stream in list(streams.items()):
            for item in stream:
                if isinstance(item, Pass):
                    passes.append(item)
                    break
                if not isinstance(item, PrefillChunk) and item.token is not None:
                    tokens[i].append(item.token)
            else:
                del streams[i]
                if stats is not None:
                    stats.append((i, item.stats))
        shared_pass.run_passes(passes)
    return tokens


@pytest.fixture
def shared_widths(monkeypatch) -> list[int]:
    """How many requests each shared forward pass carried."""
    widths: list[int] = []
    real = shared_pass.forward_together

    def counted(passes):
        widths.append(len(passes))
        return real(passes)

    monkeypatch.setattr(shared_pass, "forward_together", counted)
    return widths


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "gemma3", "phi3", "olmo2"])
@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
def test_greedy_side_by_side_is_each_request_alone(architecture, spec, shared_widths):
    model = tiny_gemma3(window=8) if architecture == "gemma3" else tiny_model(architecture, seed=5)  # 8: crossed
    config = GenerationConfig(max_tokens=20, spec=SpecConfig(enabled=spec))
    configs = [config, GenerationConfig(max_tokens=12, spec=SpecConfig(enabled=spec)), config]
    together = side_by_side(model, PROMPTS, configs)
    assert shared_widths and max(shared_widths) == 3  # the passes were shared
    for prompt, c, found in zip(PROMPTS, configs, together):
        alone = generate(model, FakeTokenizer(), prompt, c)[1]
        assert_same_or_near_tie(model, prompt, alone, found, f"{architecture}, {prompt[:3]}")


def test_sampling_side_by_side_keeps_each_requests_distribution(shared_widths):
    """Two requests on different prompts share every pass; a row given to the wrong request would show."""
    model, params = tiny_llama(vocab=16, seed=2), SamplingParams(temp=1.0)
    other = PROMPT[3:]
    config = GenerationConfig(max_tokens=3, sampling=params)
    runs, counts = 500, (Counter(), Counter())  # a row given to the other prompt fails by far
    mx.random.seed(11)
    for _ in range(runs):
        first, second = side_by_side(model, [PROMPT, other], [config, config])
        counts[0][tuple(first)] += 1
        counts[1][tuple(second)] += 1
    assert max(shared_widths) == 2
    for prompt, counted in zip((PROMPT, other), counts):
        ok, stat, critical = fits(counted, exact_model_probs(model, params, prompt=prompt), runs)
        assert ok, f"chi2 {stat:.1f} >= {critical:.1f}"


@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
def test_a_seeded_request_samples_as_alone_beside_other_sampled_requests(spec):
    """A seed's draws are the request's own (akunu.sampling.Draws): the other request's draws, made between
    them, do not move them."""
    model = tiny_llama(vocab=16, seed=2)
    seeded, unseeded = (GenerationConfig(max_tokens=16, sampling=SamplingParams(temp=1.0, seed=seed),
                                         spec=SpecConfig(enabled=spec)) for seed in (7, None))  # fmt: skip
    alone = generate(model, FakeTokenizer(), PROMPTS[1], seeded)[1]
    assert side_by_side(model, [PROMPTS[1], PROMPTS[0]], [seeded, unseeded])[0] == alone
    assert (
        generate(model, FakeTokenizer(), PROMPTS[1], replace(seeded, sampling=SamplingParams(temp=1.0, seed=8)))[1]
        != alone
    )


def test_a_seeded_request_with_a_draft_model_samples_as_alone_beside_another(shared_widths):
    """The draft model's own draws come from the request's seed too (apart from its verification's)."""
    model, drafting = tiny_llama(vocab=16, seed=2), tiny_llama(vocab=16, seed=3)
    seeded, unseeded = (
        GenerationConfig(
            max_tokens=16,
            sampling=SamplingParams(temp=1.0, seed=seed),
            spec=SpecConfig(draft_tokens=3, draft_length=DraftLengthPolicy.fixed),
        )
        for seed in (7, None)
    )  # fmt: skip (fixed: the other request's width would lengthen drafts)
    drafters = [model_drafter(drafting, config.sampling) for config in (seeded, unseeded)]
    alone = generate(model, FakeTokenizer(), PROMPTS[1], seeded, drafter=model_drafter(drafting, seeded.sampling))[1]
    assert side_by_side(model, [PROMPTS[1], PROMPTS[0]], [seeded, unseeded], drafters=drafters)[0] == alone
    assert max(shared_widths) == 2


def test_a_request_drafts_into_the_width_a_shared_pass_computes_anyway(shared_widths):
    """A request whose policy drafts 1 token beside one drafting 6: the shared pass computes 7 positions for
    every row, so the first request's drafts grow to fill them; the other's policy alone decides its width."""
    model = tiny_llama(vocab=16, seed=2)
    narrow, wide = (
        GenerationConfig(max_tokens=40, spec=SpecConfig(draft_tokens=n, draft_length="fixed")) for n in (1, 6)
    )
    finals: list = []
    together = side_by_side(model, [PROMPTS[1], PROMPTS[1][1:]], [narrow, wide], finals)
    drafted = {i: stats.drafted for i, stats in finals}
    assert max(shared_widths) == 2
    for i, (prompt, config) in enumerate([(PROMPTS[1], narrow), (PROMPTS[1][1:], wide)]):
        _, alone, stats = generate(model, FakeTokenizer(), prompt, config)
        assert_same_or_near_tie(model, prompt, alone, together[i], f"request {i}")
        alone_drafted = stats.drafted
        assert drafted[i] > alone_drafted if i == 0 else drafted[i] == alone_drafted, (i, drafted[i], alone_drafted)


def test_exact_mode_and_state_layers_run_alone(shared_widths):
    exact = GenerationConfig(max_tokens=8, spec=SpecConfig(exact=True, draft_tokens=4))
    side_by_side(tiny_llama(vocab=64, seed=4), PROMPTS[:2], [exact, exact])  # bits must not depend on the pass
    hybrid = GenerationConfig(max_tokens=8)
    side_by_side(tiny_model("qwen3_next", seed=3), PROMPTS[:2], [hybrid, hybrid])  # rollback restores states
    assert shared_widths == []
