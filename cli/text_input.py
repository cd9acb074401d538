"""Text a user hands the CLI (files, stdin, options), read with a bound so that no input can exhaust memory.

The bound follows the model: no text longer than BYTES_PER_TOKEN bytes per token of its context can fit it,
so reading stops one byte past that and the run ends with one line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO

from akunu.errors import AkunuError, OptionsError, PromptError

BYTES_PER_TOKEN = 8  # a token of real text is 3-5 bytes; 8 leaves room for dense scripts
# Before a model is loaded its context is unknown: input is read up to what the longest context takes,
# then held to the model's own bound once it has loaded.
LONGEST_CONTEXT = 1 << 20
READ_LIMIT = BYTES_PER_TOKEN * LONGEST_CONTEXT


def text_limit(context_length: int) -> int:
    """The most bytes of text a model with this context can take."""
    return BYTES_PER_TOKEN * max(int(context_length), 1)


def too_long(source: str, read: int, limit: int) -> PromptError:
    tokens = limit // BYTES_PER_TOKEN
    context = "the longest context akunu reads" if limit >= READ_LIMIT else "the model's context"
    return PromptError(
        f"{source} is too long: {read:,} bytes read, over the limit of {limit:,} bytes"
        f" ({BYTES_PER_TOKEN} per token of {context}, {tokens:,} tokens)"
    )


def read_limited(stream: BinaryIO, limit: int, source: str) -> bytes:
    """At most `limit` bytes of `stream`; one byte more ends the run with one line."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise too_long(source, len(data), limit)
    return data


def decode_utf8(data: bytes, source: str, hint: str = "") -> str:
    """`data` as text; the first invalid byte named in one line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PromptError(f"{source} is not valid UTF-8 (byte {data[error.start]:#04x}){hint}") from None


def check_text(text: str, source: str, hint: str = "") -> str:
    """`text` if it is valid UTF-8; Python reads stray bytes of argv and stdin as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(text[error.start]) & 0xFF
        raise PromptError(f"{source} is not valid UTF-8 (byte {byte:#04x}){hint}") from None
    return text


def check_length(text: str, limit: int, source: str) -> str:
    """Text already in memory (an option, a line), held to the same bound as a file."""
    size = len(text.encode("utf-8", "surrogateescape"))
    if size > limit:
        raise too_long(source, size, limit)
    return text


def read_text_file(path: Path, limit: int, source: str, hint: str = "") -> str:
    """A regular text file, read with the bound; a device, a FIFO or a folder is refused before it is opened
    (a FIFO would block the open; text from a pipe comes on stdin)."""
    from akunu import files

    try:
        files.refuse_special(path, f"cannot read {source}")
    except AkunuError as error:
        raise PromptError(str(error)) from None
    try:
        with open(path, "rb") as stream:
            data = read_limited(stream, limit, f"{source} {path}")
    except OSError as error:
        raise PromptError(f"cannot read {source} {path}: {error.strerror or error}") from None
    return decode_utf8(data, f"{source} {path}", hint)


def read_stdin(limit: int, source: str, hint: str = "") -> str:
    """All of stdin, read with the bound."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a replaced text stream: read characters, still bounded
        text = sys.stdin.read(limit + 1)
        return check_text(check_length(text, limit, source), source, hint)
    return decode_utf8(read_limited(stream, limit, source), source, hint)


def read_line(prompt: str, limit: int) -> str:
    """input() for a stdin that is not a terminal: one line of at most `limit` bytes; EOFError at the end."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline(limit + 1)
    if not line:
        raise EOFError
    if len(line) > limit and not line.endswith("\n"):
        raise too_long("a line on stdin", len(line.encode("utf-8", "surrogateescape")), limit)
    return line.removesuffix("\n")


# Writing user files ----------------------------------------------------------------------------


def check_save_target(path: Path, option: str) -> None:
    """Refuse a device, a FIFO or a folder before the model loads (akunu.files would refuse it at the save)."""
    from akunu import files

    try:
        files.refuse_special(path, option)
    except AkunuError as error:
        raise OptionsError(str(error)) from None
