"""Where thresher keeps its state: the demo models, the artifact store, the embedded MLflow store.

Everything sits under one directory, ``$THRESHER_HOME`` or the user cache directory
(``$XDG_CACHE_HOME/thresher``, by default ``~/.cache/thresher``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def build_dir_atomically(final: Path) -> Iterator[Path]:
    """A fresh directory beside ``final`` to build into; when the block succeeds it replaces
    ``final`` by a rename, and it is removed whatever happens, so ``final`` is never partial."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)


def write_text_atomically(final: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``final`` and rename it into place, so a reader
    (or a run killed halfway) never sees a partial file."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}-", dir=final.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def tracking_store_uri() -> str:
    """The embedded MLflow store: a SQLite file under the state directory."""
    return f"sqlite:///{state_dir() / 'mlflow.db'}"


def tracking_artifacts_uri() -> str:
    """Where the embedded MLflow store keeps run artifacts."""
    return (state_dir() / "mlartifacts").as_uri()
