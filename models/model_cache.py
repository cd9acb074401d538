"""One catalogue entry's folder in the model cache: its lock, its integrity record, stale downloads.

A lock file per entry keeps two akunu processes from fetching, checking or removing the same
model at once; it lives beside the folder, so `rm` can delete the folder while holding it.
After a fetch the verified sha256 is recorded with the file's size and mtime; whenever those
no longer match, the file is hashed again before it is used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from akunu.errors import ModelError

RECORD_NAME = ".verified.json"
STALE_PREFIX = ".fetch-"  # fetch.py's temporary download folders
HASH_CHUNK = 1 << 22

OK, CORRUPT, MISSING = "ok", "corrupt", "missing"


class EntryBusy(ModelError):
    """Another akunu process holds this entry's lock."""


def lock_path(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


@contextlib.contextmanager
def hold(folder: Path, *, wait: bool = True, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the entry's exclusive lock; if another process has it, wait (or raise EntryBusy)."""
    path = lock_path(folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
    except OSError as error:
        raise ModelError(f"cannot use the model cache {path.parent}: {_cache_problem(folder, error)}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise EntryBusy(
                    f"{folder.name} is in use by another akunu process{_holder(handle)} "
                    "(a pull or a load); try again when it has finished"
                ) from None
            if on_wait:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        _write_pid(handle)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cache_problem(folder: Path, error: OSError) -> str:
    """Why the cache cannot be used; mkdir says only "File exists" for a symlink whose target is gone."""
    dangling = next((p for p in (folder, *folder.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is None:
        return error.strerror or str(error)
    return f"{dangling} is a symlink to {os.readlink(dangling)}, which does not exist (create it, or remove the link)"


def _write_pid(handle) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()


def _holder(handle) -> str:
    handle.seek(0)
    pid = handle.read().strip()
    return f" (pid {pid})" if pid.isdigit() else ""


def file_sha256(path: Path, progress: Callable[[int, int], None] | None = None) -> str:
    digest, done, total = hashlib.sha256(), 0, path.stat().st_size
    with open(path, "rb") as file:
        while chunk := file.read(HASH_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return digest.hexdigest()


def record(path: Path, sha256: str) -> None:
    """Remember that `path`, as it is now (size, mtime), hashed to `sha256`."""
    stat = path.stat()
    entry = {"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
    tmp = path.parent / f"{RECORD_NAME}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(entry))
        tmp.replace(path.parent / RECORD_NAME)
    except OSError:
        pass  # read-only cache: the file is simply hashed again next time


def _recorded(path: Path, sha256: str) -> bool:
    try:
        saved = json.loads((path.parent / RECORD_NAME).read_text())
        stat = path.stat()
        return saved == {"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
    except (OSError, ValueError):
        return False


def check(
    path: Path, size: int, sha256: str, *, rehash: bool = False, progress: Callable[[int, int], None] | None = None
) -> str:
    """OK, CORRUPT or MISSING; hashes the file when its record no longer matches (or `rehash`)."""
    try:
        actual_size = path.stat().st_size
    except FileNotFoundError:
        return MISSING
    except OSError as error:
        raise ModelError(f"cannot read {path}: {error.strerror or error}") from None
    if actual_size != size:
        return CORRUPT
    if not rehash and _recorded(path, sha256):
        return OK
    try:
        digest = file_sha256(path, progress)
    except OSError as error:
        raise ModelError(f"cannot read {path}: {error.strerror or error}") from None
    if digest != sha256:
        with contextlib.suppress(OSError):
            (path.parent / RECORD_NAME).unlink()  # it no longer vouches for this file
        return CORRUPT
    record(path, sha256)
    return OK


def clean_stale(folder: Path) -> int:
    """Remove interrupted downloads from `folder` (call it holding the lock); bytes freed."""
    if not folder.is_dir():
        return 0
    freed = 0
    for leftover in folder.glob(f"{STALE_PREFIX}*"):
        freed += sum(f.stat().st_size for f in leftover.rglob("*") if f.is_file())
        shutil.rmtree(leftover, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # only if nothing else is left
    return freed
