"""Run llama.cpp on one request; executed by the Python that has llama-cpp-python (numpy + llama_cpp only).

    /work/llamacpp/venv/bin/python scripts/llama_cpp_worker.py request.json

The request names a GGUF, token ids (or a text llama.cpp tokenizes with special tokens) and what to
return; the answer goes to the request's `out` (.npz). Called by record_llama_cpp_fixtures.py and
compare_llama_cpp.py, which run in akunu's environment.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from llama_cpp import GGML_TYPE_F16, GGML_TYPE_F32, Llama


def open_llama(path: str, context: int, f32_cache: bool = False) -> Llama:
    cache_type = GGML_TYPE_F32 if f32_cache else GGML_TYPE_F16
    return Llama(
        model_path=path,
        n_ctx=context,
        n_batch=min(context, 512),
        logits_all=True,
        n_threads=2,
        verbose=False,
        seed=0,
        type_k=cache_type,
        type_v=cache_type,
    )


def greedy(llm: Llama, prompt: list[int], count: int) -> list[int]:
    """Greedy continuation, one token a step, from llama.cpp's own logits."""
    llm.reset()
    llm.eval(prompt)
    tokens = []
    for _ in range(count):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
    return tokens


def teacher_forced(llm: Llama, ids: list[int], chunk: int = 256) -> dict[str, np.ndarray]:
    """Per position: llama.cpp's top token and the log-probability of the actual next token."""
    llm.reset()
    llm.eval(ids)
    top, logprob = [], []
    for start in range(0, len(ids) - 1, chunk):
        stop = min(start + chunk, len(ids) - 1)
        logits = np.asarray(llm.scores[start:stop], dtype=np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=1))
        next_ids = np.asarray(ids[start + 1 : stop + 1])
        top.append(logits.argmax(axis=1))
        logprob.append(shifted[np.arange(len(next_ids)), next_ids] - log_norm)
    return {"top": np.concatenate(top), "logprob": np.concatenate(logprob)}


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    llm = open_llama(request["gguf"], request.get("context", 512), request.get("f32_cache", False))
    ids = request.get("ids")
    if ids is None:
        ids = llm.tokenize(request["text"].encode(), add_bos=False, special=True)
    answer: dict[str, np.ndarray] = {"ids": np.asarray(ids)}
    if request.get("logits"):
        llm.eval(ids)
        answer["logits"] = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    if request.get("greedy"):
        answer["greedy"] = np.asarray(greedy(llm, ids, request["greedy"]))
    if request.get("teacher_forced"):
        answer.update(teacher_forced(llm, ids))
    np.savez(request["out"], **answer)


if __name__ == "__main__":
    main()
