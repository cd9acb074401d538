"""Load test for `akunu serve` on loopback: C clients send R greedy chat requests each, all at once.

Checks that every request is answered with its own answer (each equals the same request sent
alone, one at a time, afterwards) and prints the latency percentiles. Without --base-url it starts
`akunu serve` on a free loopback port and stops it at the end.

    .venv/bin/python scripts/load_test.py --clients 16 --requests 4 --max-tokens 32
    .venv/bin/python scripts/load_test.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

TOPICS = ["rivers", "planets", "bread", "chess", "rain", "bridges", "owls", "tea"]


def prompts(clients: int, requests: int) -> list[list[str]]:
    """Distinct prompts per client, so an answer handed to the wrong client shows."""
    return [[f"Client {c} asks question {r}: name three facts about {TOPICS[(c + r) % len(TOPICS)]} and the number {c * 10 + r}."
             for r in range(requests)] for c in range(clients)]  # fmt: skip


def ask(client, model: str, prompt: str, max_tokens: int) -> tuple[str, float, dict]:
    """One greedy chat request: (answer, seconds, the akunu statistics)."""
    started = time.perf_counter()
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    return response.choices[0].message.content, time.perf_counter() - started, response.model_extra["akunu"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(
    base_url: str, *, clients: int, requests: int, max_tokens: int, api_key: str = "none", timeout: float = 600
) -> dict:
    """Send the load, then each request alone; return the figures and whether every answer matched."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    model = client.models.list().data[0].id
    asked = prompts(clients, requests)

    def one_client(own: list[str]) -> list[tuple[str, float, dict]]:
        return [ask(client, model, p, max_tokens) for p in own]

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        under_load = list(pool.map(one_client, asked))
    wall = time.perf_counter() - started
    latencies = [seconds for answers in under_load for _, seconds, _ in answers]
    alone = [[ask(client, model, p, max_tokens)[0] for p in own] for own in asked]
    mismatched = [
        (c, r) for c, answers in enumerate(under_load) for r, (text, _, _) in enumerate(answers) if text != alone[c][r]
    ]
    passes = sum(stats["forward_passes"] for answers in under_load for _, _, stats in answers)
    return {
        "requests": clients * requests,
        "answered": len(latencies),
        "clients": clients,
        "max_tokens": max_tokens,
        "p50_s": round(percentile(latencies, 0.50), 3),
        "p95_s": round(percentile(latencies, 0.95), 3),
        "max_s": round(max(latencies), 3),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(latencies) / wall, 2),
        "forward_passes": passes,
        "mismatched": mismatched,
    }


def start_server(model: str | None) -> tuple[subprocess.Popen, str]:
    """`akunu serve` on a free loopback port; returns once /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "akunu",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--queue-depth",
        "64",
    ]
    process = subprocess.Popen(command + (["--model", model] if model else []))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"akunu serve exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise SystemExit("akunu serve did not start within 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="A running server (default: start one on loopback).")
    parser.add_argument("--model", help="The model a started server loads (default: the default model).")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="Requests per client.")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    process, base_url = start_server(args.model) if args.base_url is None else (None, args.base_url)
    try:
        figures = run(base_url, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    print(json.dumps(figures))
    if figures["mismatched"] or figures["answered"] != figures["requests"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
