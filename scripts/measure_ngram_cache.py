"""Does a persistent n-gram cache (`--ngram-cache`) raise acceptance? Measured on shipped workloads.

    .venv/bin/python scripts/measure_ngram_cache.py [--categories chat,json] [--limit 8] [--max-tokens 128]

For each prompt, a cache is learned from greedy generations of the *other* prompts of its
category (leave-one-out, as a user's cache holds earlier, different conversations); then the
prompt runs with the plain n-gram drafter and with the cache, alternating. Prints acceptance,
tokens per forward pass, decode tok/s, and whether the output equals plain greedy decoding.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from shipped_runs import load_with_curves, options

from akunu.bench.workloads import select, shipped_workload
from akunu.drafters import make_drafter
from akunu.drafters.ngram_cache import NGramCache
from akunu.generate import GenerationConfig, SpecConfig, generate


def main() -> None:
    args = options(__doc__.splitlines()[0], "chat,json").parse_args()
    loaded, costs = load_with_curves(args.model)
    config = GenerationConfig(max_tokens=args.max_tokens, spec=SpecConfig(enabled=True))
    encode = lambda text: loaded.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    results = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for category in args.categories.split(","):
            prompts = [encode(p.text) for p in select(shipped_workload(), [category], args.limit)]
            outputs = [
                generate(loaded.model, loaded.tokenizer, ids, GenerationConfig(max_tokens=args.max_tokens))[1]
                for ids in prompts
            ]
            for index, ids in enumerate(prompts):
                cache_file = Path(tmp) / f"{category}-{index}.ngrams"
                learn_from_others(cache_file, prompts, outputs, index)
                for method in ("ngram", "ngram-cache", "ngram", "ngram-cache"):
                    drafter = make_drafter("ngram", ngram_cache=cache_file if method == "ngram-cache" else None)
                    _, tokens, stats = generate(
                        loaded.model, loaded.tokenizer, ids, config, drafter=drafter, costs=costs
                    )
                    results[category, method].append((stats, tokens == outputs[index]))
    report(results, args.categories.split(","))


def learn_from_others(cache_file: Path, prompts, outputs, index: int) -> None:
    """A cache holding every other prompt and its greedy answer, never this prompt's."""
    cache = NGramCache()
    for other, (ids, output) in enumerate(zip(prompts, outputs)):
        if other != index:
            cache.learn([*ids, *output])
    cache.save(cache_file)


def report(results, categories) -> None:
    print(f"{'category':9} {'method':12} {'accept':>7} {'tok/pass':>8} {'tok/s':>7} {'vs ngram':>8} same")
    for category in categories:
        base = statistics.median(s.decode_tps for s, _ in results[category, "ngram"])
        for method in ("ngram", "ngram-cache"):
            runs = results[category, method]
            drafted = sum(s.drafted for s, _ in runs)
            accept = sum(s.accepted for s, _ in runs) / drafted if drafted else 0.0
            per_pass = statistics.mean(s.tokens_per_pass for s, _ in runs)
            tps = statistics.median(s.decode_tps for s, _ in runs)
            same = "yes" if all(ok for _, ok in runs) else "NO"
            print(f"{category:9} {method:12} {accept:7.2f} {per_pass:8.2f} {tps:7.1f} {tps / base:7.2f}x {same}")


if __name__ == "__main__":
    main()
