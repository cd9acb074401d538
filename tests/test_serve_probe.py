"""Issue 53's server faults, each through `akunu serve` on loopback with the tiny model: bad input is a 400
whose message names the field and fits on a line, never a 500 or a traceback."""

from __future__ import annotations

import json
import logging

import pytest

from tests.serve_fixtures import USER, raw_request


def error_of(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = raw_request(server.base_url, "POST", path, body)
    return status, json.loads(raw).get("error") or {}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": USER, "stop": ["ok", "\ud800"]}, "stop[1]"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field_without_a_traceback(fake_engine, serve, caplog, path, body, param):
    server = serve()
    with caplog.at_level(logging.INFO, logger="akunu.serve"):
        status, error = error_of(server, path, body)
    assert (status, error["param"]) == (400, param) and "lone surrogate" in error["message"]
    assert "\n" not in error["message"] and not any(record.exc_info for record in caplog.records)
