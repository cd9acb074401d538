"""Where one greedy decode step goes, by kind of operation, at a short and a long context.

    .venv/bin/python scripts/profile_step.py [--model smollm2-135m] [--contexts 64 1536] [--reps 15]

Each kind is timed alone, as the step runs it (same shapes, one graph, one evaluation):
weight matmuls (every Linear and the output head as matrix-vector products, stacked as the
fast step stacks them, quantized ones through akunu's kernel), norms,
RoPE (with the split of the q|k|v product into heads), attention over the cache, and the
elementwise rest (residual adds, SwiGLU). Norms, RoPE and SwiGLU run as the fast step runs them
(akunu's fused kernels, where they could be built; llama-family models).
"overhead" is the full step minus their sum: graph building, dispatch, reshapes, copies. (A compiled
llama step runs each half of a layer as one node, so its kinds cost less inside it than alone, and
its overhead can come out negative.)
The full step and attention are timed with akunu's fast step (akunu/backends/cpu/fast_step.py) on and
off. Timings interleave and report the minimum over --reps (the machine may be shared).
Then, with the fast step: "graph nodes" counts one step's graph, "graph build" is building it
in Python, nothing evaluated, and "decode loop" the time per token of `plain_decode` over 32 greedy tokens,
which queues each step before reading the last token: where it exceeds the step, host work
(the next graph's building among it) did not overlap the step's computation. Its ratio to the
weight matmuls pairs each run with the matmuls timed just before it.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import time
from collections.abc import Callable
from functools import partial

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from akunu.backends.cpu import compiled_pass, fast_step, fused_layers
from akunu.backends.cpu import kernels as cpu_kernels
from akunu.decode import plain_decode
from akunu.forward import prefill
from akunu.kv_cache import cache_length, make_cache, rewind
from akunu.models import load_model
from akunu.sampling import SamplingParams
from akunu.stats import GenerationStats


def linears(model: nn.Module) -> list[tuple[int, Callable[[mx.array], mx.array]]]:
    """Every product applied per token, output head included (tied or not), as the fast step applies it:
    stacked where fused_layers stacks them, quantized ones through akunu's kernel. Each as (input width, product)."""
    products, covered = [], set()
    for _, module in model.named_modules():
        for stack in fused_layers.stacks(module).values():
            if stack is None:
                continue
            covered.update(id(dict(arrays)["weight"]) for arrays in stack.held)
            if stack.transposed is not None:  # one float32 (in, outs) matrix
                products.append((stack.transposed.shape[0], partial(_times, stack.transposed)))
            else:  # quantized parts: the kernel's products, side by side
                part = stack.parts[0]
                products.append((part.packed.shape[1] * 32 // part.bits, stack))
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear) and id(m.weight) not in covered:
            products.append((m.weight.shape[1] * 32 // m.bits, m))
        elif isinstance(m, nn.Linear) and id(m.weight) not in covered:
            products.append((m.weight.shape[1], m))
    if not any(name.endswith("lm_head") for name, _ in model.named_modules()):
        embed = model.model.embed_tokens
        products.append((model.model.norm.weight.shape[0], embed.as_linear))
    return products


def _times(matrix: mx.array, rows: mx.array) -> mx.array:
    return rows @ matrix


def norms(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if "RMSNorm" in type(m).__name__]


def kinds(model: nn.Module, cache: list) -> dict[str, Callable[[], list[mx.array]]]:
    """Graph builders for each kind of work in one step, at the cache's current length."""
    layers = model.layers
    hidden = layers[0].self_attn.q_proj.weight.shape[1]
    x = mx.random.normal((1, 1, hidden))
    weight_products = linears(model)
    inputs = [mx.random.normal((1, width)) for width, _ in weight_products]
    norm_modules = norms(model)
    norm_inputs = [mx.random.normal((1, 1, m.weight.shape[0])) for m in norm_modules]
    attn = [layer.self_attn for layer in layers]
    heads = [(a.n_heads, a.n_kv_heads, a.q_proj.weight.shape[0] // a.n_heads) for a in attn]
    queries = [mx.random.normal((1, h, 1, d)) for h, _, d in heads]
    products = [mx.random.normal((1, (h + 2 * kv) * d)) for h, kv, d in heads]  # one token's q|k|v product
    inter = layers[0].mlp.gate_proj.weight.shape[0]
    gate_up = mx.random.normal((1, 2 * inter))
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    mx.eval(x, inputs, norm_inputs, queries, products, gate_up)
    module = __import__(type(model).__module__, fromlist=["scaled_dot_product_attention"])

    def attention() -> list[mx.array]:
        """As the fused layers run it where they can (the kernel reading the cache's buffers), else the module's."""
        out = []
        for a, c, q in zip(attn, cache, queries):
            if fused_layers.kernel_reads_cache(module.scaled_dot_product_attention, q, c, None):
                out.append(cpu_kernels.load().attention(q, c.keys, c.values, a.scale, False, c.offset, True))
                continue
            keys, values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            out.append(module.scaled_dot_product_attention(q, keys, values, cache=c, scale=a.scale, mask=None))
        return out

    def swiglu() -> mx.array:
        """The step's SwiGLU: on the gate|up product whole where the kernels are built."""
        kernels = cpu_kernels.load()
        return kernels.swiglu_halves(gate_up) if kernels else module.swiglu(gate, up)

    def rope() -> list[mx.array]:
        """Split into heads and rotate, as the fused attention does (one kernel, or views and one RoPE call)."""
        return [t for a, c, p in zip(attn, cache, products) for t in a.rotated_heads(p, 1, 1, c.offset)]

    return {
        "weight matmuls": lambda: [product(v) for v, (_, product) in zip(inputs, weight_products)],
        "norms": lambda: [m(v) for m, v in zip(norm_modules, norm_inputs)],
        "rope": rope,
        "attention": attention,
        "elementwise": lambda: [t for _ in layers for t in (x + x, x + x, swiglu())],
    }


def best_ms(run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def step_once(model: nn.Module, cache: list) -> Callable[[], mx.array]:
    token = mx.array([[100]], mx.uint32)

    def run() -> mx.array:
        logits = model(token, cache=cache)
        for c in cache:
            c.trim(1)  # keep the context length fixed across repetitions
        return mx.argmax(logits[0, -1])

    return run


def graph_build_ms(model: nn.Module, cache: list, reps: int) -> float:
    """Building one step's graph, not evaluating it: host time the decode loop must hide."""
    token, times = mx.array([[100]], mx.uint32), []
    for _ in range(reps):
        with compiled_pass.unqueued():  # building only: a compiled pass would be queued as it is built
            started = time.perf_counter()
            built = mx.argmax(model(token, cache=cache)[0, -1])
            times.append(time.perf_counter() - started)
        mx.eval(built)  # outside the timing, so unevaluated cache updates never pile up
        rewind(cache, 1)
    return min(times) * 1e3


def graph_nodes(model: nn.Module, cache: list) -> int:
    """How many nodes a decode step's graph holds (each costs a dispatch on MLX's CPU stream): the second
    step from here, since the first may grow the cache (every 256 positions) and the second is at a
    position whose RoPE tables are not cached yet, as in a decode."""
    token = mx.array([[100]], mx.uint32)
    mx.eval(model(token, cache=cache), [c.state for c in cache])
    with compiled_pass.unqueued():  # else the pass is evaluating already, and its nodes are not in the graph
        built = mx.argmax(model(token, cache=cache)[0, -1])
    text = io.StringIO()
    mx.export_to_dot(text, built)
    mx.eval(built)
    rewind(cache, 2)
    return len(re.findall(r"shape=rectangle", text.getvalue()))


def decode_loop_ms(model: nn.Module, cache: list, runs: int, matmuls: Callable[[], object], tokens: int = 32):
    """Per token of `plain_decode` over `tokens` greedy tokens, the cache rewound after each run; and its
    ratio to the weight matmuls timed just before each run (the median): the machine's speed drifts."""
    start, means, ratios = cache_length(cache), [], []
    for _ in range(runs):
        products = best_ms(matmuls, 3)
        loop = plain_decode(model, cache, model(mx.array([[100]], mx.uint32), cache=cache)[0, -1],
                            params=SamplingParams(), stats=GenerationStats())  # fmt: skip
        next(loop)  # the first token comes from the logits above, not from a step
        started = time.perf_counter()
        for _ in range(tokens):
            next(loop)
        means.append((time.perf_counter() - started) / tokens * 1e3)
        ratios.append(means[-1] / products)
        loop.close()
        mx.eval([c.state for c in cache])  # the step queued last
        rewind(cache, cache_length(cache) - start)
    return min(means), statistics.median(ratios)


def profile(model: nn.Module, context: int, reps: int) -> dict:
    cache = make_cache(model)
    mx.eval(prefill(model, cache, [100 + i % 1000 for i in range(context)]))
    nodes = graph_nodes(model, cache)  # first, before any step at these positions caches their RoPE tables
    work = kinds(model, cache)
    step = step_once(model, cache)
    timings: dict[str, list[float]] = {}
    for _ in range(reps):  # interleave every measurement, one repetition at a time
        for patched in (False, True):
            (fast_step.enable if patched else fast_step.disable)(model)
            tag = "fast" if patched else "mlx"
            timings.setdefault(f"step ({tag})", []).append(best_ms(step, 1))
            timings.setdefault(f"attention ({tag})", []).append(best_ms(work["attention"], 1))
        for name, run in work.items():
            if name != "attention":
                timings.setdefault(name, []).append(best_ms(run, 1))
    result = {name: round(min(values), 2) for name, values in timings.items()}
    for tag in ("mlx", "fast"):
        parts = (
            sum(result[k] for k in ("weight matmuls", "norms", "rope", "elementwise")) + result[f"attention ({tag})"]
        )
        result[f"overhead ({tag})"] = round(result[f"step ({tag})"] - parts, 2)
        result[f"step/matmuls ({tag})"] = round(result[f"step ({tag})"] / result["weight matmuls"], 3)
    fast_step.enable(model)
    result["graph nodes"] = nodes
    result["graph build"] = round(graph_build_ms(model, cache, reps), 2)
    loop, ratio = decode_loop_ms(model, cache, max(1, reps // 5), work["weight matmuls"])
    result["decode loop"], result["decode loop/matmuls"] = round(loop, 2), round(ratio, 3)
    return {"context": context, "matmuls": len(linears(model)), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 1536])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    was = fast_step.is_enabled(loaded.model)
    for context in args.contexts:
        print(
            json.dumps({"model": args.model, "dtype": loaded.dtype, **profile(loaded.model, context, args.reps)}),
            flush=True,
        )
    (fast_step.enable if was else fast_step.disable)(loaded.model)


if __name__ == "__main__":
    main()
