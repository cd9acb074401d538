"""The cost curve: how long a forward pass of k = 1..33 tokens takes on this backend, as a chain and as a token tree.

Adaptive drafting weighs expected accepted tokens against it, so it is measured once per
model, dtype and backend and kept on disk (`akunu bench cost-curve` measures it afresh).
It is measured out to the widest pass the policy may choose (32 drafts and the last token),
after a short, a middling and a long context, since longer contexts make wide passes
relatively dearer; a generation
reads the curve at its own context (`CostCurves.at`, and `CostCurves.tree_at` for tree passes).
A tree pass of k tokens is the root and k - 1 nodes in a binary tree (`measured_tree`), run by
`drafters.tree.tree_forward`: where the backend's attention kernel does not take the tree, its mask
goes through MLX's generic attention, and the tree curve shows what that costs.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from akunu import backends
from akunu.drafters.base import TokenTree
from akunu.drafters.tree import tree_forward
from akunu.forward import feed
from akunu.home import home
from akunu.kv_cache import make_cache, rewind

MAX_WIDTH = 33  # 32 drafts and the last committed token
# A first run measures these widths only, with few sweeps, and reads the others off straight lines between
# them: enough to pick draft lengths, in a fraction of the time; `akunu bench cost-curve` measures every width.
QUICK_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 11, 16, 24, 33)
QUICK_SWEEPS = 2
Progress = Callable[[int, int], None]  # (passes timed, passes in all)
CONTEXT = 512  # a middling context: a prompt plus part of its answer
CONTEXTS = (64, CONTEXT, 2048)  # tokens already in the cache while timing; generation reads between them


def measure_passes(
    model: nn.Module,
    max_width: int = MAX_WIDTH,
    sweeps: int = 7,
    context: int = CONTEXT,
    widths: Sequence[int] | None = None,
    on_pass: Callable[[], None] | None = None,
    trees: bool = True,
) -> tuple[list[float], list[float] | None]:
    """Seconds of a k-token pass, k = 1..max_width, after `context` tokens (only `widths` timed, if given; the rest
    read off straight lines between them), for chains and for tree passes of the same widths (None unless `trees`),
    each tree timed right after the chain of its width. `on_pass` is called after each timed pass.

    Each sweep times every width once, alternating direction, so a burst of load from another
    process lands on all widths alike; the fastest sample of each width is kept, since load
    only ever adds time. For the same reason a width that timed slower than a wider one was
    slowed by load: a wider pass does all a narrower one does, so the curve is made
    non-decreasing from the widest end.
    """
    cache = make_cache(model)
    feed(model, cache, mx.zeros((context,), mx.uint32))  # the cache filled, no logits for every position
    timed = timed_widths(max_width, widths)
    inputs = {width: mx.zeros((1, width), mx.uint32) for width in timed}
    shapes = {width: measured_tree(width) for width in timed if trees and width >= TREE_FROM}
    passes = {("chain", w): lambda w=w: model(inputs[w], cache=cache) for w in timed}
    passes.update({("tree", w): lambda w=w: tree_forward(model, cache, 0, shapes[w]) for w in shapes})
    samples: dict[tuple[str, int], list[float]] = {kind: [] for kind in passes}
    for sweep in range(sweeps + 1):  # sweep 0 warms every width up
        for width in timed if sweep % 2 == 0 else reversed(timed):
            for kind in ("chain", "tree"):
                if (kind, width) not in passes:
                    continue
                start = time.perf_counter()
                mx.eval(passes[kind, width]())
                if sweep:
                    samples[kind, width].append(time.perf_counter() - start)
                rewind(cache, width)
                if on_pass is not None:
                    on_pass()
    chain = _filled(dict(zip(timed, non_decreasing([min(samples["chain", w]) for w in timed]))), max_width)
    if not trees or not shapes:
        return chain, list(chain) if trees else None
    fastest = non_decreasing([min(samples["tree", w]) for w in shapes])
    tree = _filled(dict(zip(shapes, fastest)), max_width)
    # Below TREE_FROM a tree is a chain (tree_forward runs it as one); a wider tree does all that chain does.
    return chain, chain[: TREE_FROM - 1] + [max(s, chain[TREE_FROM - 2]) for s in tree[TREE_FROM - 1 :]]


TREE_FROM = 3  # the narrowest pass whose measured tree branches (the root with two children)


def measured_tree(width: int) -> TokenTree:
    """The tree a k-token tree pass times: the root and k - 1 nodes, each row's parent row (r - 1) // 2, so the
    root has two children and so does every node until the rows run out (depth about log2 k)."""
    return TokenTree([0] * (width - 1), [(row - 1) // 2 - 1 for row in range(1, width)])


def timed_widths(max_width: int, widths: Sequence[int] | None = None) -> list[int]:
    """The widths a measurement times: all of 1..max_width, or those of `widths` within it, ends included."""
    if widths is None:
        return list(range(1, max_width + 1))
    return sorted({1, max_width, *(w for w in widths if 1 <= w <= max_width)})


def _filled(seconds: dict[int, float], max_width: int) -> list[float]:
    """Every width's seconds, those not timed on the straight line between their timed neighbours."""
    timed = sorted(seconds)
    filled = []
    for width in range(1, max_width + 1):
        hi = next(w for w in timed if w >= width)
        lo = max((w for w in timed if w <= width), default=hi)
        t = (width - lo) / (hi - lo) if hi != lo else 0.0
        filled.append(seconds[lo] + t * (seconds[hi] - seconds[lo]))
    return filled


def non_decreasing(seconds: Sequence[float]) -> list[float]:
    """Each width's time capped by every wider width's: load spikes removed."""
    capped, lowest = [], float("inf")
    for s in reversed(seconds):
        lowest = min(lowest, s)
        capped.append(lowest)
    return capped[::-1]


def relative_costs(seconds: Sequence[float]) -> list[float]:
    """Cost of a k-token pass in units of a 1-token pass."""
    return [s / seconds[0] for s in seconds]


def curve_key(model_name: str, dtype: str) -> str:
    """e.g. "smollm2-135m-float32-cpu-openblas-matvec4-kernels-step8": the curve belongs to model, dtype,
    device and, on the CPU, akunu's CPU backend's revision together (they set what passes cost)."""
    return f"{model_name}-{dtype}-{backends.revision()}"


def default_dir() -> Path:
    return home() / "cost_curves"


def curve_path(key: str, directory: Path) -> Path:
    return directory / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', key)}.json"


@dataclass(frozen=True)
class CostCurves:
    """Seconds of a k-token pass, k = 1..n, after each measured context, as a chain and (where measured) as a token
    tree; `at` and `tree_at` read between them."""

    seconds: dict[int, list[float]]  # context -> seconds by width
    tree_seconds: dict[int, list[float]] = field(default_factory=dict)  # the same for tree passes (`measured_tree`)

    @property
    def widths(self) -> int:
        return min(len(s) for s in self.seconds.values())

    @property
    def has_trees(self) -> bool:
        """Whether tree passes were measured after every context the chains were."""
        return set(self.tree_seconds) >= set(self.seconds)

    def at(self, context: int) -> list[float]:
        """Relative pass costs after `context` tokens.

        A pass's time grows linearly with the context (attention reads every cached token), so
        the seconds are interpolated linearly, and extrapolated past the longest measured
        context (never below it); below the shortest they are the shortest's."""
        return relative_costs(_seconds_at(self.seconds, context, self.widths))

    def tree_at(self, context: int) -> list[float]:
        """Relative costs of tree passes of k = 1..n tokens (the root and k - 1 nodes) after `context` tokens, in
        units of a 1-token pass, as `at` reads chains; the chains' costs where trees were not measured."""
        chain = _seconds_at(self.seconds, context, self.widths)
        if not self.has_trees:
            return relative_costs(chain)
        widths = min(self.widths, *(len(s) for s in self.tree_seconds.values()))
        return [s / chain[0] for s in _seconds_at(self.tree_seconds, context, widths)]

    def tree_cost(self, width: int, context: int) -> float:
        """What a tree pass of `width` tokens (the root and width - 1 nodes) costs after `context` tokens, in units of
        a 1-token pass (within the measured widths)."""
        return self.tree_at(context)[width - 1]


def _seconds_at(seconds: dict[int, list[float]], context: int, widths: int) -> list[float]:
    """Seconds by width after `context` tokens, between the measured contexts (`CostCurves.at`), non-decreasing."""
    points = sorted(seconds)
    lo, hi = (points[0], points[0]) if len(points) == 1 or context <= points[0] else _bracket(points, context)
    t = (context - lo) / (hi - lo) if hi != lo else 0.0
    read = [a + t * (b - a) for a, b in zip(seconds[lo][:widths], seconds[hi][:widths])]
    if context > points[-1]:
        read = [max(s, last) for s, last in zip(read, seconds[hi])]
    return non_decreasing(read)


def _bracket(points: list[int], context: int) -> tuple[int, int]:
    """The measured contexts around `context` (the last two past the longest)."""
    for lo, hi in zip(points, points[1:]):
        if context <= hi:
            return lo, hi
    return points[-2], points[-1]


def costs_at(costs: CostCurves | Sequence[float] | None, context: int) -> list[float] | None:
    """The relative curve a generation at `context` drafts against (a plain curve is taken as is)."""
    if isinstance(costs, CostCurves):
        return costs.at(context)
    return list(costs) if costs else None


# The host work of a verification round (building its graph, drafting, reading the verdict) that a streamed plain step
# hides behind the pass before it (`akunu.decode.plain_steps`); BENCHMARKS.md has what it measured on the CPU.
ROUND_HOST_SECONDS = 1e-3


def round_cost_at(costs: CostCurves | Sequence[float] | None, context: int) -> float:
    """ROUND_HOST_SECONDS in units of a 1-token pass at `context` (0 where no pass was timed in seconds)."""
    if not isinstance(costs, CostCurves):
        return 0.0
    return ROUND_HOST_SECONDS / _seconds_at(costs.seconds, context, 1)[0]


def tree_costs_at(costs: CostCurves | Sequence[float] | None, context: int) -> list[float] | None:
    """The relative costs of tree passes at `context`, where trees were measured (else None: the policy assumes)."""
    if isinstance(costs, CostCurves) and costs.has_trees:
        return costs.tree_at(context)
    return None


def contexts_within(context_length: int | None) -> tuple[int, ...]:
    """The measured contexts that leave room for the widest pass in a model's context."""
    fitting = tuple(c for c in CONTEXTS if not context_length or c + MAX_WIDTH <= context_length)
    return fitting or (min(CONTEXTS),)


def measure_curves(
    model: nn.Module,
    max_width: int = MAX_WIDTH,
    sweeps: int = 7,
    contexts: Sequence[int] = CONTEXTS,
    widths: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> CostCurves:
    """`measure_passes` after each of `contexts`; `progress(done, total)` hears of every timed pass."""
    timed = timed_widths(max_width, widths)
    total = len(contexts) * (sweeps + 1) * (len(timed) + sum(w >= TREE_FROM for w in timed))
    done = 0

    def on_pass() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    measured = {context: measure_passes(model, max_width, sweeps, context, widths, on_pass) for context in contexts}
    return CostCurves({c: chain for c, (chain, _) in measured.items()}, {c: tree for c, (_, tree) in measured.items()})


def save(key: str, curves: CostCurves, directory: Path) -> Path:
    """Write the curves where `cached` finds them, replacing any earlier measurement (atomically)."""
    path = curve_path(key, directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    record = {
        "key": key,
        "seconds_by_context": {str(c): list(s) for c, s in sorted(curves.seconds.items())},
        "tree_seconds_by_context": {str(c): list(s) for c, s in sorted(curves.tree_seconds.items())},
    }
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    return path


def read_curves(path: Path) -> CostCurves:
    """The curves a record written by `save` holds, unchecked (a bad file raises)."""
    record = json.loads(Path(path).read_text())
    trees = record.get("tree_seconds_by_context", {})
    return CostCurves(
        {int(c): seconds for c, seconds in record["seconds_by_context"].items()},
        {int(c): seconds for c, seconds in trees.items()},
    )


def cached(
    model: nn.Module,
    key: str,
    directory: Path,
    max_width: int = MAX_WIDTH,
    contexts: Sequence[int] = CONTEXTS,
    progress: Progress | None = None,
) -> CostCurves:
    """Pass costs for k = 1..max_width (or more) after each of `contexts`, measured once and then
    read from disk.

    A first measurement is the quick one (QUICK_WIDTHS, few sweeps), so it takes seconds; a saved record
    that lacks a context or is too short for `max_width` (or was saved in an older format, or without tree
    passes) is measured again.
    """
    try:
        saved = read_curves(curve_path(key, directory))
        chosen = {c: saved.seconds[c] for c in contexts}
        trees = {c: saved.tree_seconds[c] for c in contexts}
        every = [*chosen.values(), *trees.values()]
        valid = all(isinstance(s, (int, float)) and 0 < s < float("inf") for curve in every for s in curve)
        if valid and all(len(curve) >= max_width for curve in every):  # zeros or text: measure again
            return CostCurves(chosen, trees)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    curves = measure_curves(model, max_width, QUICK_SWEEPS, contexts, widths=QUICK_WIDTHS, progress=progress)
    save(key, curves, directory)
    return curves


def widest_paying(costs: Sequence[float], most: int) -> int:
    """The draft ceiling the curve supports: the draft length (<= `most`) whose pass costs
    least per token when every draft lands. On Metal, where a 16-token pass costs about what
    a 1-token pass does, that is `most`; a curve that climbs steeply gives a lower ceiling."""
    widths = range(min(most, len(costs) - 1) + 1)
    return max(widths, key=lambda n: (n + 1) / costs[n])
