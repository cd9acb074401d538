"""Per-token cost of the JSON-schema grammar libraries akunu could use, on a real model's vocabulary.

For each library installed (llguidance, xgrammar, outlines-core), each schema is compiled for the
tokenizer of the given GGUF file, then a valid document, tokenized as the model would write it,
is walked token by token: compute the next-token mask, consume the token. Reported: the tokenizer
set-up time, each schema's compile time, and the mean time of one mask + advance.

    .venv/bin/python scripts/grammar_libraries.py /work/models/qwen2.5-coder-0.5b-instruct.gguf

xgrammar imports torch (and needs triton on Linux); to measure it without installing torch, run
from a venv that has it, or with `--torch-stub DIR`, a directory holding a minimal `torch` module
(xgrammar fills any DLPack int32 array).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SCHEMAS = {
    "person": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer"},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "qty", "price"],
                        "additionalProperties": False,
                    },
                },
                "note": {"type": ["string", "null"]},
            },
            "required": ["id", "status", "items", "note"],
            "additionalProperties": False,
        },
        {
            "id": 1042,
            "status": "shipped",
            "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-3", "qty": 1, "price": 120.0}],
            "note": None,
        },
    ),
    "tool_call": (
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
    ),
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance

        self.llg = llguidance
        wrapper = llguidance.TokenizerWrapper(_GuidanceTokenizer(tokenizer))
        self.tokenizer = llguidance.LLTokenizer(wrapper)
        self.mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def step(self, matcher, token: int) -> None:
        matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        assert self.mask[token // 32] >> (token % 32) & 1, "the grammar refused a valid document's token"
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(
            list(tokenizer.token_bytes), vocab_size=tokenizer.vocab_size, stop_token_ids=sorted(tokenizer.eos_ids)
        )
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return self.xgr.GrammarMatcher(compiled)

    def step(self, matcher, token: int) -> None:
        matcher.fill_next_token_bitmask(self.mask)
        assert self.mask[0, token // 32] >> (token % 32) & 1, "the grammar refused a valid document's token"
        assert matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer) -> None:
        import outlines_core

        self.oc = outlines_core
        eos = min(tokenizer.eos_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for token, raw in enumerate(tokenizer.token_bytes):
            if token not in tokenizer.eos_ids and raw:
                by_bytes.setdefault(raw, []).append(token)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)
        self.mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def step(self, guide, token: int) -> None:
        guide.write_mask_into(self.mask.ctypes.data, self.mask.size, self.mask.itemsize)
        assert self.mask[token // 32] >> (token % 32) & 1, "the grammar refused a valid document's token"
        guide.advance(token)


class _GuidanceTokenizer:
    """What llguidance's TokenizerWrapper reads: the bytes of every token, EOS/BOS and an encoder."""

    def __init__(self, tokenizer) -> None:
        self.tokens = list(tokenizer.token_bytes)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_bos=False)


def measure(library, tokenizer, repeats: int) -> dict:
    row = {}
    for name, (schema, document) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(document, separators=(",", ":")), add_bos=False)
        start = time.perf_counter()
        library.compile(schema)
        compile_ms = (time.perf_counter() - start) * 1e3
        per_token = []
        for _ in range(repeats):
            matcher = library.compile(schema)
            start = time.perf_counter()
            for token in tokens:
                library.step(matcher, token)
            per_token.append((time.perf_counter() - start) / len(tokens) * 1e6)
        row[name] = {"tokens": len(tokens), "compile_ms": compile_ms, "us_per_token": statistics.median(per_token)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="+", type=Path, help="GGUF files whose tokenizers to measure on")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-stub", type=Path, help="a directory with a stand-in torch module for xgrammar")
    args = parser.parse_args()
    from akunu.models.tokenizer import Tokenizer

    if args.torch_stub:  # after tvm_ffi, which would take the stub for torch
        import tvm_ffi  # noqa: F401

        sys.path.insert(0, str(args.torch_stub))
    for path in args.gguf:
        tokenizer = Tokenizer.from_gguf(path)
        print(f"# {path.name}: {tokenizer.vocab_size} tokens")
        for kind in (Llguidance, Xgrammar, OutlinesCore):
            try:
                start = time.perf_counter()
                library = kind(tokenizer)
                setup_s = time.perf_counter() - start
            except ImportError as error:
                print(f"{kind.name}: not measured ({error})")
                continue
            for schema, r in measure(library, tokenizer, args.repeats).items():
                print(
                    f"{kind.name:14} tokenizer set-up {setup_s:6.2f} s  {schema:10} compile {r['compile_ms']:8.1f} ms"
                    f"  {r['us_per_token']:8.1f} us/token (mask + advance, {r['tokens']} tokens)"
                )


if __name__ == "__main__":
    main()
