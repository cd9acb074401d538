"""Compiled llama passes (akunu.backends.cpu.compiled_pass): the eager fused path's bits, the same cache, and
never a stale trace."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from akunu.backends.cpu import compiled_pass, kernels
from akunu.kv_cache import make_cache, rewind
from tests.kernel_models import MODELS, applied

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="compiled passes run on akunu's CPU kernels")

PROMPT = [(5 * i + 1) % 64 for i in range(250)]  # fills the first 256-position buffers within a few steps


@pytest.fixture
def model():
    return applied("llama")


@pytest.fixture(params=MODELS)
def each_model(request):
    return applied(request.param)


@pytest.fixture
def eager(monkeypatch):
    """Switches compiled passes off: every pass builds its graph in Python, as before."""
    return lambda: monkeypatch.setattr(compiled_pass, "has_room", lambda caches, L: False)


def decode(model, passes: int = 24) -> tuple[list[mx.array], list]:
    """Steps and verification passes of widths 1-5 with rollbacks, crossing a buffer's end (where mlx-lm's
    update_and_fetch grows it and the pass runs eagerly): each pass's logits, and the cache."""
    cache, out = make_cache(model), []
    token = int(model(mx.array([PROMPT]), cache=cache)[0, -1].argmax())
    for i in range(passes):
        width = 1 + i % 5
        logits = model(mx.array([[token] + [(token + 7 * j) % 64 for j in range(1, width)]]), cache=cache)[0]
        mx.eval(logits)
        out.append(logits)
        rewind(cache, width - 1)
        token = int(logits[0].argmax())
    return out, cache


def test_compiled_passes_give_the_eager_passes_bits_and_cache(each_model, eager, monkeypatch):
    """Quantized products (at two widths) and biases run inside the pass around akunu's attention node."""
    runs = []
    monkeypatch.setattr(compiled_pass, "run", _counting(compiled_pass.run, runs))
    compiled, compiled_cache = decode(each_model)
    compiled_passes = len(runs)
    assert compiled_passes >= 20  # all but the pass that grew the buffers
    eager()
    reference, reference_cache = decode(each_model)
    assert len(runs) == compiled_passes  # the reference ran eagerly
    assert all(mx.array_equal(a, b).item() for a, b in zip(compiled, reference))
    for c, r in zip(compiled_cache, reference_cache):
        assert c.offset == r.offset == len(PROMPT) + 24
        assert mx.array_equal(c.keys[..., : c.offset, :], r.keys[..., : r.offset, :]).item()
        assert mx.array_equal(c.values[..., : c.offset, :], r.values[..., : r.offset, :]).item()


@pytest.mark.parametrize("name", ["llama", "qwen2 quantized, with biases"])
def test_one_layer_stack_serves_every_width_and_capacity(name, monkeypatch):
    """Where every half-layer is one node, passes of widths 1-5 across a grown cache are each one layer-stack node
    over the same halves, made once, and nothing is traced (speculation's passes come in dozens of widths)."""
    model = applied(name)
    traces, stacks = [], []
    monkeypatch.setattr(compiled_pass, "_traced", _counting(compiled_pass._traced, traces))

    def recorded(*args, **kwargs):
        hidden = through_layer_stack(*args, **kwargs)
        stacks.append(model.model.__dict__[compiled_pass._STACKS][len(model.model.layers)].layers)
        return hidden

    through_layer_stack = compiled_pass._through_layer_stack
    monkeypatch.setattr(compiled_pass, "_through_layer_stack", recorded)
    _, cache = decode(model)
    assert cache[0].keys.shape[2] > 256  # the buffers grew, and passes ran at both capacities
    assert len(stacks) >= 20 and all(layers is stacks[0] for layers in stacks)
    assert not traces


def _counting(function, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def test_a_replaced_norm_or_embedding_weight_is_used_at_once(each_model, eager):
    """The layer stack's halves (or a trace) hold the norms' weights; replacing one makes new ones, not a stale pass."""
    model = each_model
    decode(model, passes=3)  # made with the first weights
    model.model.norm.weight = model.model.norm.weight * 1.5
    model.model.layers[1].post_attention_layernorm.weight = -model.model.layers[1].post_attention_layernorm.weight
    model.model.embed_tokens.weight = model.model.embed_tokens.weight[::-1]
    compiled, _ = decode(model, passes=3)
    eager()
    reference, _ = decode(model, passes=3)
    assert all(mx.array_equal(a, b).item() for a, b in zip(compiled, reference))


@pytest.mark.parametrize("name", ["llama", "qwen2 quantized, with biases"])
def test_a_projection_replaced_between_passes_is_used_at_once(name):
    """The model remembers what its last check of the fused path saw (`fused_layers.Binding`); arrays an adapter
    loads, or a projection module swapped in (as LoRA swaps them), must still be the ones the next pass uses."""

    def replace_projections(model):
        layers = model.model.layers
        k_proj = layers[1].self_attn.k_proj
        k_proj.update({name: array * 1.5 for name, array in k_proj.parameters().items() if array.dtype != mx.uint32})
        layers[0].mlp.down_proj = layers[1].mlp.down_proj

    model, reference = applied(name), applied(name)
    decode(model, passes=3)
    replace_projections(model)
    replace_projections(reference)  # before its first pass
    replaced, _ = decode(model, passes=3)
    expected, _ = decode(reference, passes=3)
    assert all(mx.array_equal(a, b).item() for a, b in zip(replaced, expected))
    first, _ = decode(applied(name), passes=3)
    assert not mx.array_equal(first[0], expected[0]).item()


def test_a_pass_given_the_first_layers_caches_runs_those_layers_alone(each_model, eager):
    """A layer-skip drafter hands the model the caches of its first layers: a pass runs those blocks, then the
    final norm and head, as the eager path does; the full model's passes keep their own halves."""

    def passes(layers: int) -> list[mx.array]:
        cache = make_cache(each_model)[:layers]
        out = [each_model(mx.array([PROMPT[:40]]), cache=cache)[0]]
        return out + [
            each_model(mx.array([[token, token + 1][:width]]), cache=cache)[0] for token, width in ((3, 1), (5, 2))
        ]

    first, whole = passes(1), passes(len(each_model.model.layers))
    assert not mx.array_equal(first[-1], whole[-1]).item()
    eager()
    assert all(mx.array_equal(a, b).item() for a, b in zip(first, passes(1)))
    assert all(mx.array_equal(a, b).item() for a, b in zip(whole, passes(len(each_model.model.layers))))


def test_caches_a_compiled_pass_cannot_take():
    """Layers at different offsets (an interrupt between layers), a full buffer, an empty or foreign cache."""

    def filled(offset, capacity=256):
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 2, capacity, 16)), mx.zeros((1, 2, capacity, 16)))
        cache.offset = offset
        return cache

    assert compiled_pass.has_room([filled(10), filled(10)], 5)
    assert not compiled_pass.has_room([filled(10), filled(9)], 1)
    assert not compiled_pass.has_room([filled(250), filled(250)], 7)
    assert not compiled_pass.has_room([KVCache(), KVCache()], 1)
    assert not compiled_pass.has_room([filled(10), object()], 1)


def test_a_pass_whose_output_is_dropped_still_fills_the_cache(each_model, eager):
    """Prefill feeds its chunks and reads only the cache (a chat's later turn: short chunks, compiled passes);
    the keys and values written in place must not depend on anyone reading the pass's output."""
    from akunu.forward import prefill

    def turns():
        cache = make_cache(each_model)
        first = prefill(each_model, cache, PROMPT[:100])
        second = prefill(each_model, cache, PROMPT[100:140], step=16)  # chunks of 16 tokens, their outputs dropped
        return mx.concatenate([first, second])

    compiled = turns()
    eager()
    assert mx.array_equal(compiled, turns()).item()
