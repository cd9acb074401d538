"""Token-tree passes on akunu's CPU kernels: the attention kernel follows the tree itself, each row getting the bits a
chain holding the same keys gives it, and a whole tree pass runs as a chain's compiled pass does."""

import mlx.core as mx
import pytest

from akunu import backends
from akunu.backends.cpu import compiled_pass, kernels
from akunu.drafters.base import TokenTree
from akunu.drafters.tree import pass_parents, tree_forward, tree_mask
from akunu.kv_cache import make_cache
from tests.kernel_models import MODELS, applied
from tests.trees import TREE, paths, run_plain, run_tree

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="tree passes run on akunu's CPU kernels")

PARENTS = [-1, 0, 1, 0, 3, -1, 5, 2, 7, 7]  # two roots under the prefix; a node with two children (7)


def ancestors(parents: list[int], row: int) -> list[int]:
    path = []
    while row >= 0:
        path.append(row)
        row = parents[row]
    return path[::-1]


def heads(prefix: int, dtype, seed: int = 0):
    """q (1, 6, L, 64) and a cache's k, v (1, 2, S + 3, 64) holding the prefix and the pass's rows."""
    L = len(PARENTS)
    q = mx.random.normal((1, 6, L, 64), key=mx.random.key(seed))
    k, v = (mx.random.normal((1, 2, prefix + L + 3, 64), key=mx.random.key(seed + i)).astype(dtype) for i in (1, 2))
    return q, k, v


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("prefix", [0, 5, 37])
def test_tree_attention_equals_mlx_attention_under_the_tree_mask(dtype, prefix):
    q, k, v = heads(prefix, dtype)
    S = prefix + len(PARENTS)
    got = kernels.load().attention(q, k, v, 0.125, True, S, False, mx.array(PARENTS, mx.int32))
    visible = [[j in ancestors(PARENTS, row) for j in range(len(PARENTS))] for row in range(len(PARENTS))]
    mask = mx.concatenate([mx.ones((len(PARENTS), prefix), mx.bool_), mx.array(visible)], axis=1)
    keys, values = (a[:, :, :S].astype(mx.float32) for a in (k, v))
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("prefix", [3, 37])
def test_each_tree_row_has_the_bits_of_a_chain_holding_its_visible_keys(prefix):
    q, k, v = heads(prefix, mx.float16, seed=7)
    S, built = prefix + len(PARENTS), kernels.load()
    tree = built.attention(q, k, v, 0.125, True, S, True, mx.array(PARENTS, mx.int32))  # rows (L, H * 64)
    for row in range(len(PARENTS)):
        path = ancestors(PARENTS, row)
        slots = mx.array(list(range(prefix)) + [prefix + j for j in path])
        chain_q = mx.broadcast_to(q[:, :, row : row + 1], (1, 6, len(path), 64))  # its last row is this row
        chain = built.attention(chain_q, k[:, :, slots], v[:, :, slots], 0.125, True, -1, True)
        assert mx.array_equal(chain[-1], tree[row]).item(), row


def test_a_malformed_tree_gives_nan_rows_not_a_crash():
    q, k, v = heads(4, mx.float16)
    got = kernels.load().attention(
        q, k, v, 0.125, True, 4 + len(PARENTS), False, mx.array([0] * len(PARENTS), mx.int32)
    )
    assert mx.isnan(got).all().item()
    with pytest.raises(ValueError, match="parents must be one int32 per row"):
        kernels.load().attention(q, k, v, 0.125, True, -1, False, mx.array([-1, 0], mx.int32))


@pytest.mark.parametrize("name", MODELS)
def test_a_tree_pass_on_the_kernels_gives_each_path_the_bits_of_its_chain_pass(name, monkeypatch):
    model = applied(name)
    trees = []
    run = compiled_pass.run
    monkeypatch.setattr(compiled_pass, "run", lambda *a, **k: (trees.append(a[4:] or k), run(*a, **k))[1])
    prefix = [(5 * i + 1) % 64 for i in range(40)]
    cache = make_cache(model)
    mx.eval(model(mx.array([prefix]), cache=cache))
    logits = tree_forward(model, cache, 3, TREE)
    assert trees[-1], "the tree pass ran as a compiled pass with its parents"
    packed = [3, *TREE.tokens]
    for path in paths(TREE):
        chain_cache = make_cache(model)
        mx.eval(model(mx.array([prefix]), cache=chain_cache))
        chain = model(mx.array([[packed[i] for i in path]]), cache=chain_cache)[0, -1]
        assert mx.array_equal(logits[path[-1]], chain).item(), path
        for tree_layer, chain_layer in zip(cache, chain_cache):  # the keys the path wrote, bit for bit
            for ours, theirs in ((tree_layer.keys, chain_layer.keys), (tree_layer.values, chain_layer.values)):
                written = ours[..., mx.array([len(prefix) + i for i in path]), :]
                assert mx.array_equal(written, theirs[..., len(prefix) : len(prefix) + len(path), :]).item()


def test_tree_mask_and_parents_describe_the_same_tree():
    tree = TokenTree([1, 2, 3, 4], [-1, 0, -1, 2])
    parents = pass_parents(tree).tolist()
    mask = tree_mask(tree, 2)[:, 2:].tolist()
    assert mask == [[j in ancestors(parents, row) for j in range(5)] for row in range(5)]


def test_greedy_tree_decoding_on_the_kernels_equals_plain_decoding(monkeypatch):
    model = applied("qwen2 quantized, with biases")
    kernel_passes = []
    original = backends.tree_pass
    monkeypatch.setattr(backends, "tree_pass", lambda *a: kernel_passes.append(r := original(*a)) or r)
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 12, 13, 7, 8, 9, 10, 11, 7, 8]
    for motif in range(3):
        shifted = [(t + 5 * motif) % 64 for t in prompt]
        assert run_tree(model, shifted, 24)[0] == run_plain(model, shifted, 24)
    assert any(p is not None for p in kernel_passes)
