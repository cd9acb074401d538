"""A small token tree and the decoding loops the tree tests compare: a tree-drafted loop against plain decoding."""

from akunu.decode import plain_decode, speculative_decode
from akunu.draft_length import DraftLength
from akunu.drafters.tree import NGramTreeDrafter, TokenTree
from akunu.forward import prefill
from akunu.kv_cache import make_cache
from akunu.sampling import SamplingParams
from akunu.stats import GenerationStats

# root -> 5 -> 6 -> 7, root -> 5 -> 9, root -> 8 -> 2   (depth-first packing)
TREE = TokenTree(tokens=[5, 6, 7, 9, 8, 2], parents=[-1, 0, 1, 0, -1, 4])


def paths(tree):
    """Packed indices (root 0 first) of the path to every node."""
    result = []
    for node in range(len(tree)):
        path, i = [], node
        while i >= 0:
            path.append(i + 1)
            i = tree.parents[i]
        result.append([0, *reversed(path)])
    return result


def run_tree(model, prompt, max_tokens, params=SamplingParams(), max_nodes=8, depth=4, adaptive=True):
    cache = make_cache(model)
    drafter = NGramTreeDrafter(max_nodes=max_nodes)
    drafter.start(prompt)
    stats = GenerationStats()
    logits = prefill(model, cache, prompt)
    policy = DraftLength(depth, adaptive=adaptive)
    loop = speculative_decode(
        model, cache, logits, params=params, stats=stats, drafter=drafter, draft_length=policy, budget=max_tokens
    )
    return [t for t, _ in (next(loop) for _ in range(max_tokens))], stats


def run_plain(model, prompt, max_tokens):
    cache = make_cache(model)
    loop = plain_decode(model, cache, prefill(model, cache, prompt), params=SamplingParams(), stats=GenerationStats())
    return [t for t, _ in (next(loop) for _ in range(max_tokens))]
