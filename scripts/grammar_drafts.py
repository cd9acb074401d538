"""Schema-constrained requests with and without grammar drafts: tokens per pass and decode tok/s.

Each request is a chat prompt plus a JSON schema, decoded greedily three ways: plain (one token per
pass, masked), speculative with the drafter's drafts only (checked against the grammar), and
speculative with the tokens the grammar forces drafted too (jump-forward). Greedy output must be
the same every way (near-ties aside); each finished output must validate against its schema.

    .venv/bin/python scripts/grammar_drafts.py --model /work/models/qwen2.5-coder-0.5b-instruct.gguf
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
TICKET = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "severity": {"enum": ["low", "medium", "high", "critical"]},
        "component": {"enum": ["parser", "cli", "server", "docs"]},
        "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["title", "severity", "component", "steps"],
    "additionalProperties": False,
}
FUNCTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "parameters": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "type": {"enum": ["int", "str", "float", "bool", "list"]}},
                "required": ["name", "type"],
                "additionalProperties": False,
            },
            "maxItems": 4,
        },
        "returns": {"enum": ["int", "str", "float", "bool", "list", "None"]},
    },
    "required": ["name", "parameters", "returns"],
    "additionalProperties": False,
}
REQUESTS = [
    *[
        (f"Describe a software engineer from {city} as JSON.", PERSON)
        for city in ("Lagos", "Oslo", "Lima", "Pune", "Kyoto")
    ],
    *[
        (f"File a bug report as JSON: {bug}", TICKET)
        for bug in (
            "the parser crashes on empty files",
            "`--help` prints twice",
            "the server leaks a socket per request",
            "a broken link in the install guide",
            "numbers with exponents are read as strings",
            "the CLI ignores NO_COLOR",
            "the server answers 500 on a bad JSON body",
        )
    ],
    *[
        (f"Give the signature of a Python function that {task}, as JSON.", FUNCTION)
        for task in (
            "computes a moving average",
            "merges two sorted lists",
            "checks whether a string is a palindrome",
            "parses an ISO date",
            "retries a call with backoff",
            "counts words in a file",
            "flattens a nested list",
            "converts celsius to fahrenheit",
        )
    ],
]
MODES = {
    "plain": dict(spec=False, jump_forward=False),
    "drafter only": dict(spec=True, jump_forward=False),
    "drafter + grammar": dict(spec=True, jump_forward=True),
}


def run_mode(loaded, requests, mode: dict, max_tokens: int) -> dict:
    from akunu.generate import GenerationConfig, SpecConfig, generate
    from akunu.grammar import Constraint

    config = GenerationConfig(max_tokens=max_tokens, spec=SpecConfig(enabled=mode["spec"]))
    totals = {
        "tokens": 0,
        "passes": 0,
        "seconds": 0.0,
        "drafted": 0,
        "accepted": 0,
        "valid": 0,
        "finished": 0,
        "outputs": [],
    }
    for prompt, schema in requests:
        ids = loaded.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        constraint = Constraint.json_schema(schema, loaded.tokenizer, jump_forward=mode["jump_forward"])
        text, tokens, stats = generate(loaded.model, loaded.tokenizer, ids, config, constraint=constraint)
        totals["tokens"] += max(stats.generated_tokens + stats.ended_on_eos - 1, 0)  # as tokens_per_pass counts
        totals["passes"] += stats.forward_passes
        totals["seconds"] += stats.decode_seconds
        totals["drafted"] += stats.drafted
        totals["accepted"] += stats.accepted
        totals["outputs"].append(tokens)
        if stats.finish_reason == "stop":
            totals["finished"] += 1
            jsonschema.validate(json.loads(text), schema)
            totals["valid"] += 1
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="/work/models/qwen2.5-coder-0.5b-instruct.gguf", help="a catalogue name or a path"
    )
    parser.add_argument("--requests", type=int, default=len(REQUESTS), help="how many of the 20 requests to run")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="which decodings to run")
    args = parser.parse_args()
    from akunu.models import load_model

    loaded = load_model(args.model)
    requests = REQUESTS[: args.requests]
    print(f"# {loaded.name}: {len(requests)} schema-constrained requests, greedy, max {args.max_tokens} tokens")
    results = {}
    for name in args.modes:
        mode = MODES[name]
        started = time.perf_counter()
        r = results[name] = run_mode(loaded, requests, mode, args.max_tokens)
        print(
            f"{name:18} tokens/pass {r['tokens'] / max(r['passes'], 1):5.2f}  decode {r['tokens'] / r['seconds']:6.1f} tok/s"
            f"  drafted {r['drafted']:5d} accepted {r['accepted']:5d}  finished {r['finished']}/{len(requests)}"
            f" (all valid)  wall {time.perf_counter() - started:5.1f} s"
        )
    same = [all(out == outs[0] for out in outs) for outs in zip(*(r["outputs"] for r in results.values()))]
    print(f"greedy outputs equal in every mode run: {sum(same)}/{len(same)}")


if __name__ == "__main__":
    main()
