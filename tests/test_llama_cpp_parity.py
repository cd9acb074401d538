"""Each GGUF architecture against llama.cpp: a tiny random-weight file (tests/llama_cpp_tiny.py, rebuilt from
its seed) gives llama.cpp's recorded logits and greedy tokens (tests/fixtures/llama_cpp/, recorded by
scripts/record_llama_cpp_fixtures.py); speculation equals plain decoding on it; and the same model saved as
an MLX folder and loaded by mlx-lm gives the same logits."""

from __future__ import annotations

import dataclasses
import json
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model

import akunu  # noqa: F401  (must precede mlx)
from akunu.backends.cpu import quantized
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.models import load_model
from akunu.models.gguf_file import read_gguf
from akunu.models.gguf_model import load_gguf_model
from tests import llama_cpp_tiny as tiny
from tests.fakes import FakeTokenizer
from tests.greedy_checks import OracleDrafter, assert_same_or_near_tie

FIXTURES = tiny.Path(__file__).parent / "fixtures" / "llama_cpp"
# Logits are stored as float16 (rounding up to 2e-3 at these sizes) and llama.cpp sums in another order.
LOGIT_TOLERANCE = 5e-3


@pytest.fixture(scope="module", params=sorted(tiny.ARCHS))
def case(request, tmp_path_factory):
    arch = tiny.ARCHS[request.param]
    path = tiny.write(arch, tmp_path_factory.mktemp(arch.name) / f"{arch.name}.gguf")
    return arch, path, load_model(str(path), dtype="float32")


def prompt_logits(model) -> np.ndarray:
    return np.array(model(mx.array(tiny.PROMPT)[None])[0].astype(mx.float32))


def greedy(model, count: int) -> list[int]:
    config = GenerationConfig(max_tokens=count, spec=SpecConfig(enabled=False))
    return generate(model, FakeTokenizer(), tiny.PROMPT, config)[1]


def test_logits_and_greedy_tokens_match_llama_cpp(case):
    arch, _, loaded = case
    with np.load(FIXTURES / f"{arch.name}.npz") as recorded:
        expected, expected_tokens = recorded["logits"].astype(np.float32), recorded["tokens"].tolist()
    logits = prompt_logits(loaded.model)
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() < LOGIT_TOLERANCE
    assert greedy(loaded.model, len(expected_tokens)) == expected_tokens


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_greedy_speculative_equals_plain(case, exact):
    arch, _, loaded = case
    rng = random.Random(0)
    motif = [rng.randrange(tiny.VOCAB) for _ in range(5)]
    # A fixed draft length verifies every round's drafts: adaptive rounds stream plain steps past a random model's misses.
    spec = SpecConfig(draft_tokens=6, draft_length="fixed", exact=exact)
    plain_spec = SpecConfig(enabled=False, exact=exact)
    prompt = motif * 4  # repeated, so n-gram drafts are proposed from the first step
    plain = generate(loaded.model, FakeTokenizer(), prompt, GenerationConfig(max_tokens=24, spec=plain_spec))[1]
    # A random delta-net model never repeats the motif, so an oracle drafts its plain run with planted errors.
    drafter = OracleDrafter(prompt, plain) if arch.recurrent_layer else None
    _, fast, stats = generate(
        loaded.model, FakeTokenizer(), prompt, GenerationConfig(max_tokens=24, spec=spec), drafter=drafter
    )
    if exact:
        assert fast == plain
    else:
        assert_same_or_near_tie(loaded.model, prompt, plain, fast, "speculative vs plain")
    assert stats.accepted > 0  # drafts were verified, not only plain steps


def test_mlx_folder_route_gives_the_same_logits(case, tmp_path):
    """The GGUF mapping's mlx-lm model, saved as an MLX folder and loaded by mlx-lm itself."""
    _, path, _ = case
    model, config = load_gguf_model(read_gguf(path), quantized=False)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(config))
    folder_model, _ = mlx_lm_load_model(tmp_path)
    np.testing.assert_allclose(prompt_logits(folder_model), prompt_logits(model), atol=1e-5, rtol=1e-5)


def test_qwen35_prediction_blocks_are_ignored(tmp_path):
    """Converted Qwen3.5 files carry multi-token prediction blocks after the trunk; akunu runs the trunk alone."""
    trunk = tiny.ARCHS["qwen35"]
    with_blocks = dataclasses.replace(trunk, prediction_blocks=1)  # the same name: the same seed, the same trunk
    plain = load_model(str(tiny.write(trunk, tmp_path / "trunk.gguf")), dtype="float32").model
    extended = load_model(str(tiny.write(with_blocks, tmp_path / "mtp.gguf")), dtype="float32").model
    np.testing.assert_array_equal(prompt_logits(extended), prompt_logits(plain))


@pytest.mark.parametrize("dtype", ["float32", "quantized"])
def test_qwen35_quantized_value_head_matrices(tmp_path, dtype):
    """Q8_0 delta-net matrices whose value heads the converter tiled load as the same weights held in float32."""
    arch = tiny.ARCHS["qwen35"]
    stored = load_model(str(tiny.write(arch, tmp_path / "q8.gguf", matrices="q8_0")), dtype=dtype).model
    quantized.disable(stored)  # MLX's float products: this compares the weights, not the CPU kernel's int8 activations
    values = load_model(str(tiny.write(arch, tmp_path / "f32.gguf", matrices="q8_0-values")), dtype="float32").model
    np.testing.assert_allclose(prompt_logits(stored), prompt_logits(values), atol=1e-4, rtol=1e-4)
