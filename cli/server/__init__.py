"""`akunu serve`'s HTTP side: the Starlette app (app.py), the OpenAI wire format (openai_api.py) and the MLX worker thread (worker.py)."""

from akunu.cli.server.app import create_app
from akunu.cli.server.worker import Worker

__all__ = ["Worker", "create_app"]
