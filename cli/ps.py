"""`akunu ps`: the models a running `akunu serve` has loaded, read from its /v1/models (as `ollama ps`)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Annotated

import typer
from rich.markup import escape

from akunu.cli.console import stdout_console
from akunu.cli.models_command import human_size
from akunu.errors import AkunuError

EXAMPLES = """[bold]Examples[/]
  akunu ps                      the models loaded by the server on 127.0.0.1:8080
  akunu ps --port 9000 --all    every model it may serve, loaded or not"""


class ServerUnreachable(AkunuError):
    """No akunu serve answers at that address."""


def ps(
    port: Annotated[int, typer.Option(min=1, max=65535, help="The server's port.")] = 8080,
    host: Annotated[str, typer.Option(help="The server's address.")] = "127.0.0.1",
    api_key: Annotated[
        str | None,
        typer.Option(envvar="AKUNU_API_KEY", show_default=False, help="The server's API key, if it needs one."),
    ] = None,
    every: Annotated[bool, typer.Option("--all", help="Also the models it may serve that are not loaded.")] = False,
) -> None:
    """List the models a running akunu serve has loaded: size in memory, requests running, when each unloads."""
    listed = read_models(f"http://{host}:{port}", api_key)
    shown = [m for m in listed["data"] if every or m.get("state") in ("loaded", "loading", "unloading")]
    console = stdout_console()
    console.print(f"{'NAME':<28} {'SIZE':>9}  {'STATE':<10} {'RUNNING':>7}  UNTIL", highlight=False)
    for model in shown:
        size = human_size(model["size_bytes"]) if model.get("size_bytes") else "-"
        running = (
            f"{model.get('running', 0)}+{model['waiting']}" if model.get("waiting") else str(model.get("running", 0))
        )
        console.print(f"{escape(model['id']):<28} {size:>9}  {model.get('state', '?'):<10} {running:>7}  "
                      f"{until(model)}", highlight=False)  # fmt: skip
    memory = listed.get("memory") or {}
    if memory.get("used_bytes") is not None:
        budget = f" of {human_size(memory['max_bytes'])}" if memory.get("max_bytes") else ""
        resident = f" · process resident {human_size(memory['resident_bytes'])}" if memory.get("resident_bytes") else ""
        console.print(f"[dim]models hold {human_size(memory['used_bytes'])}{budget}{resident}[/]", highlight=False)


def until(model: dict) -> str:
    """When the model unloads, as ollama ps says it."""
    if model.get("state") != "loaded":
        return {"loading": "loading…", "unloading": "stopping…"}.get(model.get("state"), "-")
    if model.get("running") or model.get("waiting"):
        return "busy"
    expires = model.get("expires_at")
    if expires is None:
        return "forever"
    seconds = max(0, expires - time.time())
    if seconds < 60:
        return f"{seconds:.0f} seconds from now"
    if seconds < 3600:
        return f"{seconds / 60:.0f} minutes from now"
    return f"{seconds / 3600:.1f} hours from now"


def read_models(base_url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            listed = json.loads(response.read())
    except urllib.error.HTTPError as error:
        hint = " (give --api-key)" if error.code == 401 else ""
        raise ServerUnreachable(f"{base_url}/v1/models answered HTTP {error.code}{hint}") from None
    except (urllib.error.URLError, OSError) as error:
        raise ServerUnreachable(f"no akunu serve at {base_url}: {getattr(error, 'reason', error)}") from None
    except ValueError:
        raise ServerUnreachable(f"{base_url}/v1/models did not answer JSON") from None
    if not isinstance(listed, dict) or not isinstance(listed.get("data"), list):
        raise ServerUnreachable(f"{base_url}/v1/models is not a model list")
    return listed
