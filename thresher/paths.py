"""Where thresher keeps its state: the demo models, the artifact store, the embedded MLflow store.

Everything sits under one directory, ``$THRESHER_HOME`` or the user cache directory
(``$XDG_CACHE_HOME/thresher``, by default ``~/.cache/thresher``).
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    """The root of thresher's state, created on first use."""
    root = os.environ.get("THRESHER_HOME")
    if root:
        path = Path(root)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(cache) / "thresher"
    path.mkdir(parents=True, exist_ok=True)
    return path


def demo_models_dir() -> Path:
    path = state_dir() / "demo-models"
    path.mkdir(parents=True, exist_ok=True)
    return path
