"""Real catalogue models: fetched into the shared model cache on first use, then loaded once per module."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import akunu  # noqa: F401  (must precede mlx)
from akunu.errors import ModelError
from akunu.models import LoadedModel, catalogue, load_model

pytestmark = pytest.mark.real_model

FIBONACCI_PROMPT = (
    "<|im_start|>user\nWrite a Python function that returns the fibonacci numbers up to n.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
FIBONACCI_START = "```python\ndef fibonacci(n):\n    if n <= 0:\n        return 0\n    elif n == 1:\n        return 1"


@pytest.fixture(scope="module")
def shared_home(model_home):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AKUNU_HOME", str(model_home))
        yield model_home


@pytest.fixture(scope="module", params=["quantized", "float32"])
def smollm2(request, shared_home) -> LoadedModel:
    return load_model("smollm2-135m", dtype=request.param)


@pytest.fixture(scope="module", params=["quantized", "float32"])
def gemma3(request, shared_home) -> LoadedModel:
    return load_model("gemma3-270m", dtype=request.param)


def greedy(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int) -> list[int]:
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array(prompt_ids)[None], cache=cache)
    generated: list[int] = []
    for _ in range(max_tokens):
        token = mx.argmax(logits[0, -1]).item()
        generated.append(token)
        if token in loaded.tokenizer.eos_ids:
            break
        logits = loaded.model(mx.array([[token]]), cache=cache)
    return generated


def test_smollm2_writes_fibonacci(smollm2):
    text = smollm2.tokenizer.decode(greedy(smollm2, smollm2.tokenizer.encode(FIBONACCI_PROMPT), 48))
    assert text.startswith(FIBONACCI_START), text


def test_smollm2_description(smollm2):
    assert (smollm2.architecture, smollm2.context_length, smollm2.path.name) == (
        "llama",
        8192,
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    assert smollm2.describe() == f"smollm2-135m: llama, 135M params, {smollm2.dtype} weights"


def test_gemma3_completes_facts(gemma3):
    tokenizer = gemma3.tokenizer
    berlin = greedy(
        gemma3, tokenizer.encode("The capital of France is Paris. The capital of Germany is", add_bos=True), 1
    )
    assert tokenizer.decode(berlin) == " Berlin"
    text = tokenizer.decode(greedy(gemma3, tokenizer.encode("Paris is the capital of", add_bos=True), 12))
    assert text.startswith(" France"), text
    assert gemma3.architecture == "gemma3" and gemma3.context_length == 32768


def test_truncated_real_file(shared_home, tmp_path):
    source = catalogue.resolve("smollm2-135m")
    broken = tmp_path / "cut.gguf"
    with open(source, "rb") as original:
        broken.write_bytes(original.read(source.stat().st_size // 2))
    with pytest.raises(ModelError, match="truncated"):
        load_model(str(broken))
