"""A fuzz test of `akunu serve` (hypothesis): random JSON bodies and field types, raw bytes, truncated and
oversized bodies, random headers. No 500, no traceback in the log, and /health answers throughout."""

from __future__ import annotations

import http.client
import json
import logging
from urllib.parse import urlparse

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve_fixtures import healthy, send_raw

EXAMPLES = 200
LIMIT = 16_384  # the server's --max-body here, so oversized bodies stay cheap to send
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/v1/nothing"]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice",
          "parallel_tool_calls", "response_format", "logit_bias", "presence_penalty", "echo", "suffix", "user"]  # fmt: skip

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
contents = (
    st.text(max_size=40)
    | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": scalars}), max_size=3)
    | json_values
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]) | scalars,
            "content": contents,
        },
        optional={"tool_call_id": scalars, "tool_calls": json_values, "name": scalars},
    ),
    max_size=4,
)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | scalars, "function": st.fixed_dictionaries(
    {"name": st.text(max_size=10) | scalars}, optional={"parameters": json_values, "description": scalars})}), max_size=3)  # fmt: skip
field_values = {
    "messages": messages | json_values,
    "tools": tools | json_values,
    "prompt": st.text(max_size=30) | json_values,
}
requests = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).flatmap(
    lambda base: st.fixed_dictionaries({k: field_values.get(k, st.just(v)) for k, v in base.items()})
)
# Requests a server should answer: random but well-typed fields on a valid chat or completion request.
weather = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
# A few texts, so prompt shapes repeat: each new shape costs MLX a first run, which would dominate the test's time.
texts = st.sampled_from(["write the alphabet", "hi", "ÑîÃã \x00 <|im_end|>"])
sampling = {"temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(0, 10), "seed": st.integers(0, 2**32),
            "stream": st.booleans(), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4), "model": st.just("tiny")}  # fmt: skip
plausible_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": texts}), min_size=1, max_size=2)},
    optional={**sampling, "logprobs": st.booleans(), "tools": st.just([weather]), "tool_choice": st.sampled_from(["auto", "none"])},
)  # fmt: skip
plausible_completion = st.fixed_dictionaries(
    {"prompt": texts | st.lists(st.integers(0, 63), min_size=4, max_size=4)},
    optional={**sampling, "logprobs": st.integers(0, 5)},
)
headers = st.dictionaries(
    st.sampled_from(["Content-Type", "Authorization", "Accept", "X-Anything", "Accept-Encoding", "Expect"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30), max_size=3,
)  # fmt: skip
bodies = st.one_of(
    requests.map(lambda r: ("json", r)),
    json_values.map(lambda v: ("json", v)),
    st.binary(max_size=200).map(lambda b: ("bytes", b)),
    requests.map(lambda r: ("truncated", r)),
    st.integers(LIMIT + 1, 50 * 2**20).map(lambda n: ("oversized", n)),
)
plausible = st.one_of(
    plausible_chat.map(lambda b: ("/v1/chat/completions", ("json", b))),
    plausible_completion.map(lambda b: ("/v1/completions", ("json", b))),
)
# About one case in ten a well-formed generation (each costs a forward pass or more), the rest malformed.
cases = st.integers(0, 9).flatmap(lambda i: plausible if i == 0 else st.tuples(st.sampled_from(PATHS), bodies))


def capped(body):
    """Long generations would only slow the test: token counts are kept small, whatever their type."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
                body[key] = body[key] % 4 + 1
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 3
    return body


def request(base_url: str, path: str, kind: str, body, extra_headers: dict) -> int | None:
    """Send one fuzzed request; the status, or None when the request was cut off on purpose."""
    url = urlparse(base_url)
    if kind == "truncated":
        data = json.dumps(capped(body)).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {len(data) + 100}\r\n\r\n"
        send_raw(base_url, head, data[: len(data) // 2], close_write=True)
        return None
    if kind == "oversized":
        head = f"POST {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {body}\r\n\r\n"
        answer = send_raw(base_url, head, b"{" * min(body, 2 * LIMIT))
        return int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/1.1 ") else None
    data = body if kind == "bytes" else json.dumps(capped(body)).encode()
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.request(
            "GET" if path in ("/v1/models", "/health") else "POST", path, body=data, headers=extra_headers
        )
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None  # e.g. a fuzzed header the client library refuses to send
    finally:
        connection.close()


def test_random_requests_never_get_a_500_nor_a_traceback(fake_engine, serve, caplog, capfd):
    server = serve("--max-body", str(LIMIT), "--max-tokens", "4", "--no-spec")
    statuses = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(case=cases, extra_headers=headers)
    def check(case, extra_headers):
        path, body = case
        status = request(server.base_url, path, *body, extra_headers)
        statuses.append((path, status))
        assert status is None or status < 500, (path, body, extra_headers, status)
        assert healthy(server.base_url)

    with caplog.at_level(logging.DEBUG):
        check()
    server.wait_idle()
    assert len(statuses) >= EXAMPLES
    generated = {status for path, status in statuses if path.endswith("completions")}
    assert {200, 400, 413} <= generated  # the fuzz reached generation as well as the checks and the limit
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in capfd.readouterr().err
