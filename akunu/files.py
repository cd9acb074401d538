"""Files a user named: read only when a regular file (a FIFO would block), written in one step when a regular
file, never by replacing what is not one.

An atomic write (a temporary file renamed over the target) keeps an interrupt from leaving half a file,
but a rename replaces whatever the name pointed at: a device would become a regular file, a symlink a
copy. So a symlink is followed to the file it names, and a device, a FIFO or a folder is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from akunu.errors import AkunuError


def write_atomically(path: Path, data: bytes, what: str) -> None:
    """Replace (or create) the regular file at `path`, or at the end of its symlinks, with `data`."""
    target = Path(os.path.realpath(path))
    refuse_special(path, f"cannot save {what} to")
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        temporary.write_bytes(data)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise AkunuError(f"cannot save {what} to {path}: {_cannot_create(target.parent, error)}") from None
    try:
        os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise AkunuError(f"cannot save {what} to {path}: {error.strerror or error}") from None


def _cannot_create(folder: Path, error: OSError) -> str:
    """Why no file could be made in `folder` (the save writes a new file there first): the folder's fault, named as
    such, not the bare errno of a name the user never gave."""
    reason = error.strerror or str(error)
    if error.errno == errno.ENOENT and folder.is_dir():  # e.g. /proc: a folder that takes no new files
        return f"the folder {folder} takes no new files"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"the folder {folder} is not writable ({reason})"
    return reason  # a missing folder's "No such file or directory" says it


def refuse_special(path: Path, doing: str) -> None:
    """An error if `path` names something other than a regular file (following symlinks); nothing if absent."""
    if (what := special_kind(path)) is not None:
        raise AkunuError(f"{doing} {path}: it is {what}, not a regular file")


def special_kind(path: Path) -> str | None:
    """What `path` is ("a FIFO", "a device", "a folder", ...) when it exists and is not a regular file (following
    symlinks); None for a regular file, or when absent or unreadable (the open itself then says why). A stat never
    blocks, where opening a FIFO does."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else kind(mode)


def kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "neither a file nor a folder"
