"""Record llama.cpp's logits and greedy tokens as test fixtures (tests never build or run llama.cpp).

    .venv/bin/python scripts/record_llama_cpp_fixtures.py --tiny            # every tiny architecture
    .venv/bin/python scripts/record_llama_cpp_fixtures.py --tiny qwen2 phi3
    .venv/bin/python scripts/record_llama_cpp_fixtures.py --real ~/.cache/akunu/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct.gguf

--tiny: per architecture, write tests/llama_cpp_tiny.py's GGUF (rebuilt from its seed by the test too), run
llama.cpp on its prompt and save tests/fixtures/llama_cpp/<arch>.npz (prompt logits as float16, greedy tokens).
--real: llama.cpp's first greedy tokens of a code prompt (tests/fixtures/llama_cpp/qwen2.5-coder-0.5b.json).
Needs llama-cpp-python in this environment (`pip install -e '.[llama-cpp]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "tests" / "fixtures" / "llama_cpp"
REAL_FIXTURE = FIXTURES / "qwen2.5-coder-0.5b.json"
REAL_PROMPT = (  # Qwen2.5's ChatML for one user turn, with the default system message its template adds
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
REAL_TOKENS = 24
# gemma4 does not scale attention scores (q and k are normalised instead), so llama.cpp's default f16 KV cache
# rounding alone moves its logits by about the test's tolerance; those record with an f32 cache.
F32_CACHE = {"gemma4"}


def open_llama(path: Path, context: int, f32_cache: bool = False):
    from llama_cpp import GGML_TYPE_F16, GGML_TYPE_F32, Llama

    cache_type = GGML_TYPE_F32 if f32_cache else GGML_TYPE_F16
    return Llama(model_path=str(path), n_ctx=context, n_batch=min(context, 512), logits_all=True, n_threads=2,
                 verbose=False, seed=0, type_k=cache_type, type_v=cache_type)  # fmt: skip


def greedy(llm, prompt: list[int], count: int) -> list[int]:
    """Greedy continuation, one token a step, from llama.cpp's own logits."""
    llm.reset()
    llm.eval(prompt)
    tokens = []
    for _ in range(count):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
    return tokens


def record_tiny(names: list[str]) -> None:
    from tests import llama_cpp_tiny as tiny

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in names or list(tiny.ARCHS):
        with tempfile.TemporaryDirectory() as folder:
            llm = open_llama(tiny.write(tiny.ARCHS[name], Path(folder) / f"{name}.gguf"), 64, name in F32_CACHE)
            llm.eval(tiny.PROMPT)
            logits = np.asarray(llm.scores[: len(tiny.PROMPT)], dtype=np.float32)
            tokens = greedy(llm, tiny.PROMPT, tiny.GREEDY_TOKENS)
        np.savez_compressed(FIXTURES / f"{name}.npz", logits=logits.astype(np.float16), tokens=np.asarray(tokens))
        print(f"{name}: logits {logits.shape}, greedy {tokens}")


def record_real(path: Path) -> None:
    llm = open_llama(path, 256)
    prompt_ids = llm.tokenize(REAL_PROMPT.encode(), add_bos=False, special=True)
    record = {"prompt": REAL_PROMPT, "prompt_ids": prompt_ids, "greedy": greedy(llm, prompt_ids, REAL_TOKENS)}
    FIXTURES.mkdir(parents=True, exist_ok=True)
    REAL_FIXTURE.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", nargs="*", metavar="ARCH", help="tiny architectures to record (default: all)")
    parser.add_argument("--real", type=Path, metavar="GGUF", help="the qwen2.5-coder-0.5b GGUF")
    args = parser.parse_args()
    if args.tiny is not None:
        record_tiny(args.tiny)
    if args.real:
        record_real(args.real)


if __name__ == "__main__":
    main()
