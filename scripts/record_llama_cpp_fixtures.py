"""Record llama.cpp's logits and greedy tokens as test fixtures (tests never build or run llama.cpp).

    .venv/bin/python scripts/record_llama_cpp_fixtures.py --tiny            # every tiny architecture
    .venv/bin/python scripts/record_llama_cpp_fixtures.py --tiny qwen2 phi3
    .venv/bin/python scripts/record_llama_cpp_fixtures.py --real /work/models/qwen2.5-coder-0.5b-instruct.gguf

--tiny: per architecture, write tests/llama_cpp_tiny.py's GGUF (rebuilt from its seed by the test too), run
llama.cpp on its prompt and save tests/fixtures/llama_cpp/<arch>.npz (prompt logits as float16, greedy tokens).
--real: llama.cpp's first greedy tokens of a code prompt (tests/fixtures/llama_cpp/qwen2.5-coder-0.5b.json).
llama.cpp runs in its own environment (--llama-python) through scripts/llama_cpp_worker.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "tests" / "fixtures" / "llama_cpp"
WORKER = Path(__file__).with_name("llama_cpp_worker.py")
# The Python whose environment has llama-cpp-python: $LLAMA_CPP_PYTHON, else this one (`pip install -e '.[llama-cpp]'`).
LLAMA_PYTHON = os.environ.get("LLAMA_CPP_PYTHON", sys.executable)
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


def run_llama_cpp(llama_python: str, request: dict) -> dict[str, np.ndarray]:
    """Run the worker on one request in llama.cpp's environment; its answer as arrays."""
    with tempfile.TemporaryDirectory() as folder:
        request_path, out = Path(folder) / "request.json", Path(folder) / "answer.npz"
        request_path.write_text(json.dumps({**request, "out": str(out)}))
        subprocess.run([llama_python, str(WORKER), str(request_path)], check=True)
        with np.load(out) as answer:
            return {key: answer[key] for key in answer.files}


def record_tiny(names: list[str], llama_python: str) -> None:
    from tests import llama_cpp_tiny as tiny

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in names or list(tiny.ARCHS):
        with tempfile.TemporaryDirectory() as folder:
            path = tiny.write(tiny.ARCHS[name], Path(folder) / f"{name}.gguf")
            request = {
                "gguf": str(path),
                "context": 64,
                "ids": tiny.PROMPT,
                "logits": True,
                "greedy": tiny.GREEDY_TOKENS,
                "f32_cache": name in F32_CACHE,
            }
            answer = run_llama_cpp(llama_python, request)
        np.savez_compressed(
            FIXTURES / f"{name}.npz", logits=answer["logits"].astype(np.float16), tokens=answer["greedy"]
        )
        print(f"{name}: logits {answer['logits'].shape}, greedy {answer['greedy'].tolist()}")


def record_real(path: Path, llama_python: str) -> None:
    answer = run_llama_cpp(
        llama_python, {"gguf": str(path), "context": 256, "text": REAL_PROMPT, "greedy": REAL_TOKENS}
    )
    record = {"prompt": REAL_PROMPT, "prompt_ids": answer["ids"].tolist(), "greedy": answer["greedy"].tolist()}
    FIXTURES.mkdir(parents=True, exist_ok=True)
    REAL_FIXTURE.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", nargs="*", metavar="ARCH", help="tiny architectures to record (default: all)")
    parser.add_argument("--real", type=Path, metavar="GGUF", help="the qwen2.5-coder-0.5b GGUF")
    parser.add_argument("--llama-python", default=LLAMA_PYTHON, help="a Python with llama-cpp-python")
    args = parser.parse_args()
    if args.tiny is not None:
        record_tiny(args.tiny, args.llama_python)
    if args.real:
        record_real(args.real, args.llama_python)


if __name__ == "__main__":
    main()
