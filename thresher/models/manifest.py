"""The ``thresher.json`` manifest of a published artifact, and its verification on load.

The manifest records the recipe, the lineage (base model and hash, stages), the metrics, library
versions and the sha256 of every file. A loader refuses an artifact whose files do not match, so
a truncated copy or a tampered weight file never gets evaluated or served.
"""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from thresher import __version__
from thresher.errors import ArtifactError
from thresher.formats.artifact import MANIFEST
from thresher.models.source import sha256_file

_LIBRARIES = ("torch", "transformers", "safetensors", "bitsandbytes", "prefect", "mlflow", "triton",
              "lm_eval")


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "thresher": __version__}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            continue
    return out


def file_hashes(path: Path) -> dict[str, str]:
    return {
        f.relative_to(path).as_posix(): sha256_file(f)
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != MANIFEST and not f.name.startswith(".")
    }


def write_manifest(path: str | Path, **fields: Any) -> dict:
    """Write ``thresher.json`` into artifact ``path`` with file hashes and library versions."""
    path = Path(path)
    manifest = {"format": 1, **fields, "libraries": library_versions(), "files": file_hashes(path)}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    return manifest


def read_manifest(path: str | Path) -> dict | None:
    file = Path(path) / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArtifactError(f"{file}: corrupt manifest ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise ArtifactError(f"{file}: corrupt manifest (not a thresher manifest)")
    return manifest


def verify_artifact(path: str | Path) -> dict | None:
    """Check every file against the manifest; return the manifest (None if there is none)."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        return None
    expected: dict[str, str] = manifest.get("files", {})
    actual = file_hashes(path)
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    changed = sorted(k for k in set(expected) & set(actual) if expected[k] != actual[k])
    if missing or changed or extra:
        parts = []
        if changed:
            parts.append(f"modified: {', '.join(changed[:5])}")
        if missing:
            parts.append(f"missing: {', '.join(missing[:5])}")
        if extra:
            parts.append(f"unexpected: {', '.join(extra[:5])}")
        raise ArtifactError(
            f"{path}: artifact does not match its manifest ({'; '.join(parts)}); refusing to load "
            "it. Republish it or run the flow again."
        )
    return manifest
