"""The real coding agents on `akunu serve` with Qwen2.5-Coder-0.5B: `claude -p` (Claude Code) and `codex exec`
(Codex), each on a one-file task, where the npm packages are installed (.ci/run installs them into
.ci/agents; AKUNU_AGENTS_BIN names another folder of their executables). Each must exit 0, with no error
response from the server and at least one tool round trip. The flags keep their first request short (a short
system prompt, only a file-reading tool): the real clients' requests, at a cost the suite can pay."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.serve_fixtures import start

pytestmark = pytest.mark.real_model

MODEL = "qwen2.5-coder-0.5b"
CALC = 'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n'
BIN_FOLDERS = [os.environ.get("AKUNU_AGENTS_BIN"), Path(__file__).parents[1] / ".ci" / "agents" / "node_modules" / ".bin",
               "/opt/agents/node_modules/.bin"]  # fmt: skip


def agent(name: str) -> str:
    found = [Path(folder) / name for folder in BIN_FOLDERS if folder and (Path(folder) / name).exists()]
    path = str(found[0]) if found else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (npm install into .ci/agents, as .ci/run does)")
    return path


@pytest.fixture(scope="module")
def server(model_home):
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.ExitStack() as stack:
        monkeypatch.setenv("AKUNU_HOME", str(model_home))
        try:  # drafts of a fixed length: no pass costs to measure first; answers capped for a 0.5B model's loops
            # exact mode: drafts never move an answer's bits, so a session depends on its requests alone
            yield start(stack, monkeypatch, "--model", MODEL, "--max-tokens", "256", "--draft-length", "fixed",
                        "--draft-tokens", "4", "--exact")  # fmt: skip
        except AssertionError as error:
            pytest.skip(f"{MODEL} does not load: {str(error).splitlines()[0] if str(error) else error!r}")


def requests(server, endpoint: str, outcomes: str) -> int:
    """How many requests to `endpoint` ended in one of `outcomes` (a regex: ok, client_error, ...), by /metrics."""
    from tests.serve_fixtures import raw_request

    _, _, raw = raw_request(server.base_url, "GET", "/metrics")
    pattern = rf'akunu_requests_total{{endpoint="{re.escape(endpoint)}",outcome="(?:{outcomes})"}} (\S+)'
    return int(sum(float(count) for count in re.findall(pattern, raw.decode())))


@pytest.fixture
def task():
    """The one-file project, at a path that is the same at every run (it is in the prompt), and an empty home for
    the client's shell (a user's shell start-up files would print into the tool's output)."""
    folder = Path(tempfile.gettempdir()) / "akunu-agent-task"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "home").mkdir(parents=True)
    (folder / "calc.py").write_text(CALC)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_claude_code_reads_the_file_with_its_tool_and_answers(server, task, tmp_path):
    claude = agent("claude")
    env = {**os.environ, "HOME": str(task / "home"), "CLAUDE_CONFIG_DIR": str(tmp_path / "config"), "ANTHROPIC_BASE_URL": server.base_url,
           "ANTHROPIC_API_KEY": "none", "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",  # a 0.5B model's loop ends there
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # fmt: skip
    # the arguments spelled out, as for Codex: else the 0.5B model may invent a `limit` Claude Code refuses
    ask = (f'Call the Read tool with {{"file_path": "{task / "calc.py"}"}} and no other argument, '
           "then tell me what the function add returns.")  # fmt: skip
    command = [claude, "-p", ask, "--bare", "--system-prompt", "You are a coding agent. Call the Read tool to read files.",
               "--tools", "Read", "--max-turns", "4", "--output-format", "stream-json", "--verbose"]  # fmt: skip
    failed, answered = (
        requests(server, "/v1/messages", "client_error|server_error"),
        requests(server, "/v1/messages", "ok"),
    )
    run = subprocess.run(command, cwd=task, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    results = [block for event in events if event.get("type") == "user"
               for block in event["message"]["content"] if isinstance(block, dict) and block.get("type") == "tool_result"]  # fmt: skip
    assert any("return a + b" in json.dumps(result) for result in results), run.stdout[-2000:]  # the file came back
    assert events[-1]["type"] == "result" and events[-1]["is_error"] is False, events[-1]
    assert requests(server, "/v1/messages", "client_error|server_error") == failed
    assert requests(server, "/v1/messages", "ok") >= answered + 2  # the call, and an answer after its result


def test_codex_runs_a_command_to_read_the_file_and_answers(server, task, tmp_path):
    codex = agent("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(f'model = "{MODEL}"\nmodel_provider = "akunu"\n[model_providers.akunu]\n'
                                      f'name = "akunu"\nbase_url = "{server.base_url}/v1"\nwire_api = "responses"\n')  # fmt: skip
    (tmp_path / "instructions.md").write_text("You are a coding agent. Run shell commands with exec_command.")
    small = ["-c", f"model_instructions_file={tmp_path / 'instructions.md'}", "-c", "web_search=disabled",
             "--disable", "multi_agent", "--disable", "goals", "--disable", "apps", "--disable", "plugins",
             "--disable", "image_generation", "-c", "skills.include_instructions=false",
             "-c", "features.view_image=false", "-c", "tools.experimental_request_user_input.enabled=false",
             "-c", "include_environment_context=false", "-c", "model_context_window=32768"]  # fmt: skip
    # the arguments spelled out: else the 0.5B model copies the schema's descriptions in as values
    ask = (
        'Call exec_command with {"cmd": "cat calc.py"} and no other argument. Once you have its output, call no '
        "more tools: answer in one sentence what the function add returns."
    )
    command = [codex, "exec", "--skip-git-repo-check", "--ephemeral", "--json", *small, ask]
    failed, answered = (
        requests(server, "/v1/responses", "client_error|server_error"),
        requests(server, "/v1/responses", "ok"),
    )
    env = {**os.environ, "HOME": str(task / "home"), "CODEX_HOME": str(home)}
    run = subprocess.run(
        command, cwd=task, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert any(e.get("type") == "item.completed" for e in events), run.stdout[-2000:] + run.stderr[-2000:]
    assert requests(server, "/v1/responses", "client_error|server_error") == failed
    assert requests(server, "/v1/responses", "ok") >= answered + 2  # the call, and a turn after its output
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
