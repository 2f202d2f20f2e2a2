"""Resolve a model source (hub id, local dir, ``models:/name/version``, ``demo:size``) to a directory.

Every later step works on a local snapshot; its content hash keys the artifact store.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from thresher.errors import ModelError
from thresher.formats.artifact import PROVENANCE

DEMO_PREFIX = "demo:"
REGISTRY_PREFIX = "models:/"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "demo" | "registry" | "local" | "hub"
    value: str


def parse_model_source(text: str) -> ModelSource:
    if text.startswith(DEMO_PREFIX):
        return ModelSource("demo", text[len(DEMO_PREFIX) :])
    if text.startswith(REGISTRY_PREFIX):
        return ModelSource("registry", text[len(REGISTRY_PREFIX) :])
    if os.path.exists(text) or text.startswith((".", "/", "~")):
        return ModelSource("local", str(Path(text).expanduser()))
    return ModelSource("hub", text)


def resolve_model(text: str) -> Path:
    """A local directory holding config.json and weights for ``text``."""
    src = parse_model_source(text)
    if src.kind == "demo":
        from thresher.data.demo_model import build_demo_model

        return build_demo_model(src.value)
    if src.kind == "registry":
        return _resolve_registry(src.value)
    if src.kind == "local":
        path = Path(src.value)
        if path.is_file():
            runtime = "; a GGUF file runs in llama.cpp or Ollama" if path.suffix == ".gguf" else ""
            raise ModelError(f"{path}: a file, not a model directory (a Hugging Face checkpoint: "
                             f"config.json and *.safetensors){runtime}")
        if not (path / "config.json").is_file():
            raise ModelError(f"{path}: not a model directory (no config.json)")
        return path
    return _resolve_hub(src.value)


def _resolve_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        )
    except Exception as err:
        raise ModelError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({type(err).__name__}: "
            f"{next(iter(str(err).splitlines()), '')}). "
            "Offline, download it elsewhere and give the local directory instead"
            f" (no local directory {repo_id!r} exists here either)."
        ) from err


def _resolve_registry(name_version: str) -> Path:
    """``models:/name/version`` (or ``models:/name@alias``) through the MLflow Model Registry."""
    from thresher.tracking import ARTIFACT_DIR_TAG, Tracker

    tracker = Tracker()
    mv = tracker.model_version(name_version)
    artifact_dir = (mv.tags or {}).get(ARTIFACT_DIR_TAG)
    if artifact_dir and (Path(artifact_dir) / "config.json").is_file():
        return Path(artifact_dir)
    local = tracker.download_model(name_version)
    for candidate in (local, *local.rglob("config.json")):
        base = candidate if candidate.is_dir() else candidate.parent
        if (base / "config.json").is_file():
            return base
    raise ModelError(f"models:/{name_version}: the registered artifact holds no config.json")


def hash_directory(path: str | Path, exclude: tuple[str, ...] = PROVENANCE) -> str:
    """sha256 over the sorted (relative path, file sha256) pairs of a directory's files, but for
    the provenance files (``formats.artifact.PROVENANCE``) and top-level dot files."""
    path = Path(path)
    outer = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        if rel in exclude or rel.startswith("."):
            continue
        outer.update(rel.encode() + b"\0" + sha256_file(file).encode() + b"\n")
    return outer.hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    except OSError as err:  # unreadable (permissions, an I/O error): named, not a traceback
        raise ModelError(f"{path}: cannot read it ({err.strerror or err})") from None
    return h.hexdigest()
