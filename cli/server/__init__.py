"""`akunu serve`'s HTTP side: the Starlette app (app.py), the OpenAI wire format (openai_api.py), Anthropic's Messages API over it (anthropic_api.py), the MLX worker thread (worker.py) and its Prometheus metrics (metrics.py)."""

from akunu.cli.server.app import create_app
from akunu.cli.server.worker import Worker

__all__ = ["Worker", "create_app"]
