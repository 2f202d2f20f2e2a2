"""The content-addressed artifact store: every stage output, keyed by what determines it.

A stage's key hashes (input artifact hash, stage config, calibration config, thresher version).
Equal prefixes of different variants therefore share one artifact (REAP-50% feeds both
reap50-gptq4 and reap50-awq4), a rerun finds every finished stage, and a flow killed in the middle
of a stage resumes from there: stages write into a scratch folder, and a finished output becomes
an entry through ``build_dir_atomically`` (built beside its final name, then renamed), so an entry
either exists whole or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from thresher import __version__
from thresher.formats.artifact import STORE_COMPLETE
from thresher.models.source import hash_directory
from thresher.paths import build_dir_atomically, state_dir
from thresher.recipe import CalibrationConfig, Stage

log = logging.getLogger(__name__)


VERIFY_ENV = "THRESHER_STORE_VERIFY"
"""Set to ``hash`` to re-hash a store entry's files on every cache hit (sizes are always checked)."""


HASH_SCHEME = 2
"""What a record's ``content_hash`` covers. 2: the files but the provenance ones
(``formats.artifact.PROVENANCE``); an entry without it hashed its stage report too (wall time,
scratch path), so it is computed again rather than published under a hash its files miss."""


def file_sizes(path: Path) -> dict[str, int]:
    """Relative path -> size of every file of an entry but the top-level dot files (such as the
    completion record): the stage report included, which the content hash leaves out."""
    files = (f for f in sorted(path.rglob("*")) if f.is_file())
    return {rel: f.stat().st_size for f in files
            if not (rel := f.relative_to(path).as_posix()).startswith(".")}


@dataclass(frozen=True)
class StoreEntry:
    key: str
    path: Path

    @property
    def complete(self) -> bool:
        return (self.path / STORE_COMPLETE).is_file()

    def record(self) -> dict:
        return json.loads((self.path / STORE_COMPLETE).read_text())

    @property
    def content_hash(self) -> str:
        return self.record()["content_hash"]

    def damage(self, rehash: bool | None = None) -> str | None:
        """What no longer matches the entry's record (None: it is intact).

        File sizes are always compared (cheap: a truncated or replaced file is caught); the
        content is re-hashed with ``rehash``, by default when $THRESHER_STORE_VERIFY is ``hash``,
        and for a record too old to list its sizes.
        """
        try:
            record = self.record()
        except (OSError, json.JSONDecodeError) as err:
            return f"unreadable record ({err})"
        if record.get("hash_scheme") != HASH_SCHEME:
            return "made by an earlier thresher, whose content hash covered its stage report"
        sizes = record.get("files")
        if sizes is not None:
            actual = file_sizes(self.path)
            changed = sorted(k for k in set(sizes) | set(actual) if sizes.get(k) != actual.get(k))
            if changed:
                return f"files changed since it was committed: {', '.join(changed[:5])}"
        if rehash is None:
            rehash = os.environ.get(VERIFY_ENV, "").lower() == "hash"
        if (rehash or sizes is None) and hash_directory(self.path) != record["content_hash"]:
            return "its content no longer matches its recorded hash"
        return None


def stage_key(input_hash: str, stage: Stage, calibration: CalibrationConfig) -> str:
    """The store key of ``stage`` applied to the artifact whose content hash is ``input_hash``."""
    blob = json.dumps(
        {
            "input": input_hash,
            "stage": stage.model_dump(mode="json", exclude_none=True),
            "calibration": calibration.model_dump(mode="json", exclude={"allow_eval_overlap"}),
            "thresher": __version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class ArtifactStore:
    """Directories under ``root/<key[:2]>/<key>``; complete when the marker file exists."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root else state_dir() / "store"
        self.root.mkdir(parents=True, exist_ok=True)

    def entry(self, key: str) -> StoreEntry:
        return StoreEntry(key, self.root / key[:2] / key)

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[StoreEntry]:
        """Hold the entry's lock: two flows computing the same stage at once compute it once."""
        entry = self.entry(key)
        entry.path.parent.mkdir(parents=True, exist_ok=True)
        with open(entry.path.parent / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield entry

    def discard(self, key: str) -> None:
        """Remove the entry under ``key`` (a damaged one, to be recomputed). Call under ``locked``."""
        shutil.rmtree(self.entry(key).path, ignore_errors=True)

    def scratch_dir(self, key: str) -> Path:
        """A path (not yet created) for a stage to write into before it is committed.

        It lies in its own scratch folder, with any temporary siblings the stage makes; the
        leftovers of a killed run for the same key (its scratch folder, a half-made entry beside
        the final name) are removed first. Call under ``locked``.
        """
        scratch = self.root / ".scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        entry = self.entry(key)
        for stale in [*scratch.glob(f"{key}-*"), *entry.path.parent.glob(f".{key}-*")]:
            log.info("removing the partial output of an interrupted run: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        folder = scratch / f"{key}-{time.time_ns()}"
        folder.mkdir()
        return folder / "out"

    def commit(self, key: str, produced: Path, meta: dict) -> StoreEntry:
        """Move a stage's finished output into the store under ``key`` (fsynced, then renamed:
        whole or not at all, even across a power loss), with its content hash and file sizes."""
        entry = self.entry(key)
        record = {**meta, "key": key, "content_hash": hash_directory(produced),
                  "hash_scheme": HASH_SCHEME, "files": file_sizes(produced),
                  "thresher": __version__, "created": time.time()}
        entry.path.parent.mkdir(parents=True, exist_ok=True)
        with build_dir_atomically(entry.path) as building:
            for item in produced.iterdir():  # same filesystem: renames, not copies
                item.rename(building / item.name)
            (building / STORE_COMPLETE).write_text(json.dumps(record, indent=2, sort_keys=True))
        shutil.rmtree(produced.parent, ignore_errors=True)
        return entry
