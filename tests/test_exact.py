"""Exact mode: every position's logits are bit-identical whatever pass computed them, on any BLAS.

The models are wide enough (hidden 128) that OpenBLAS on an AVX-512 CPU rounds a 5-row product
differently from a 1-row one, so the default mode would differ here; exact mode must not.
"""

import os
import random
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from akunu.backends.cpu import fast_step
from akunu.exact import FixedWidthModel
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.kv_cache import cache_length, make_cache
from tests.fakes import FakeTokenizer
from tests.tiny import tiny_gemma3, tiny_llama


def _with_fast_step(model):
    """The model as load_model leaves it: on the CPU, fused layers whose attention kernel takes whole passes."""
    fast_step.enable(model)
    return model


MODELS = {
    "llama": lambda: tiny_llama(seed=2, hidden=128, sharpness=2.0),
    "llama-fast-step": lambda: _with_fast_step(tiny_llama(seed=2, hidden=128, sharpness=2.0)),
    "gemma3-sliding": lambda: tiny_gemma3(seed=2, hidden=128, window=8),
}
BLAS_CHECKS = [  # the logit identities that depend on the kernels; token identity follows from them
    "tests/test_exact.py::test_exact_mode_gives_a_position_the_same_logits_in_every_pass_width",
    "tests/test_speculative_greedy.py::test_a_wide_pass_computes_the_logits_of_one_token_steps",
]


def logits_in_passes(model, prompt, tokens, width):
    """Logits after each of `tokens`, fed `width` at a time after `prompt`."""
    cache = make_cache(model)
    model(mx.array([prompt]), cache=cache)
    rows = [model(mx.array([tokens[i : i + width]]), cache=cache)[0] for i in range(0, len(tokens), width)]
    assert cache_length(cache) == len(prompt) + len(tokens)  # the padding was rolled back
    return mx.concatenate(rows)


@pytest.mark.parametrize("name", MODELS)
def test_exact_mode_gives_a_position_the_same_logits_in_every_pass_width(name):
    model = FixedWidthModel(MODELS[name](), width=6)
    rng = random.Random(1)
    prompt, tokens = [rng.randrange(64) for _ in range(3)], [rng.randrange(64) for _ in range(30)]
    steps = logits_in_passes(model, prompt, tokens, 1)
    for width in range(2, 7):
        assert mx.array_equal(logits_in_passes(model, prompt, tokens, width), steps).item(), f"width {width}"


def test_exact_mode_leaves_the_default_mode_untouched():
    model = MODELS["gemma3-sliding"]()
    tokens = mx.array([list(range(20))])
    before = model(tokens, cache=make_cache(model))
    FixedWidthModel(model, width=5)(tokens[:, :3], cache=make_cache(model))
    assert mx.array_equal(model(tokens, cache=make_cache(model)), before).item()


@pytest.mark.parametrize("name", MODELS)
def test_exact_speculative_equals_exact_plain_over_many_prompts(name):
    model, rng, tokenizer = MODELS[name](), random.Random(0), FakeTokenizer()
    drafted = 0
    for i in range(12):
        motif = [rng.randrange(64) for _ in range(rng.randint(3, 10))]
        prompt = (
            (motif * 4)[: rng.randint(8, 40)] if i % 2 == 0 else [rng.randrange(64) for _ in range(rng.randint(1, 30))]
        )
        for draft_tokens, policy in ((4, "adaptive"), (7, "fixed")):
            plain_config = GenerationConfig(
                max_tokens=24, spec=SpecConfig(enabled=False, draft_tokens=draft_tokens, exact=True)
            )
            spec_config = GenerationConfig(
                max_tokens=24, spec=SpecConfig(draft_tokens=draft_tokens, draft_length=policy, exact=True)
            )
            _, plain, _ = generate(model, tokenizer, prompt, plain_config)
            _, fast, stats = generate(model, tokenizer, prompt, spec_config)
            assert fast == plain, f"prompt {i}, drafts ≤ {draft_tokens}"
            drafted += stats.accepted
    assert drafted > 10  # accepted drafts were compared, not only plain steps


def test_exact_mode_caps_the_draft_so_every_decode_pass_has_the_one_width(monkeypatch):
    from akunu.exact import EXACT_MAX_DRAFT

    model, widths = tiny_llama(seed=3, sharpness=4.0, attention=0.0), []
    real_call = FixedWidthModel.__call__
    monkeypatch.setattr(
        FixedWidthModel,
        "__call__",
        lambda self, inputs, cache: widths.append(inputs.shape[1]) or real_call(self, inputs, cache),
    )
    config = GenerationConfig(max_tokens=40, spec=SpecConfig(draft_tokens=32, draft_length="fixed", exact=True))
    _, _, stats = generate(model, FakeTokenizer(), [5, 6, 7, 8] * 4, config)
    assert stats.accepted > 0 and max(widths[1:]) == EXACT_MAX_DRAFT + 1  # widths[0]: the prefill


def test_a_token_tree_drafter_is_refused_in_exact_mode():
    from akunu.drafters.tree import NGramTreeDrafter
    from akunu.errors import OptionsError

    config = GenerationConfig(max_tokens=4, spec=SpecConfig(exact=True))
    with pytest.raises(OptionsError, match="--exact"):
        generate(MODELS["llama"](), FakeTokenizer(), [1, 2, 3], config, drafter=NGramTreeDrafter(max_nodes=6))


@pytest.mark.skipif(os.environ.get("AKUNU_BLAS") == "none", reason="already running on the reference BLAS")
def test_the_kernel_dependent_checks_also_pass_on_the_reference_blas():
    """The BLAS is chosen before MLX loads, so the other path needs a fresh process."""
    env = {**os.environ, "AKUNU_BLAS": "none"}
    code = "import sys, pytest, akunu.backends.cpu.blas as blas; assert blas.loaded_path is None; sys.exit(pytest.main(sys.argv[1:]))"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", *BLAS_CHECKS],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
