"""The fast decode step (akunu.backends.cpu.fast_step) must compute what mlx-lm's unpatched model computes."""

import random

import mlx.core as mx
import pytest

from akunu.backends.cpu import elementwise, fast_step, fused_layers, rope
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.kv_cache import make_cache, rewind
from tests.fakes import FakeTokenizer
from tests.tiny import tiny_gemma3, tiny_llama

MODELS = pytest.mark.parametrize("model_fn", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])


@pytest.fixture
def restore_attention():
    """The patch is a module global: leave mlx-lm's modules as each test found them."""
    models = [tiny_llama(), tiny_gemma3()]
    before = [fast_step.is_enabled(m) for m in models]
    yield
    for model, was in zip(models, before):
        (fast_step.enable if was else fast_step.disable)(model)


@pytest.fixture
def float32_caches(monkeypatch):
    """The patched model's caches in float32, as mlx-lm's (they hold float16 where the kernels read them)."""
    monkeypatch.setattr(fused_layers, "_half_cache", lambda: False)


def scripted_logits(model, tokens, prefix=11):
    """Logits of a prefill, 1-token steps, k-token passes and rollbacks, as speculation does them."""
    cache, out = make_cache(model), []
    out.append(model(mx.array([tokens[:prefix]]), cache=cache)[0])  # prefill, past gemma's window of 8
    for t in tokens[prefix : prefix + 3]:
        out.append(model(mx.array([[t]]), cache=cache)[0])
    for width, rejected in ((4, 2), (5, 0), (3, 3), (6, 1)):
        start = cache[0].offset
        out.append(model(mx.array([tokens[start : start + width]]), cache=cache)[0])
        rewind(cache, rejected)
    out.append(model(mx.array([[tokens[cache[0].offset]]]), cache=cache)[0])
    return mx.concatenate(out)


@MODELS
@pytest.mark.parametrize("prefix", [11, elementwise.WORTH_IT_FROM + 9], ids=["short", "long"])
def test_patched_model_gives_the_unpatched_logits(model_fn, prefix, restore_attention, float32_caches):
    model = model_fn(seed=3)
    tokens = [random.Random(5).randrange(64) for _ in range(prefix + 29)]
    assert fast_step.disable(model)
    reference = scripted_logits(model, tokens, prefix)
    assert fast_step.enable(model) and fast_step.is_enabled(model)
    patched = scripted_logits(model, tokens, prefix)
    assert reference.shape == patched.shape == (prefix + 22, 64)
    assert mx.allclose(patched, reference, atol=1e-4, rtol=1e-4).item()


@MODELS
def test_patched_model_decodes_the_same_tokens(model_fn, restore_attention, float32_caches):
    model = model_fn(seed=1)
    rng = random.Random(2)
    tokenizer = FakeTokenizer()
    for _ in range(6):
        prompt = [rng.randrange(64) for _ in range(rng.randint(3, 30))]
        outputs = []
        for switch in (fast_step.disable, fast_step.enable):
            switch(model)
            for spec in (SpecConfig(enabled=False), SpecConfig(draft_tokens=5, draft_length="fixed")):
                outputs.append(generate(model, tokenizer, prompt, GenerationConfig(max_tokens=30, spec=spec))[1])
        assert all(o == outputs[0] for o in outputs)


@MODELS
def test_a_wide_pass_matches_one_token_steps_with_the_patch(model_fn, restore_attention):
    """Greedy speculation's premise, as in test_speculative_greedy, holds for the patched attention too."""
    model = model_fn(seed=2)
    fast_step.enable(model)
    tokens = [random.Random(1).randrange(64) for _ in range(66)]
    cache = make_cache(model)
    steps = mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in tokens])
    for width in (2, 5, 9, 17, 33):
        cache = make_cache(model)
        wide = mx.concatenate([model(mx.array([tokens[i : i + width]]), cache=cache)[0] for i in range(0, 66, width)])
        assert mx.allclose(wide, steps[: wide.shape[0]], atol=1e-4).item(), f"width {width}"


@pytest.mark.parametrize("keys", [10, elementwise.WORTH_IT_FROM + 44], ids=["mx.softmax", "akunu's exp"])
@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("router", [True, False], ids=["q @ K^T", "K @ q per row"])
def test_attention_matches_mlx_on_every_mask_kind(keys, head_dim, router, monkeypatch):
    if not router:  # the scores' layout without akunu's decode matmuls
        monkeypatch.setattr(fast_step.blas, "matvec_path", None)
    mx.random.seed(0)
    q = mx.random.normal((2, 6, 3, head_dim))
    k, v = mx.random.normal((2, 2, keys, head_dim)), mx.random.normal((2, 2, keys, head_dim))
    window = mx.arange(keys - 3, keys)[:, None] < mx.arange(keys)[None] + 4
    per_head = mx.random.uniform(shape=(2, 6, 3, keys)) > 0.3  # a mask that differs between the heads sharing a KV head
    masks = [
        None,
        "causal",
        window,
        window[None, None],
        mx.where(window, 0.0, -1e9),
        per_head,
        mx.where(per_head, 0.0, -mx.inf),
    ]
    for mask in masks:
        ours = fast_step.cpu_attention(q, k, v, None, 0.3, mask)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
        assert mx.allclose(ours, theirs, atol=1e-5).item(), mask


@pytest.mark.parametrize("keys", [elementwise.WORTH_IT_FROM + 20, 40], ids=["long context", "wide pass"])
def test_attention_rows_do_not_depend_on_the_pass_width(keys):
    """Row j of a causal pass gives what a 1-row call over its own keys gives, past WORTH_IT_FROM keys
    (akunu's exp in both), and where only the wide pass has that many scores (akunu's exp against
    mx.softmax). To rounding only: the sum over keys may group its terms by how many there are."""
    mx.random.seed(1)
    rows = 8
    q, k, v = mx.random.normal((1, 6, rows, 64)), mx.random.normal((1, 2, keys, 64)), mx.random.normal((1, 2, keys, 64))
    wide = fast_step.cpu_attention(q, k, v, None, 0.125, "causal")
    for j in range(rows):
        end = keys - rows + j + 1
        row = fast_step.cpu_attention(q[:, :, j : j + 1], k[:, :, :end], v[:, :, :end], None, 0.125, None)
        assert mx.allclose(row, wide[:, :, j : j + 1], rtol=1e-6, atol=1e-7).item(), j


def test_exp_minus_is_exp_to_float32_precision():
    x = mx.concatenate(
        [mx.linspace(-87.0, 0.0, 100_001), mx.array([-1e-30, -0.5, -1e4, -mx.inf, mx.finfo(mx.float32).min])]
    )
    ours, exact = elementwise.exp_minus(x, mx.array(0.0)), mx.exp(x.astype(mx.float32))
    relative = mx.abs(ours - exact) / mx.maximum(exact, 1e-30)
    assert relative.max().item() < 3e-7
    assert ours[-3:].tolist() == [0.0, 0.0, 0.0]  # masked scores weigh nothing
    assert mx.isnan(elementwise.exp_minus(mx.array([mx.nan]), mx.array(0.0))).item()
    peak = mx.array([[2.0], [-3.0]])  # broadcast over rows, any shape (the kernels are shapeless)
    scores = mx.array([[2.0, 1.0, -5.0], [-3.0, -4.0, -3.5]])
    assert mx.allclose(elementwise.exp_minus(scores, peak), mx.exp(scores - peak), rtol=3e-7).item()


@pytest.mark.parametrize(
    "env, patched",
    [
        ({}, True),
        ({"AKUNU_CPU_BACKEND": "0"}, False),
        ({"AKUNU_CPU_BACKEND": "off"}, False),
        ({"AKUNU_FAST_STEP": "0"}, False),
    ],
)
def test_load_model_applies_the_fast_step_unless_switched_off(tmp_path, monkeypatch, restore_attention, env, patched):
    from akunu.models import load_model
    from tests.tiny_gguf import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    for name in ("AKUNU_CPU_BACKEND", "AKUNU_FAST_STEP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fast_step.disable(tiny_llama())
    loaded = load_model(str(path), dtype="float32")
    assert fast_step.is_enabled(loaded.model) == patched
    with fast_step.unpatched(loaded.model):
        assert not fast_step.is_enabled(loaded.model)
    assert fast_step.is_enabled(loaded.model) == patched


def test_exact_mode_and_the_fast_step_compose_in_either_order(restore_attention, float32_caches):
    from akunu.exact import FixedWidthModel

    model = tiny_llama(seed=2)
    fast_step.enable(model)
    exact = FixedWidthModel(model, width=5)  # wraps whatever attention the module has now
    assert fast_step.is_enabled(model)
    with fast_step.unpatched(model):  # mlx-lm's own attention under exact mode's dispatcher
        assert not fast_step.is_enabled(model)
        cache = make_cache(model)
        unpatched = exact(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache), exact(mx.array([[7]]), cache=cache)
    assert fast_step.is_enabled(model)
    cache = make_cache(model)
    patched = exact(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache), exact(mx.array([[7]]), cache=cache)
    for a, b in zip(unpatched, patched):
        assert mx.allclose(a, b, atol=1e-4).item()


def test_swiglu_is_mlx_lm_s_to_float32_precision():
    from mlx_lm.models.activations import swiglu

    mx.random.seed(5)
    gate = mx.concatenate([mx.linspace(-100.0, 100.0, 20_001), mx.random.normal((4_000,)) * 3, mx.array([0.0, -0.0])])
    x = mx.random.normal(gate.shape)
    ours, theirs = elementwise.swiglu(gate, x), swiglu(gate, x)
    assert mx.allclose(ours, theirs, rtol=5e-7, atol=1e-30).item()
    assert mx.array_equal(elementwise.swiglu(gate[:7], x[:7]), ours[:7]).item()  # elementwise: no row sees another


@pytest.mark.parametrize("traditional", [True, False], ids=["pairs (2i, 2i+1)", "pairs (i, i+d/2)"])
@pytest.mark.parametrize("dims", [16, 8], ids=["all dims", "partial"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rope_with_shared_angles_is_mlx_fast_rope_bit_for_bit(traditional, dims, dtype):
    """Every offset and width a decode reaches, bases and scales of real models: the same bits."""
    mx.random.seed(6)
    for width in (1, 5, 17):
        x = mx.random.normal((1, 3, width, 16)).astype(dtype)
        for offset in (0, 1, 17, 300, 1500, 40_000):
            for base, scale in ((10_000.0, 1.0), (100_000.0, 1.0), (500_000.0, 0.25)):
                expected = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
                got = rope.rope(x, dims, traditional, base, scale, offset)
                assert mx.array_equal(got, expected).item(), (width, offset, base, scale)
    assert rope.angles(5, 9, 16, 1e4, 1.0)[0] is rope.angles(5, 9, 16, 1e4, 1.0)[0]  # shared by a pass's layers


def test_compiled_rope_and_norm_equal_mlx_fast_at_every_offset():
    """One trace serves every position: the offset is an input of the compiled kernel, not a constant."""
    import mlx.nn as nn

    mx.random.seed(4)
    x = mx.random.normal((1, 4, 3, 16))
    rope = fast_step.CompiledRoPE(16, traditional=True, base=10000.0)
    for offset in (0, 1, 17, 300):
        expected = mx.fast.rope(x, 16, traditional=True, base=10000.0, scale=1.0, offset=offset)
        assert mx.array_equal(rope(x, offset=offset), expected).item(), offset
    norm = nn.RMSNorm(16, eps=1e-6)
    norm.weight = mx.random.normal((16,))
    norm.__class__ = fast_step.CompiledRMSNorm  # akunu's fused kernel: not mlx's summation order, so close, not equal
    assert mx.allclose(norm(x), mx.fast.rms_norm(x, norm.weight, 1e-6), rtol=1e-6, atol=1e-6).item()


def test_unpatched_runs_mlx_lm_s_own_modules(restore_attention):
    """The bench's mlx-lm column must not run akunu's compiled RoPE, norms and SwiGLU either."""
    model = tiny_llama(seed=3)
    fast_step.enable(model)
    kinds = lambda: {type(m) for _, m in model.named_modules()}  # noqa: E731
    ours = {fast_step.CompiledRoPE, fast_step.CompiledRMSNorm, fused_layers.FusedAttention, fused_layers.FusedMLP}
    assert ours <= kinds()
    module = fast_step._model_module(model)
    assert module.swiglu is fast_step.cpu_swiglu
    with fast_step.unpatched(model):
        assert not kinds() & ours
        assert module.swiglu is fast_step._mlx_swiglu
    assert ours <= kinds()
