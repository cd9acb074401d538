"""Prompt caches kept on disk, so a restarted server prefills only what no earlier request did.

An entry is one prompt's KV cache, in a file named by the model's identity (name, file size and time,
dtype, backend revision) and a hash of the prompt's tokens. A new prompt loads the entry sharing the
most tokens with it and is cut back there, as in memory: one entry per conversation serves its next
turns, and other conversations that open with the same system prompt and tools. An entry whose tokens
begin a newer one's is deleted, so a growing conversation keeps one file.

File layout: magic, sha256 of the rest, header length, JSON header (identity, tokens, array dtypes and
shapes), then the arrays' bytes. Files are untrusted: one failing its checksum or shape checks is
reported, deleted and recomputed. The folder is shared with the user: only regular files that begin with the
magic are counted, evicted or deleted; anything else is named once and left alone, and no file is opened in a
way that blocks (a FIFO) or follows a symlink. Models with state layers (Mamba, gated delta) are not cached on disk:
a state cannot be cut back to a shared prefix, so it would need an entry per prefix.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from akunu import backends
from akunu.home import home
from akunu.kv_cache import cache_length, common_prefix, leaves, make_cache

log = logging.getLogger("akunu.disk_cache")

MAGIC = b"AKUNUKV1"
PREFIX = struct.Struct("<8s32sQ")  # magic, sha256 of header + payload, header length
MAX_HEADER = 64 * 1024**2
SUFFIX = ".kv"
DEFAULT_LIMIT = 2 * 1024**3
MIN_TOKENS = 256  # shorter prompts are not saved, nor loaded for fewer new tokens: a prefill does them as fast
# numpy has no bfloat16: its bits travel as uint16
DTYPES = {"float32": (mx.float32, np.float32), "float16": (mx.float16, np.float16), "bfloat16": (mx.bfloat16, np.uint16)}  # fmt: skip


class BadEntry(Exception):
    """An entry file that must not be used: torn, truncated, corrupted or of another model."""


class NotAnEntry(BadEntry):
    """A file in the folder that is not akunu's (not a regular file, or without its magic): left alone."""


def model_identity(name: str, path: Path, dtype: str) -> str:
    """A short hash of what a KV cache depends on: the model (by name, file size and time), dtype, backend."""
    try:
        info = os.stat(path)
        fingerprint = f"{info.st_size}:{info.st_mtime_ns}"
    except OSError:
        fingerprint = "-"
    text = "\0".join((name, str(Path(path).resolve()), fingerprint, dtype, backends.revision()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def open_store(model, name: str, path: Path, dtype: str, limit: int = DEFAULT_LIMIT) -> DiskPromptCache | None:
    """The model's prompt caches on disk (`directory()`), or None when its cache has state layers."""
    if not supports(make_cache(model)):
        log.info("prompt cache on disk off: this model's cache has state layers")
        return None
    return DiskPromptCache(directory(), model_identity(name, path, dtype), limit, model=model)


def directory() -> Path:
    """$AKUNU_PROMPT_CACHE, else AKUNU_HOME's prompt_cache: a benchmark starts from an empty folder of its own,
    while the models stay in the user's cache."""
    if configured := os.environ.get("AKUNU_PROMPT_CACHE"):
        return Path(configured).expanduser()
    return home() / "prompt_cache"


def kv_layout(model) -> list[tuple[str, int, int]]:
    """(dtype, heads, head size) of each array the model's cache holds, seen after a one-token pass: an entry
    that differs would fail in the model, not at loading."""
    cache = make_cache(model)
    model(mx.array([[0]], mx.uint32), cache=cache)
    arrays = [a for c in leaves(cache) for a in (c.keys, c.values)]
    return [(dtype_name(a), a.shape[1], a.shape[3]) for a in arrays]


def dtype_name(array: mx.array) -> str:
    return str(array.dtype).removeprefix("mlx.core.")


def supports(cache) -> bool:
    """Only plain KV layers: they are cut back to any prefix (see the module's docstring for states)."""
    return all(type(c) is KVCache for c in leaves(cache))


@dataclass
class Entry:
    path: Path
    size: int
    used: float  # the file's mtime, moved on each use: least recently used entries go first
    tokens: list[int] | None = None  # None for another model's entry (only its size counts)


@dataclass
class Pending:
    """A prompt's KV arrays copied out of MLX, for the writer thread."""

    tokens: list[int]
    arrays: list[np.ndarray]
    dtypes: list[str]


class DiskPromptCache:
    """The prompt caches of one model under `directory`, at most `limit` bytes in all (LRU); written by a thread."""

    def __init__(
        self, directory: Path, identity: str, limit: int, *, min_tokens: int | None = None, model=None
    ) -> None:
        """Loaded entries must match `model`'s `kv_layout`, found at the first load (no model: any shapes)."""
        self.directory, self.identity, self.limit, self.model = Path(directory), identity, limit, model
        self.layout: list | None = None
        self.min_tokens = MIN_TOKENS if min_tokens is None else min_tokens
        self.entries: dict[str, Entry] = {}
        self.enabled = True
        self._lock = threading.Lock()
        self._pending: queue.Queue = queue.Queue(maxsize=1)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as error:
            self._disable(error)
        self._writer = threading.Thread(target=self._write_loop, name="akunu-disk-cache", daemon=True)
        self._writer.start()

    def _disable(self, error: Exception) -> None:
        if self.enabled:
            log.warning("prompt cache on disk off: %s: %s", self.directory, getattr(error, "strerror", None) or error)
        self.enabled = False

    def _scan(self) -> None:
        foreign = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                info = os.lstat(path)
                if stat.S_ISDIR(info.st_mode):
                    continue  # a folder is no file of anyone's to count
                entry = Entry(path, info.st_size, info.st_mtime)
                if path.name.startswith(f"{self.identity}-"):
                    entry.tokens = read_header(path, self.identity)[0]["tokens"]
                else:
                    read_magic(path)
            except NotAnEntry:
                foreign.append(path.name)
            except BadEntry as error:
                self._discard(path, error)
            except OSError:
                pass  # gone meanwhile, or unreadable: not counted
            else:
                self.entries[path.name] = entry
        if foreign:
            log.warning("prompt cache folder %s: left alone %d file(s) that are not akunu's entries: %s",
                        self.directory, len(foreign), ", ".join(foreign[:5]) + (" …" if len(foreign) > 5 else ""))  # fmt: skip

    def _discard(self, path: Path, error: Exception) -> None:
        with self._lock:
            self.entries.pop(path.name, None)
        if isinstance(error, NotAnEntry):  # replaced by something else since the scan
            log.warning("prompt cache entry %s not used (%s); left alone", path.name, error)
            return
        log.warning("prompt cache entry %s not used (%s); deleted", path.name, error)
        with contextlib.suppress(OSError):
            path.unlink()

    def _own(self) -> list[Entry]:
        with self._lock:
            return [e for e in self.entries.values() if e.tokens is not None]

    def restore(self, prompt_cache, prompt: Sequence[int]) -> int:
        """Load into `prompt_cache` the entry sharing the most of `prompt` beyond what the cache holds already,
        when that is at least `min_tokens` more; return the prompt tokens it now holds from disk (0: none)."""
        if not self.enabled or not supports(prompt_cache.cache):
            return 0
        usable = list(prompt[:-1])  # the last token is always fed
        held = common_prefix(prompt_cache.tokens[: cache_length(prompt_cache.cache)], usable)
        candidates = [(common_prefix(e.tokens, usable), e) for e in self._own()]
        shared, entry = max(candidates, key=lambda pair: pair[0], default=(0, None))
        if entry is None or shared < held + self.min_tokens:
            return 0
        if self.layout is None and self.model is not None:
            self.layout = kv_layout(self.model)
        try:
            tokens, layers = read_entry(entry.path, self.identity, len(list(leaves(prompt_cache.cache))), self.layout)
        except FileNotFoundError:  # superseded by the writer thread meanwhile
            self._forget(entry)
            return 0
        except (BadEntry, OSError) as error:
            self._discard(entry.path, error)
            return 0
        for c, (keys, values) in zip(leaves(prompt_cache.cache), layers, strict=True):
            c.keys, c.values, c.offset = keys, values, keys.shape[2]
        cache = prompt_cache.cache
        cache.fed, cache.torn, cache.owed, cache.lag = len(tokens), False, [], None
        prompt_cache.tokens, prompt_cache.mark = tokens, None
        self._touch(entry)
        return shared

    def _touch(self, entry: Entry) -> None:
        entry.used = time.time()
        with contextlib.suppress(OSError, NotImplementedError):
            os.utime(entry.path, follow_symlinks=False)

    def save(self, prompt_cache, prompt: Sequence[int]) -> None:
        """Queue the KV cache of `prompt` for writing, when the cache holds it and no entry does yet.
        Runs on the MLX thread: it copies the arrays out, so the cache may be reused at once."""
        prompt = list(prompt)
        cache = prompt_cache.cache
        if not self.enabled or len(prompt) < self.min_tokens or not supports(cache):
            return
        if cache_length(cache) < len(prompt) or prompt_cache.tokens[: len(prompt)] != prompt:
            return  # a prefill stopped part way
        if any(e.tokens[: len(prompt)] == prompt for e in self._own()):
            return
        arrays = [a[..., : len(prompt), :] for c in leaves(cache) for a in (c.keys, c.values)]
        dtypes = [dtype_name(a) for a in arrays]
        if any(d not in DTYPES for d in dtypes):
            return
        arrays = [a.view(mx.uint16) if d == "bfloat16" else a for a, d in zip(arrays, dtypes, strict=True)]
        mx.eval(arrays)
        with contextlib.suppress(queue.Full):  # one write at a time; a prompt arriving meanwhile is skipped
            self._pending.put_nowait(Pending(prompt, [np.array(a) for a in arrays], dtypes))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until queued writes are on disk."""
        deadline = time.monotonic() + timeout
        while self._pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_loop(self) -> None:
        while (pending := self._pending.get()) is not None:
            try:
                if self.enabled:
                    self._write(pending)
            except Exception as error:  # noqa: BLE001  (a full disk, a folder made unwritable: serving goes on)
                self._disable(error)
            finally:
                self._pending.task_done()

    def _write(self, pending: Pending) -> None:
        header = json.dumps({
            "identity": self.identity, "tokens": pending.tokens,
            "arrays": [[d, list(a.shape)] for a, d in zip(pending.arrays, pending.dtypes, strict=True)],
        }).encode()  # fmt: skip
        size = PREFIX.size + len(header) + sum(a.nbytes for a in pending.arrays)
        if size > self.limit:
            return
        self._evict(self.limit - size)
        digest = hashlib.sha256(header)
        for array in pending.arrays:
            digest.update(memoryview(array).cast("B"))
        path = self.directory / f"{self.identity}-{token_hash(pending.tokens)}{SUFFIX}"
        replace_atomically(path, [PREFIX.pack(MAGIC, digest.digest(), len(header)), header, *pending.arrays])
        with self._lock:
            self.entries[path.name] = Entry(path, size, time.time(), pending.tokens)
        self._drop_superseded(pending.tokens)

    def _evict(self, room: int) -> None:
        """Delete least recently used entries until the rest fits in `room` bytes."""
        with self._lock:
            by_age = sorted(self.entries.values(), key=lambda e: e.used)
        total = sum(e.size for e in by_age)
        for entry in by_age:
            if total <= room:
                break
            total -= entry.size
            self._forget(entry)

    def _drop_superseded(self, tokens: list[int]) -> None:
        """An entry whose tokens begin `tokens` serves no prompt the new entry does not serve as far."""
        for entry in self._own():
            if len(entry.tokens) < len(tokens) and tokens[: len(entry.tokens)] == entry.tokens:
                self._forget(entry)

    def _forget(self, entry: Entry) -> None:
        with self._lock:
            self.entries.pop(entry.path.name, None)
        with contextlib.suppress(OSError):
            entry.path.unlink()

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued writes and end the writer thread (a daemon: a write still going ends with the process)."""
        self.flush(timeout)
        self.enabled = False
        with contextlib.suppress(queue.Full):
            self._pending.put_nowait(None)


def token_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:32]


def replace_atomically(path: Path, parts: list) -> None:
    """Write to a temporary file of its own, then rename it over `path`: two writers of one entry never tear it.
    No fsync: a file a power cut leaves torn fails its checksum."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            for part in parts:
                file.write(part)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def open_entry(path: Path):
    """`path` opened for reading if it is a regular file: never following a symlink, never blocking on a FIFO."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise NotAnEntry("a symlink") from None
        raise
    file = os.fdopen(descriptor, "rb")
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        file.close()
        raise NotAnEntry("not a regular file")
    return file


def read_magic(path: Path) -> None:
    """Nothing if `path` is a regular file beginning with akunu's magic; NotAnEntry otherwise."""
    with open_entry(path) as file:
        if file.read(len(MAGIC)) != MAGIC:
            raise NotAnEntry("not an akunu prompt cache entry")


def read_header(path: Path, identity: str) -> tuple[dict, int, bytes]:
    """(header, payload offset, digest) of an entry, checked to be this model's; NotAnEntry for a file that is no
    entry, BadEntry for a damaged or foreign one."""
    with open_entry(path) as file:
        prefix = file.read(PREFIX.size)
        if prefix[: len(MAGIC)] != MAGIC:
            raise NotAnEntry("not an akunu prompt cache entry")
        if len(prefix) < PREFIX.size:
            raise BadEntry("truncated")
        _, digest, length = PREFIX.unpack(prefix)
        if length > MAX_HEADER:
            raise BadEntry("header too long")
        try:
            header = json.loads(file.read(length))
        except (OSError, ValueError) as error:
            raise BadEntry(f"unreadable: {error}") from None
    if not isinstance(header, dict) or header.get("identity") != identity:
        raise BadEntry("another model's entry")
    tokens = header.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise BadEntry("no token list")
    return header, PREFIX.size + length, digest


def read_entry(
    path: Path, identity: str, layers: int, layout: list | None = None
) -> tuple[list[int], list[tuple[mx.array, mx.array]]]:
    """An entry's tokens and (keys, values) per layer, all checked (against `layout` when given): BadEntry if
    anything is off."""
    header, start, digest = read_header(path, identity)
    with open_entry(path) as file:
        data = file.read()
    if hashlib.sha256(memoryview(data)[PREFIX.size :]).digest() != digest:
        raise BadEntry("checksum mismatch: torn, truncated or corrupted")
    tokens, shapes = header["tokens"], header.get("arrays")
    if not isinstance(shapes, list) or len(shapes) != 2 * layers:
        raise BadEntry(f"{len(shapes) if isinstance(shapes, list) else 'no'} arrays for {layers} layers")
    arrays = []
    for index, item in enumerate(shapes):
        dtype, shape = item if isinstance(item, list) and len(item) == 2 else (None, None)
        if dtype not in DTYPES or not _positions_shape(shape, len(tokens)):
            raise BadEntry(f"an array of {dtype} {shape} does not hold {len(tokens)} positions")
        if layout is not None and (dtype, shape[1], shape[3]) != tuple(layout[index]):
            raise BadEntry(f"an array of {dtype} {shape} where the model holds {layout[index]}")
        mlx_type, numpy_type = DTYPES[dtype]
        count = int(np.prod(shape))
        if start + count * np.dtype(numpy_type).itemsize > len(data):
            raise BadEntry("truncated")
        array = mx.array(np.frombuffer(data, numpy_type, count, start).reshape(shape))
        arrays.append(array.view(mlx_type) if dtype == "bfloat16" else array)
        start += count * np.dtype(numpy_type).itemsize
    mx.eval(arrays)
    return tokens, list(zip(arrays[::2], arrays[1::2], strict=True))


def _positions_shape(shape, positions: int) -> bool:
    """(batch 1, heads, positions, head size), as mlx-lm's KVCache holds them."""
    return (
        isinstance(shape, list)
        and len(shape) == 4
        and all(type(n) is int and n > 0 for n in shape)
        and (shape[0] == 1 and shape[2] == positions)
    )
