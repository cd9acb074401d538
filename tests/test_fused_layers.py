"""Fused llama layers (akunu.backends.cpu.fused_layers) compute mlx-lm's layers, in the same memory."""

import gc
import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from akunu import backends
from akunu.backends.cpu import fast_step, fused_layers, kernels, quantized
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.kv_cache import make_cache, rewind
from tests.fakes import FakeTokenizer
from tests.greedy_checks import OracleDrafter
from tests.tiny import quantize, tiny_gemma3, tiny_llama, tiny_qwen2

TOKENS = [random.Random(3).randrange(64) for _ in range(90)]


def decode_logits(model: nn.Module) -> mx.array:
    """A prefill wider than MAX_ROWS, 1-token steps and verification passes with rollbacks."""
    cache, out = make_cache(model), []
    prefix = fused_layers.MAX_ROWS + 6
    out.append(model(mx.array([TOKENS[:prefix]]), cache=cache)[0])
    for width, rejected in ((1, 0), (1, 0), (5, 2), (9, 4), (1, 0)):
        start = cache[0].offset
        out.append(model(mx.array([TOKENS[start : start + width]]), cache=cache)[0])
        rewind(cache, rejected)
    return mx.concatenate(out)


@pytest.fixture
def unfused_llama(monkeypatch):
    model = tiny_llama(seed=7, hidden=64, layers=2)
    fast_step.disable(model)  # only the fusion differs between the runs compared
    monkeypatch.setattr(fused_layers, "_half_cache", lambda: False)  # float32 caches, as mlx-lm's
    yield model
    fused_layers.unfuse(model)


def test_fused_layers_give_mlx_lm_s_logits(unfused_llama):
    reference = decode_logits(unfused_llama)
    assert fused_layers.fuse(unfused_llama) == 4  # two attention and two MLP modules
    assert {type(m) for _, m in unfused_llama.named_modules()} >= {fused_layers.FusedAttention, fused_layers.FusedMLP}
    fused = decode_logits(unfused_llama)
    assert mx.allclose(fused, reference, atol=1e-5, rtol=1e-5).item()
    assert mx.array_equal(fused.argmax(-1), reference.argmax(-1)).item()


def test_fusing_keeps_one_copy_of_the_weights():
    model = tiny_llama(seed=1, hidden=256, layers=2)
    fast_step.disable(model)
    stacked_bytes = sum(
        m.weight.nbytes for _, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in _
    )
    gc.collect()
    before = mx.get_active_memory()
    fused_layers.fuse(model)
    gc.collect()
    assert mx.get_active_memory() - before < stacked_bytes / 10  # the layers' weights are views of the stacks
    attention = model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (256, 256) and attention.k_proj.weight.shape == (128, 256)
    fused_layers.unfuse(model)


def test_weights_replaced_after_fusing_are_the_ones_used(unfused_llama):
    """An adapter loaded later must not be shadowed by the stacks made before it."""
    fused_layers.fuse(unfused_llama)
    attention, mlp = unfused_llama.layers[1].self_attn, unfused_llama.layers[1].mlp
    attention.k_proj.weight = attention.k_proj.weight * 3.0
    mlp.down_proj.weight = -mlp.down_proj.weight
    fused = decode_logits(unfused_llama)
    fused_layers.unfuse(unfused_llama)
    assert mx.allclose(fused, decode_logits(unfused_llama), atol=1e-5, rtol=1e-5).item()


def test_refusing_keeps_the_stacks(unfused_llama):
    fused_layers.fuse(unfused_llama)
    stack = fused_layers.stacks(unfused_llama.layers[0].self_attn)["qkv"]
    fused_layers.fuse(unfused_llama)  # as fast_step.enable does after every unpatched() block
    assert fused_layers.stacks(unfused_llama.layers[0].self_attn)["qkv"] is stack


MODELS = {
    "llama quantized, v at 8 bits": lambda: quantize(tiny_llama(seed=7, hidden=64, layers=2)),
    "llama quantized at one width": lambda: quantize(tiny_llama(seed=8, hidden=64, layers=2), v_bits=4),
    "llama quantized, float16 scales but v's": lambda: quantize(tiny_llama(seed=9, hidden=64, layers=2), 4, True),
    "qwen2 with biases": lambda: tiny_qwen2(seed=3),
    "qwen2 quantized, with biases": lambda: quantize(tiny_qwen2(seed=4)),
}


@pytest.fixture(params=MODELS)
def other_model(request, monkeypatch):
    if quantized.load() is None and "quantized" in request.param:
        pytest.skip(f"no quantized kernel here: {quantized.unavailable()}")
    model = MODELS[request.param]()
    monkeypatch.setattr(fused_layers, "_half_cache", lambda: False)  # float32 caches, as mlx-lm's
    quantized.enable(model)  # the reference runs each quantized layer through akunu's kernel, as the backend does
    yield model
    fused_layers.unfuse(model)


def test_quantized_and_biased_projections_take_the_fused_path_and_give_mlx_lm_s_logits(other_model):
    reference = decode_logits(other_model)
    assert fused_layers.fuse(other_model) == 2 * len(other_model.layers)
    for block in other_model.layers:
        assert all(
            fused_layers.stacks(m)[name] is not None
            for m in (block.self_attn, block.mlp)
            for name in fused_layers.stacks(m)
        )
    q, v = other_model.layers[0].self_attn.q_proj, other_model.layers[0].self_attn.v_proj
    stored = [(p.bits, p.scales.dtype) if isinstance(p, nn.QuantizedLinear) else None for p in (q, v)]
    mixed = stored[0] != stored[1]  # then q|k is one product, v another
    assert len(fused_layers.stacks(other_model.layers[0].self_attn)["qkv"].parts) == (2 if mixed else 1)
    fused = decode_logits(other_model)
    # float32 rounding apart (RoPE and attention as kernels), which int8 activations can round a step further
    assert mx.allclose(fused, reference, atol=1e-4, rtol=1e-4).item()
    assert mx.array_equal(fused.argmax(-1), reference.argmax(-1)).item()


def test_stacking_quantized_layers_keeps_one_copy_of_the_weights():
    if quantized.load() is None:
        pytest.skip(f"no quantized kernel here: {quantized.unavailable()}")
    model = quantize(tiny_llama(seed=1, hidden=256, layers=2), v_bits=4)
    fast_step.disable(model)
    stacked_bytes = sum(
        m.weight.nbytes + m.scales.nbytes * 2 for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)
    )
    gc.collect()
    before = mx.get_active_memory()
    fused_layers.fuse(model)
    gc.collect()
    assert mx.get_active_memory() - before < stacked_bytes / 10  # the layers' arrays are views of the stacks
    assert len(fused_layers.stacks(model.layers[0].self_attn)["qkv"].parts) == 1
    fused_layers.unfuse(model)


@pytest.mark.parametrize("name", ["llama quantized, v at 8 bits", "qwen2 quantized, with biases", "qwen2 with biases"])
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_greedy_speculative_equals_plain_through_the_fused_path(name, exact):
    """Drafts of the plain output with planted errors: wide passes, accepted and rolled back mid-draft."""
    if quantized.load() is None and "quantized" in name:
        pytest.skip(f"no quantized kernel here: {quantized.unavailable()}")
    model = MODELS[name]()
    backends.apply(model)
    assert type(model.model.layers[0].self_attn).__name__.startswith("Fused")
    prompt = TOKENS[:12]
    plain = generate(
        model, FakeTokenizer(), prompt, GenerationConfig(max_tokens=16, spec=SpecConfig(enabled=False, exact=exact))
    )[1]
    spec = SpecConfig(draft_tokens=5, draft_length="fixed", exact=exact)
    _, fast, stats = generate(
        model, FakeTokenizer(), prompt, GenerationConfig(max_tokens=16, spec=spec), drafter=OracleDrafter(prompt, plain)
    )
    assert fast == plain
    assert stats.drafted > stats.accepted > 5  # drafts landed, and some were rejected mid-draft and rolled back


def test_the_cache_holds_float16_keys_and_values_the_kernels_read():
    """With akunu's kernels, a fused model's cache stores float16 (prefill chunks, steps and passes alike), and
    attention over it gives the bits of attention over the float16-rounded keys and values in float32."""
    built = kernels.load()
    if built is None:
        pytest.skip(f"no CPU kernels here: {kernels.unavailable()}")
    model = tiny_llama(seed=7, hidden=64, layers=2)
    backends.apply(model)
    cache = make_cache(model)
    for chunk in (TOKENS[: fused_layers.MAX_ROWS + 6], TOKENS[70:71], TOKENS[71:80]):  # prefill, a step, a pass
        mx.eval(model(mx.array([chunk]), cache=cache))
        assert {(c.keys.dtype, c.values.dtype) for c in cache} == {(mx.float16, mx.float16)}
    q = mx.random.normal((1, 4, 9, 16), key=mx.random.key(1))
    k, v = (mx.random.normal((1, 2, 300, 16), key=mx.random.key(i)).astype(mx.float16) for i in (2, 3))
    got = built.attention(q, k, v, 0.25, True, 290)
    assert mx.array_equal(got, built.attention(q, k.astype(mx.float32), v.astype(mx.float32), 0.25, True, 290)).item()
    mask = mx.arange(281, 290)[:, None] >= mx.arange(290)
    rounded = (a[:, :, :290].astype(mx.float32) for a in (k, v))
    assert mx.allclose(got, mx.fast.scaled_dot_product_attention(q, *rounded, scale=0.25, mask=mask), atol=1e-6).item()


def test_other_architectures_are_left_alone():
    model = tiny_gemma3(seed=2)
    assert fused_layers.fuse(model) == 0
    assert not any(type(m) in (fused_layers.FusedAttention, fused_layers.FusedMLP) for _, m in model.named_modules())


def test_the_fused_attention_calls_the_module_s_current_attention(unfused_llama, monkeypatch):
    """akunu's exact mode and fast step swap llama's module global: the fused layer must see the swap."""
    fused_layers.fuse(unfused_llama)
    calls = []
    original = llama.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", counting)
    unfused_llama(mx.array([[1, 2, 3]]), cache=make_cache(unfused_llama))
    assert len(calls) == 2  # one per layer
