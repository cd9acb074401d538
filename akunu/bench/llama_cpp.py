"""llama.cpp (through `llama-cpp-python`), when it is installed: its plain greedy decoding as a benchmark method,
and its teacher-forced predictions on a text (`akunu bench llama-cpp`).

It reads the same GGUF file as akunu and gets the same prompt ids, so both decode the same prompt;
its tokens are timed by the same code as akunu's (`timed_tokens`). llama.cpp is never a dependency.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np

from akunu.bench.agreement import CHUNK, Predictions
from akunu.bench.runner import Run

T = TypeVar("T")
MIN_CONTEXT = 4096  # a context every shipped prompt fits, so the model opens once


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version, or None when it cannot be imported."""
    try:
        import llama_cpp
    except (ImportError, OSError):  # OSError: the package is there but its shared library does not load
        return None
    return str(getattr(llama_cpp, "__version__", "unknown"))


def machine_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def in_own_thread(work: Callable[[], T]) -> T:
    """Run `work` on a short-lived thread.

    llama.cpp's OpenMP team belongs to the thread that calls it, and libgomp stops letting idle workers
    spin once it manages more threads than there are CPUs; a thread's team goes when the thread ends.
    """
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = work()
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="llama.cpp")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


class LlamaCppEngine:
    """llama.cpp's plain greedy decoding of one GGUF, opened on first use with a context that fits."""

    def __init__(self, path: Path, *, max_tokens: int, stop_ids: Collection[int], context_length: int | None = None,
                 threads: int | None = None, seed: int = 0) -> None:  # fmt: skip
        self.path, self.max_tokens, self.stop_ids = Path(path), max_tokens, frozenset(stop_ids)
        self.context_length, self.threads, self.seed = context_length, threads or machine_threads(), seed
        self._llm = None
        self._n_ctx = 0

    def open(self, longest_prompt: int) -> None:
        """Load the model now, with room for `longest_prompt` and the new tokens (it fails here, not mid-run)."""
        in_own_thread(lambda: self._open(longest_prompt + self.max_tokens))

    def run(self, prompt_ids: list[int]) -> Run:
        return in_own_thread(lambda: self._run(list(prompt_ids)))

    def _run(self, prompt_ids: list[int]) -> Run:
        from akunu.bench.engine import timed_tokens

        llm = self._open(len(prompt_ids) + self.max_tokens)
        llm.reset()  # decode the whole prompt every time, as akunu's runs do: no reuse of the last run's cache
        start = time.perf_counter()
        ids, prefill_seconds, decode_seconds = timed_tokens(start, self._tokens(llm, prompt_ids))
        return Run(ids, len(prompt_ids), prefill_seconds, decode_seconds)

    def _tokens(self, llm, prompt_ids: list[int]) -> Iterator[int]:
        """Greedy tokens until a stop token (not yielded, like akunu's) or max_tokens."""
        count = 0
        for token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            if int(token) in self.stop_ids:
                return
            yield int(token)
            count += 1
            if count >= self.max_tokens:
                return

    def _open(self, needed: int):
        if self._llm is None or needed > self._n_ctx:
            from llama_cpp import Llama

            n_ctx = max(MIN_CONTEXT, -(-needed // 1024) * 1024)
            self._n_ctx = min(n_ctx, self.context_length) if self.context_length else n_ctx
            self._llm = Llama(
                model_path=str(self.path), n_ctx=self._n_ctx, n_batch=512, n_threads=self.threads,
                n_threads_batch=self.threads, logits_all=False, seed=self.seed, verbose=False,
            )  # fmt: skip
        return self._llm


def tokenize(path: Path, text: str) -> list[int]:
    """llama.cpp's ids for `text` (special-token strings parsed, no BOS), from the file's vocabulary alone."""
    return in_own_thread(lambda: _tokenize(path, text))


def _tokenize(path: Path, text: str) -> list[int]:
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)  # llama.cpp's log of the load: our error says it
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True  # no weights and no context: nothing for llama.cpp to warn about
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ValueError("its loader refused the file")
    try:
        data = text.encode()
        buffer = (llama_cpp.llama_token * (len(data) + 8))()
        count = llama_cpp.llama_tokenize(llama_cpp.llama_model_get_vocab(model), data, len(data), buffer, len(buffer),
                                         False, True)  # fmt: skip
        if count < 0:
            raise ValueError(f"its tokenizer wants {-count} tokens' room for a text of {len(data)} bytes")
        return list(buffer[:count])
    finally:
        llama_cpp.llama_model_free(model)


def teacher_forced(path: Path, ids: list[int], threads: int | None = None) -> Predictions:
    """llama.cpp's top token and the log-probability of the actual next token at every position of `ids` but the last."""
    return in_own_thread(lambda: _teacher_forced(path, ids, threads or machine_threads()))


def _teacher_forced(path: Path, ids: list[int], threads: int) -> Predictions:
    from llama_cpp import Llama

    # logits_all keeps a (context x vocabulary) float32 array: the context is sized to the text, no more
    context = -(-len(ids) // CHUNK) * CHUNK
    llm = Llama(model_path=str(path), n_ctx=context, n_batch=min(context, 512), logits_all=True, n_threads=threads,
                n_threads_batch=threads, seed=0, verbose=False)  # fmt: skip
    llm.eval(ids)
    top, logprob = [], []
    for start in range(0, len(ids) - 1, CHUNK):
        stop = min(start + CHUNK, len(ids) - 1)
        logits = np.asarray(llm.scores[start:stop], dtype=np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=1))
        next_ids = np.asarray(ids[start + 1 : stop + 1])
        top.append(logits.argmax(axis=1))
        logprob.append(shifted[np.arange(len(next_ids)), next_ids] - log_norm)
    return Predictions(np.concatenate(top), np.concatenate(logprob))
