"""What rolling back a recurrent state costs a verification pass, at 1, 4, 8 and 16 drafts.

    .venv/bin/python scripts/state_rollback_cost.py [--hidden 512] [--layers 8] [--context 256]

A hybrid model (Qwen3-Next layout: three gated-delta layers to one attention layer, random weights)
verifies n drafts in an (n + 1)-token pass. Its state layers roll back by a snapshot taken before the
pass (references to the state's arrays) and, when drafts were rejected after j accepted, by feeding
the j + 1 kept tokens again at the head of the next pass (`akunu.decode.verify_round`). Prints one
JSON line per draft length: the pass alone, the snapshot and restore, and the wider next pass for a
rejection halfway (j = n // 2), in milliseconds and relative to the pass. A pass that kept every
position's state instead (the other approach) would need each model's scan changed, so it is not
measured here.
"""

from __future__ import annotations

import argparse
import json
import time

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
import mlx.core as mx
from mlx_lm.models import qwen3_next

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
    options = parser.parse_args()
    model, cache = hybrid(options.hidden, options.layers), None
    cache = make_cache(model)
    mx.eval(run(model, mx.zeros((1, options.context), mx.uint32), cache))
    start = Snapshot(cache)

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


if __name__ == "__main__":
    main()
