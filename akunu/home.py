"""akunu's per-user directory: $AKUNU_HOME, else $XDG_CACHE_HOME/akunu, else ~/.cache/akunu."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Where models and measurements (cost curves, dtype timings) are kept."""
    if configured := os.environ.get("AKUNU_HOME"):
        return Path(configured).expanduser()
    cache_root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_root).expanduser() / "akunu"
