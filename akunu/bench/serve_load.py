"""A load test of an OpenAI-compatible server (`akunu bench serve-load`): C clients send R greedy chat requests
each, all at once; then every request is sent again alone, and each answer under load must equal its own.

Distinct prompts per client, so an answer handed to the wrong client shows. Without a base URL, `akunu serve`
is started on a free loopback port and stopped at the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from akunu.errors import AkunuError

TOPICS = ["rivers", "planets", "bread", "chess", "rain", "bridges", "owls", "tea"]
START_SECONDS = 300  # a first start may fetch the model and build the kernels


class ServeLoadError(AkunuError):
    """The server cannot be started or reached."""


@dataclass
class LoadResult:
    requests: int
    clients: int
    latencies: list[float]  # seconds, of the answered requests under load
    wall_seconds: float
    forward_passes: int | None  # from each answer's `akunu` statistics; None from another server
    failures: list[str] = field(default_factory=list)  # one line per request that got no answer
    mismatched: list[tuple[int, int]] = field(default_factory=list)  # (client, request) whose answers differ

    @property
    def passed(self) -> bool:
        return not self.failures and not self.mismatched and len(self.latencies) == self.requests

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def prompts(clients: int, requests: int) -> list[list[str]]:
    """Distinct prompts per client, so an answer handed to the wrong client shows."""
    return [[_question(c, r) for r in range(requests)] for c in range(clients)]


def _question(client: int, request: int) -> str:
    topic = TOPICS[(client + request) % len(TOPICS)]
    return f"Client {client} asks question {request}: name three facts about {topic} and the number {client * 10 + request}."


class Client:
    """Greedy chat requests to one server's OpenAI API (`base_url` ends with /v1)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600) -> None:
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {api_key}"} if api_key else {}
        )

    def model(self) -> str:
        """The server's first model; an error if the server cannot be reached or lists none."""
        listed = self._call("GET", "/models")
        models = listed.get("data") if isinstance(listed, dict) else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise ServeLoadError(f"no model listed at {self.base_url}/models")
        return models[0]["id"]

    def ask(self, model: str, prompt: str, max_tokens: int) -> tuple[str, float, int | None]:
        """(answer, seconds, forward passes or None)."""
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0}  # fmt: skip
        started = time.perf_counter()
        answer = self._call("POST", "/chat/completions", body)
        seconds = time.perf_counter() - started
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ServeLoadError("an answer without choices[0].message.content") from None
        passes = answer.get("akunu", {}).get("forward_passes") if isinstance(answer.get("akunu"), dict) else None
        return text, seconds, passes

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise ServeLoadError(f"HTTP {error.code} from {path}: {error_message(error)}") from None
        except (urllib.error.URLError, OSError) as error:
            raise ServeLoadError(f"cannot reach {self.base_url}: {getattr(error, 'reason', error)}") from None
        except ValueError:
            raise ServeLoadError(f"{path} answered with something other than JSON") from None


def error_message(error: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(error.read())["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError, OSError):
        return error.reason


def run(client: Client, *, clients: int, requests: int, max_tokens: int) -> LoadResult:
    """Send the load, then each request alone."""
    model = client.model()
    asked = prompts(clients, requests)

    def one_client(own: list[str]) -> list[tuple[str, float, int | None] | ServeLoadError]:
        return [_attempt(client.ask, model, prompt, max_tokens) for prompt in own]

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        under_load = list(pool.map(one_client, asked))
    result = LoadResult(clients * requests, clients, [], time.perf_counter() - started, None)
    passes = []
    for c, answers in enumerate(under_load):
        for r, answer in enumerate(answers):
            alone = _attempt(client.ask, model, asked[c][r], max_tokens)
            failed = next((a for a in (answer, alone) if isinstance(a, ServeLoadError)), None)
            if failed is not None:
                result.failures.append(f"client {c}, request {r}: {failed}")
                continue
            result.latencies.append(answer[1])
            passes.append(answer[2])
            if answer[0] != alone[0]:
                result.mismatched.append((c, r))
    result.forward_passes = sum(passes) if passes and None not in passes else None
    return result


def _attempt(ask: Callable[..., tuple], *args) -> tuple | ServeLoadError:
    try:
        return ask(*args)
    except ServeLoadError as error:
        return error


def start_server(
    model: str | None, queue_depth: int, log, extra: Sequence[str] = (), env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """`akunu serve` (with `extra` options, `env` added to its environment) on a free loopback port, its output
    into `log`; (the process, its /v1 URL) once /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "akunu", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--queue-depth", str(queue_depth), *(["--model", model] if model else []), *extra]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=None if env is None else os.environ | env)  # fmt: skip
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServeLoadError(f"akunu serve exited with status {process.returncode}: {_last_line(log)}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return process, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.2)
    stop_server(process)
    raise ServeLoadError(f"akunu serve did not answer /health within {START_SECONDS} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def server_log():
    """Where a started server's output goes: read back for the last line if it exits."""
    return tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")


def _last_line(log) -> str:
    log.flush()
    log.seek(0)
    lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
