"""A load test on loopback: 16 clients x 4 greedy requests at once against `akunu serve` with the tiny model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "load_test.py"


def load_script():
    spec = importlib.util.spec_from_file_location("load_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_request_under_load_gets_its_own_answer(fake_engine, serve):
    server = serve("--queue-depth", "16")
    figures = load_script().run(f"{server.base_url}/v1", clients=16, requests=4, max_tokens=16, timeout=120)
    print(f"\nload test: {figures}")  # p50/p95 for the record (pytest -s)
    assert figures["answered"] == figures["requests"] == 64
    assert figures["mismatched"] == []  # each answer equals the same request sent alone
    assert len(fake_engine.streams) == 128  # 64 under load, 64 alone: none lost, none run twice
    prompts = {tuple(call["prompt"]) for call in fake_engine.streams}
    assert len(prompts) == 64  # every client's every question reached the engine
    assert 0 < figures["p50_s"] <= figures["p95_s"] <= figures["max_s"] < 120
