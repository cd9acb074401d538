"""What rolling back a recurrent state costs a verification pass, at 1, 4, 8 and 16 drafts.

    .venv/bin/python scripts/state_rollback_cost.py [--hidden 512] [--layers 8] [--context 256] [--exact]

A hybrid model (Qwen3-Next layout: three gated-delta layers to one attention layer, random weights)
verifies n drafts in an (n + 1)-token pass. Its state layers roll back by a snapshot taken before the
pass (references to the state's arrays) and, when drafts were rejected after j accepted, by feeding
the j + 1 kept tokens again at the head of the next pass (`akunu.decode.verify_round`). Prints one
JSON line per draft length: the pass alone, the snapshot and restore, and the wider next pass for a
rejection halfway (j = n // 2), in milliseconds and relative to the pass. A pass that kept every
position's state instead (the other approach) would need each model's scan changed, so it is not
measured here.

With --exact, it prints instead what exact mode's passes cost (`akunu.exact`): every pass is padded
to one width and its attention runs row by row, and the state layers take the pass's block of
tokens again from the block's start; each line gives the default pass of the same real tokens beside it.
"""

from __future__ import annotations

import argparse
import json
import time

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
import mlx.core as mx
from mlx_lm.models import qwen3_next

from akunu.exact import EXACT_MAX_DRAFT, exact_model
from akunu.kv_cache import Snapshot, make_cache, rewind, run


def hybrid(hidden: int, layers: int):
    mx.random.seed(0)
    heads = hidden // 64
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=hidden * 3,
        num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=64,
        linear_num_value_heads=heads, linear_num_key_heads=heads, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
        shared_expert_intermediate_size=0, mlp_only_layers=list(range(layers)), moe_intermediate_size=0,
        rms_norm_eps=1e-6, vocab_size=8192, rope_theta=1e6, partial_rotary_factor=0.25, max_position_embeddings=4096,
    )  # fmt: skip
    model = qwen3_next.Model(args)
    mx.eval(model.parameters())
    return model


def timed(fn, repeats: int) -> float:
    """Fastest of `repeats` runs, in ms (load only ever adds time)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--exact", action="store_true", help="the cost of exact mode's passes instead")
    options = parser.parse_args()
    model, cache = hybrid(options.hidden, options.layers), None
    cache = make_cache(model)
    mx.eval(run(model, mx.zeros((1, options.context), mx.uint32), cache))
    start = Snapshot(cache)
    if options.exact:
        return exact_costs(model, cache, options.repeats)

    def pass_of(width: int, snapshot: bool = False):
        saved = Snapshot(cache) if snapshot else None
        mx.eval(run(model, mx.zeros((1, width), mx.uint32), cache))
        rewind(cache, width)
        (saved or start).restore(cache)

    def rollback():
        Snapshot(cache).restore(cache)

    for drafts in (1, 4, 8, 16):
        width, kept = drafts + 1, drafts // 2 + 1
        for w in (width, width + kept):
            pass_of(w)  # warm up the shapes
        plain = timed(lambda width=width: pass_of(width), options.repeats)
        state = timed(rollback, options.repeats * 10)
        wider = timed(lambda width=width + kept: pass_of(width), options.repeats)
        print(json.dumps({
            "drafts": drafts, "pass_ms": round(plain, 3), "snapshot_restore_ms": round(state, 4),
            "refeed_ms": round(wider - plain, 3), "refeed_tokens": kept,
            "rejected_round_vs_pass": round((wider + state) / plain, 3),
        }))  # fmt: skip


def exact_costs(model, cache, repeats: int) -> None:
    """Per pass of 1 to width real tokens: the default pass and the exact one (padded to the width; a pass holding
    its block's earlier tokens again costs the same), rolled back after; relative to the default 1-token step."""
    exact = exact_model(model, EXACT_MAX_DRAFT)

    def pass_of(m, tokens: int):
        saved = Snapshot(cache)
        mx.eval(run(m, mx.zeros((1, tokens), mx.uint32), cache))
        rewind(cache, tokens)
        saved.restore(cache)

    for tokens in range(1, exact.width + 1):  # warm up the shapes
        pass_of(model, tokens), pass_of(exact, tokens)
    step = timed(lambda: pass_of(model, 1), repeats)
    for tokens in range(1, exact.width + 1):
        default = timed(lambda tokens=tokens: pass_of(model, tokens), repeats)
        fixed = timed(lambda tokens=tokens: pass_of(exact, tokens), repeats)
        print(json.dumps({
            "width": exact.width, "tokens": tokens, "default_pass_ms": round(default, 3), "exact_pass_ms": round(fixed, 3),
            "default_vs_step": round(default / step, 3), "exact_vs_step": round(fixed / step, 3),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
