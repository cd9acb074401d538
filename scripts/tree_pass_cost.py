"""What a token-tree pass costs beside a chain of the same width, on the kernels and through MLX's masked attention.

    .venv/bin/python scripts/tree_pass_cost.py [--model qwen2.5-coder-0.5b] [--context 512] [--widths 1-33] [--sweeps 5]

For each width k: a chain pass of k tokens, a tree pass of the root and k - 1 nodes (`cost_curve.measured_tree`)
as akunu runs it, and the same tree with the CPU backend's tree route turned off (`backends.tree_pass` answering
None), so its mask goes through MLX's attention, as before the kernels took trees. The three are timed one after
another at every width, the widths swept back and forth; each kind's fastest sample is kept (the machine may be
shared), ms per pass: wall-clock time, and the CPU time of all the process's threads (`time.process_time`), which a
busy machine inflates less (other processes take turns on the cores, which stops the wall clock, not this one).
"""

from __future__ import annotations

import argparse
import time

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
import mlx.core as mx

from akunu import backends
from akunu.cost_curve import measured_tree
from akunu.drafters.tree import tree_forward
from akunu.forward import feed
from akunu.kv_cache import make_cache, rewind
from akunu.models import load_model


def widths(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def widths_list(text: str) -> list[int]:
    """e.g. "1-33" or "1,8,16-17"."""
    return [w for part in text.split(",") for w in widths(part)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--widths", type=widths_list, default=widths("1-33"))
    parser.add_argument("--sweeps", type=int, default=5)
    args = parser.parse_args()
    loaded = load_model(args.model)
    model, cache = loaded.model, make_cache(loaded.model)
    feed(model, cache, mx.zeros((args.context,), mx.uint32))
    kernel_route = backends.tree_pass

    def masked(width: int):
        backends.tree_pass = lambda *_: None
        try:
            return tree_forward(model, cache, 0, measured_tree(width))
        finally:
            backends.tree_pass = kernel_route

    kinds = {
        "chain": lambda w: model(mx.zeros((1, w), mx.uint32), cache=cache),
        "tree": lambda w: tree_forward(model, cache, 0, measured_tree(w)),
        "tree, masked": masked,
    }
    samples = {(kind, w): [] for kind in kinds for w in args.widths}
    for sweep in range(args.sweeps + 1):  # sweep 0 warms up
        for width in args.widths if sweep % 2 == 0 else reversed(args.widths):
            for kind, run in kinds.items():
                start, cpu = time.perf_counter(), time.process_time()
                mx.eval(run(width))
                if sweep:
                    samples[kind, width].append((time.perf_counter() - start, time.process_time() - cpu))
                rewind(cache, width)
    print(f"{args.model} ({loaded.dtype}), after {args.context} tokens; ms per pass, fastest of {args.sweeps}")
    for clock, name in enumerate(("wall-clock", "CPU time")):
        print(f"{name}:\n  k    chain     tree  tree/chain  tree, masked  masked/chain")
        for w in args.widths:
            chain, tree, masked_ms = (min(s[clock] for s in samples[kind, w]) * 1000 for kind in kinds)
            print(f"{w:3d} {chain:8.1f} {tree:8.1f} {tree / chain:10.2f} {masked_ms:13.1f} {masked_ms / chain:13.2f}")


if __name__ == "__main__":
    main()
