"""What tests/test_distributed.py runs under `mlx.launch`: one JSON line per rank on stdout.

`archs CASES PROMPT N`: tiny random models (seeded: every rank builds the same weights), or tiny GGUF
files (a case naming a `.gguf` path), split across the ranks, each decoding N tokens greedily, plain and
speculative, and in exact mode where the case asks; a tiny model's counted traffic beside the collectives
mlx was called for. `model SPEC DTYPE PROMPT N [SHARD]`: a model file loaded sharded (each rank reading its
part), the same two decodes, and the rank's peak memory.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys

import akunu  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx

from akunu import backends, distributed
from akunu.drafters.specs import DraftLengthPolicy
from akunu.generate import GenerationConfig, SpecConfig, generate


def decodes(model, tokenizer, prompt: list[int], max_tokens: int, *, exact: bool = False) -> dict[str, list[int]]:
    """Greedy ids, plain and speculative; with `exact`, in exact mode too."""
    ids = {}
    for mode, spec, exactly in (("plain", False, False), ("spec", True, False), ("exact-plain", False, True),
                                ("exact-spec", True, True))[: 4 if exact else 2]:  # fmt: skip
        spec_config = SpecConfig(enabled=spec, draft_tokens=4, draft_length=DraftLengthPolicy.fixed, exact=exactly)
        config = GenerationConfig(max_tokens=max_tokens, spec=spec_config)
        ids[mode] = generate(model, tokenizer, prompt, config)[1]
    return ids


def tiny_architectures(cases: list[list[str]], prompt: list[int], max_tokens: int) -> dict:
    from akunu.models import sharding
    from tests.fakes import FakeTokenizer
    from tests.tiny_archs import tiny_model

    results = {}
    for name, how, exact in cases:
        if name.endswith(".gguf"):
            results[name] = tiny_gguf(name, how, prompt, max_tokens)
            continue
        model = tiny_model(name)
        split = sharding.shard(model, distributed.group(), how)
        backends.apply(model)
        distributed.count_passes(model)
        distributed.traffic.reset()
        with called_collectives() as called:
            results[name] = {"split": split, **decodes(model, FakeTokenizer(), prompt, max_tokens, exact=exact)}
        counted = distributed.traffic
        results[name]["traffic"] = [counted.passes, counted.collectives, counted.bytes]
        results[name]["called"] = called
    return results


@contextlib.contextmanager
def called_collectives():
    """mlx's collectives as the passes call them: how many, the bytes this rank gives them (a receive gives none),
    and the tokens the all-gathers carry (a pipelined pass ends in one). A compiled pass calls them only once."""
    called = {"calls": 0, "bytes": 0, "tokens": 0}
    kept = {name: getattr(mx.distributed, name) for name in ("all_sum", "all_gather", "send", "recv_like")}

    def counting(name, collective):
        def call(x, *args, **kwargs):
            called["calls"] += 1
            called["bytes"] += 0 if name == "recv_like" else x.nbytes
            called["tokens"] += x.size // x.shape[-1] if name == "all_gather" else 0
            return collective(x, *args, **kwargs)

        return call

    for name, collective in kept.items():
        setattr(mx.distributed, name, counting(name, collective))
    try:
        yield called
    finally:
        for name, collective in kept.items():
            setattr(mx.distributed, name, collective)


def tiny_gguf(path: str, how: str, prompt: list[int], max_tokens: int) -> dict:
    """A GGUF file loaded split, as `akunu` loads it, with the names of the tensors this rank decoded."""
    from akunu.models import gguf_weights, load_model

    read, decode_part = [], gguf_weights._decode_part

    def recording(gguf_file, info, *rest):
        read.append(info.name)
        return decode_part(gguf_file, info, *rest)

    gguf_weights._decode_part = recording
    try:
        loaded = load_model(path, dtype="float32", shard=how)
    finally:
        gguf_weights._decode_part = decode_part
    return {"split": loaded.sharded, "read": read, **decodes(loaded.model, loaded.tokenizer, prompt, max_tokens)}


def model_file(spec: str, dtype: str, prompt: str, max_tokens: int, shard: str = "tensor") -> dict:
    from akunu.models import load_model

    loaded = load_model(spec, dtype=dtype, shard=shard)
    loaded_peak = mx.get_peak_memory()
    ids = loaded.tokenizer.encode(prompt)
    distributed.traffic.reset()
    result = decodes(loaded.model, loaded.tokenizer, ids, max_tokens)
    result["traffic"] = [distributed.traffic.passes, distributed.traffic.collectives, distributed.traffic.bytes]
    result["peak_mb"] = {
        "mlx_after_load": loaded_peak / 1e6,
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }
    return result


if __name__ == "__main__":
    kind, *arguments = sys.argv[1:]
    if kind == "archs":
        out = tiny_architectures(json.loads(arguments[0]), json.loads(arguments[1]), int(arguments[2]))
    else:
        out = model_file(arguments[0], arguments[1], arguments[2], int(arguments[3]), *arguments[4:])
    print(json.dumps({"rank": distributed.rank(), **out}), flush=True)
