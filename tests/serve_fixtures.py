"""Running `akunu serve` for tests: the real command (uvicorn.run captured), then its app on a loopback port;
and the raw HTTP requests the serve tests send. The `serve` fixture (conftest.py) wraps `start`."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import uvicorn
from openai import OpenAI
from typer.testing import CliRunner

from akunu.cli.app import app as cli_app
from akunu.cli.server.model_pool import ModelPool

USER = [{"role": "user", "content": "write the alphabet"}]


class SlowModel:
    """The tiny model, `delay` seconds slower per forward pass, counting its passes."""

    def __init__(self, model, delay: float) -> None:
        self.model, self.delay, self.calls = model, delay, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay)
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@dataclass
class Running:
    base_url: str  # http://127.0.0.1:PORT
    worker: object  # the default model's, as loaded at start
    options: dict  # what the command passed to uvicorn.run (host, port, ...)
    pool: object = None  # the server's ModelPool

    def client(self, api_key: str = "none", **kwargs) -> OpenAI:
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def anthropic(self, api_key: str = "none", **kwargs):
        """The official `anthropic` client on this server (it sends the key as `Authorization: Bearer`)."""
        from anthropic import Anthropic  # only the Anthropic tests pay for its import

        return Anthropic(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.worker.running or self.worker.waiting:
            assert time.monotonic() < deadline, "the worker did not go idle"
            time.sleep(0.01)


@contextlib.contextmanager
def on_loopback(app):
    """Serve `app` with uvicorn in a thread on 127.0.0.1 and a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def run_serve_command(monkeypatch, *args: str) -> tuple[object, dict]:
    """`akunu serve ARGS` as a user runs it, up to the uvicorn.run call: returns (app, its keyword arguments).
    The caller stops its models (`app.state.pool.stop()`)."""
    captured: dict = {}
    with monkeypatch.context() as patch:  # the command stops its models once uvicorn returns; the caller does here
        patch.setattr(uvicorn, "run", lambda app, **options: captured.update(app=app, **options))
        patch.setattr(ModelPool, "stop", lambda self, timeout=10.0: None)
        result = CliRunner().invoke(cli_app, ["serve", *args])
    assert result.exit_code == 0, result.output
    return captured.pop("app"), captured


def start(stack: contextlib.ExitStack, monkeypatch, *args: str) -> Running:
    """Run the command, then its app on loopback; `stack` stops both."""
    app, options = run_serve_command(monkeypatch, *args)
    pool = app.state.pool
    stack.callback(pool.stop)
    return Running(stack.enter_context(on_loopback(app)), app.state.worker, options, pool)


def raw_request(
    base_url: str, method: str, path: str, body=None, headers=None, timeout: float = 30
) -> tuple[int, dict, bytes]:
    url = urlparse(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def connect(base_url: str) -> socket.socket:
    url = urlparse(base_url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def send_raw(
    base_url: str,
    head: str,
    body: bytes = b"",
    *,
    close_write: bool = False,
    repeat: int = 1,
    pause: threading.Event | None = None,
) -> bytes:
    """Write a hand-made request (the body `repeat` times, waiting for `pause` after the first); return whatever
    the server answers before it closes."""
    with connect(base_url) as sock:
        try:
            sock.sendall(head.encode())
            for index in range(repeat):
                sock.sendall(body)
                if pause is not None and index == 0:
                    pause.wait(60)
            if close_write:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server may answer and close before it has read everything
            pass
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and not close_write:
                    break
        except OSError:
            pass
        return answer


def healthy(base_url: str) -> bool:
    """/health answers 200 (within raw_request's timeout: a stalled server fails, it does not hang the test)."""
    status, _, _ = raw_request(base_url, "GET", "/health")
    return status == 200


def prompt_text(engine) -> str:
    """The text of the last prompt the fake engine was given."""
    return engine.loaded.tokenizer.decode(engine.streams[-1]["prompt"])
