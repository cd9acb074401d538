"""Record llama.cpp's tokenizer test vectors as small fixtures: tests/fixtures/vocab/<family>.json.gz.

Also copies the published chat templates llama.cpp keeps (models/templates/, taken from the models' own
tokenizer_config.json) for the families akunu has no GGUF of here, into tests/fixtures/chat_templates/.

llama.cpp keeps vocabulary-only GGUFs of real model families with test inputs and the ids its tokenizer
gives (`models/ggml-vocab-*.gguf` with `.inp`/`.out`, encoded without BOS and with special-token parsing
off). The GGUFs are 1-16 MB each, so a fixture keeps only what the inputs can reach: every token whose text
occurs in them (in the form the tokenizer sees: GPT-2 byte symbols, or "▁" for spaces), the merges that
build such tokens, and every control, user-defined, unknown and byte token. Other ids keep their place
as unused placeholders, so ids are the original ones. The script checks that akunu gives the same ids from
the fixture as from the whole vocabulary.

With --llama-python (an interpreter that has llama-cpp-python), the ids llama.cpp ends generation on
(`llama_vocab_is_eog`) are recorded too, and the ids it gives texts holding special tokens, encoded as a
prompt is (BOS as the model asks, special-token strings parsed).

    .venv/bin/python scripts/record_tokenizer_vectors.py --models LLAMA_CPP/models \\
        [--llama-python .venv/bin/python [--real-model GGUF]]

LLAMA_CPP/models is llama.cpp's `models/` folder (in the llama-cpp-python sdist: vendor/llama.cpp/models).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from akunu.models.chat_template import ChatTemplate
from akunu.models.detokenizer import byte_level_alphabet
from akunu.models.gguf_file import read_gguf
from akunu.models.gguf_vocab import TokenType
from akunu.models.tokenizer import Tokenizer
from tests.vocab_fixtures import metadata_from_fixture

SDIST_MODELS = Path("/work/llamacpp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vocab"
TEMPLATE_FIXTURES = FIXTURES.parent / "chat_templates"
CHAT_TEMPLATES = (
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "Qwen3.5-4B",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "google-gemma-2-2b-it",
    "google-gemma-4-31B-it",
    "microsoft-Phi-3.5-mini-instruct",
    "openai-gpt-oss-120b",
    "mistralai-Mistral-Nemo-Instruct-2407",
)
SEPARATOR = "\n__ggml_vocab_test__\n"
SKIPPED = ("bert-",)  # WordPiece embedding vocabularies: not a generation tokenizer
# Texts tests/test_tokenizer_vectors.py encodes besides llama.cpp's inputs (special tokens as text, newline runs).
EXTRA_TEXTS = ["<|im_end|>", "<|turn>", "a<|tool_call>b", "</s>", "<s>", "\n\n\n", "Hi"]
KEPT_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN, TokenType.BYTE)

# Run by the llama-cpp-python interpreter: per GGUF, its end-of-generation ids and the ids of texts encoded
# as a prompt is (BOS as the model asks, special-token strings parsed).
_LLAMA_CPP_SNIPPET = """
import ctypes, json, sys, llama_cpp
llama_cpp.llama_backend_init()
out = {}
for path, texts in json.load(sys.stdin).items():
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    eog = [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    prompts = []
    for text in texts:
        data = text.encode()
        buffer = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buffer, len(buffer), True, True)
        prompts.append([text, list(buffer[:n])])
    out[path] = {"eog": eog, "prompts": prompts}
    llama_cpp.llama_model_free(model)
print(json.dumps(out))
"""
# A conversation rendered by each vocabulary's own chat template, for the prompt texts above.
SAMPLE_CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye now"},
]


def prompt_texts(metadata: dict[str, Any]) -> list[str]:
    """Texts holding the vocabulary's special tokens: its chat template's rendering (without BOS, which
    encoding adds), and its first control tokens between words."""
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type", []))
    controls = [t for t, kind in zip(tokens, types) if kind == TokenType.CONTROL and t][:4]
    texts = ["Hello " + " Hello ".join(controls) + " world\n\n"]  # not BOS first: llama.cpp would double it
    template = metadata.get("tokenizer.chat_template")
    if template:
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        eos_text = tokens[eos] if eos is not None else ""
        texts.append(ChatTemplate(template).render(SAMPLE_CHAT[1:], bos_token="", eos_token=eos_text))
    return texts


def read_cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 reading of `<gguf>.inp` and `<gguf>.out`."""
    raw = Path(f"{gguf}.inp").read_bytes().decode("utf-8")
    texts = raw.removesuffix(SEPARATOR).split(SEPARATOR)  # a separator at the very end opens no case
    lines = Path(f"{gguf}.out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != len(texts):
        raise SystemExit(f"{gguf}: {len(texts)} inputs but {len(lines)} outputs")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


def corpus(texts: list[str]) -> str:
    """The inputs in every form a tokenizer may see them, joined: raw, NFC, GPT-2 byte symbols, "▁" spaces."""
    symbol_of_byte = {byte: symbol for symbol, byte in byte_level_alphabet().items()}
    forms = []
    for text in texts:
        for variant in {text, unicodedata.normalize("NFC", text)}:
            forms.append(variant)
            forms.append("".join(symbol_of_byte[b] for b in variant.encode("utf-8")))
            forms.append("\u2581" + variant.replace(" ", "\u2581"))
            forms.append(" ".join("\u2581" + word for word in variant.split()))  # a word after a special token
    return "\n\u0000".join(forms)


def trimmed_metadata(metadata: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))]
    seen = corpus(texts)
    kept = {i for i, (token, kind) in enumerate(zip(tokens, types)) if kind in KEPT_TYPES or (token and token in seen)}
    merges = [m for m in metadata.get("tokenizer.ggml.merges", []) if _merged(m) in seen]
    fixture = {key: _plain(value) for key, value in metadata.items() if not _is_vocabulary(key)}
    fixture.update(
        {
            "vocab_size": len(tokens),
            "tokens": {i: tokens[i] for i in sorted(kept)},
            "token_type": {i: types[i] for i in sorted(kept) if types[i] != TokenType.NORMAL},
            "merges": merges,
        }
    )
    if "tokenizer.ggml.scores" in metadata:
        scores = metadata["tokenizer.ggml.scores"]
        fixture["scores"] = {i: float(scores[i]) for i in sorted(kept)}
    return fixture


def _merged(merge: str) -> str:
    cut = merge.find(" ", 1)
    return merge[:cut] + merge[cut + 1 :]


def _is_vocabulary(key: str) -> bool:
    return key in (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.scores",
    )


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def record(gguf: Path, metadata: dict[str, Any], llama_cpp: dict[str, Any] | None) -> dict[str, Any]:
    family = gguf.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
    cases = read_cases(gguf)
    texts = [text for text, _ in cases] + EXTRA_TEXTS + prompt_texts(metadata)
    fixture = {
        "family": family,
        "source": f"llama.cpp models/{gguf.name} with .inp/.out (llama-cpp-python 0.3.36 sdist)",
        "metadata": trimmed_metadata(metadata, texts),
        "cases": cases,
    }
    if llama_cpp is not None:
        fixture["llama_cpp_eog_ids"] = llama_cpp["eog"]
        fixture["llama_cpp_prompts"] = llama_cpp["prompts"]
    full = Tokenizer.from_gguf_metadata(metadata)
    small = Tokenizer.from_gguf_metadata(metadata_from_fixture(fixture))
    for text in texts:
        for parse_special in (False, True):
            if small.encode(text, parse_special=parse_special) != full.encode(text, parse_special=parse_special):
                raise SystemExit(f"{family}: the trimmed vocabulary encodes {text[:40]!r} differently")
    passed = sum(full.encode(text, add_bos=False, parse_special=False) == expected for text, expected in cases)
    print(f"{family:16s} {passed}/{len(cases)} cases as llama.cpp", file=sys.stderr)
    return fixture


def llama_cpp_results(python: str, texts_by_gguf: dict[str, list[str]]) -> dict[str, Any]:
    result = subprocess.run(
        [python, "-c", _LLAMA_CPP_SNIPPET], input=json.dumps(texts_by_gguf), check=True, capture_output=True, text=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


REAL_MODEL_CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Fix the bug:\n```python\ndef mean(xs):\n    return sum(xs) / len(xs) - 1\n```"},
    {"role": "assistant", "content": "```python\ndef mean(xs):\n    return sum(xs) / len(xs)\n```"},
    {"role": "user", "content": "Now the weather in Zürich, please 🌤"},
]
REAL_MODEL_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def record_real_model(path: Path, python: str, out: Path) -> None:
    """A real model's chat prompts (with and without tools) as llama.cpp encodes them, and its stop ids."""
    tokenizer = Tokenizer.from_gguf(path)
    texts = [
        tokenizer.apply_chat_template(REAL_MODEL_CHAT),
        tokenizer.apply_chat_template(REAL_MODEL_CHAT, tools=REAL_MODEL_TOOLS),
    ]
    result = llama_cpp_results(python, {str(path): texts})[str(path)]
    fixture = {"model": path.name, "llama_cpp_eog_ids": result["eog"], "llama_cpp_prompts": result["prompts"]}
    (out / f"real-{path.stem}.json").write_text(json.dumps(fixture, ensure_ascii=False, indent=1), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=SDIST_MODELS, help="llama.cpp's models/ directory")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python, to record its end-of-generation ids")
    parser.add_argument("--real-model", type=Path, help="a real GGUF whose prompt ids and stops to record too")
    args = parser.parse_args()
    if args.real_model and args.llama_python:
        record_real_model(args.real_model, args.llama_python, args.out)
    ggufs = [
        path
        for path in sorted(args.models.glob("ggml-vocab-*.gguf"))
        if Path(f"{path}.inp").exists() and not path.name.removeprefix("ggml-vocab-").startswith(SKIPPED)
    ]
    TEMPLATE_FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in CHAT_TEMPLATES:
        source = args.models / "templates" / f"{name}.jinja"
        (TEMPLATE_FIXTURES / source.name).write_bytes(source.read_bytes())
    metadata = {gguf: dict(read_gguf(gguf).metadata) for gguf in ggufs}
    texts = {str(gguf): prompt_texts(metadata[gguf]) for gguf in ggufs}
    llama_cpp = llama_cpp_results(args.llama_python, texts) if args.llama_python else {}
    args.out.mkdir(parents=True, exist_ok=True)
    for gguf in ggufs:
        fixture = record(gguf, metadata[gguf], llama_cpp.get(str(gguf)))
        target = args.out / f"{fixture['family']}.json.gz"
        data = json.dumps(fixture, ensure_ascii=False, sort_keys=True).encode("utf-8")
        target.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))


if __name__ == "__main__":
    main()
