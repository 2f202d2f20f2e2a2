"""Where thresher keeps its state: the demo models, the artifact store, the embedded MLflow store.

Everything sits under one directory, ``$THRESHER_HOME`` or the user cache directory
(``$XDG_CACHE_HOME/thresher``, by default ``~/.cache/thresher``); ``$THRESHER_DEMO_MODELS`` may
put the demo models elsewhere (the test suite keeps them in the user's cache while its state is
temporary).

Files that thresher runs as code (compiled C kernels, lm-eval task code) are taken from the state
directory only when nobody else could have written them: the state directory may be shared
(docs/operations.md), and a predictable file name there must not become someone else's code.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from thresher.errors import StorageError

log = logging.getLogger(__name__)


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
    """Where the demo models are trained and found: ``$THRESHER_DEMO_MODELS`` or
    ``<state dir>/demo-models``."""
    override = os.environ.get("THRESHER_DEMO_MODELS")
    path = Path(override) if override else state_dir() / "demo-models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_private(path: Path) -> bool:
    """Whether ``path`` (not a symlink) belongs to the current user and no group or other user
    can write to it: the condition for loading it, or what it holds, as code."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (not stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def code_dir(name: str) -> Path:
    """``<state dir>/<name>`` for files thresher loads as code, created private (0700); if it
    exists but is not private (``is_private``), a fresh private directory of this process's
    instead (removed at exit), with a warning."""
    path = state_dir() / name
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    return path if is_private(path) else fallback_code_dir(name, path)


def fallback_code_dir(name: str, untrusted: Path) -> Path:
    """A private directory (0700, this process's, removed at exit) to build ``name`` in, when
    ``untrusted`` (a directory or a file in it) is not ``is_private``; warns once per path."""
    path = _private_tmp(name)
    if untrusted not in _warned:
        _warned.add(untrusted)
        log.warning("%s is not private (owned by another user, or writable by group or others); "
                    "thresher does not load code from it and builds %s in %s for this process "
                    "instead (docs/operations.md, 'A shared THRESHER_HOME')", untrusted, name, path)
    return path


_warned: set[Path] = set()


@functools.cache
def _private_tmp(name: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"thresher-{name}-"))  # mode 0700
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def umask() -> int:
    """The process's umask, read once (/proc where it shows it; else by setting it back, which
    for an instant changes it for every thread)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_path(path: Path) -> None:
    """Flush one file or directory to disk (a directory: its entries, i.e. renames into it)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root``, then every directory from the deepest up to ``root``, so a
    rename that publishes ``root`` can never expose a file whose bytes are not on disk yet."""
    dirs = [root]
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            dirs.append(path)
        else:
            fsync_path(path)
    for directory in reversed(dirs):
        fsync_path(directory)


def storage_error(err: OSError, where: Path) -> StorageError:
    """A failed write as the error the CLI prints: the file that failed, why, and what is left."""
    target = err.filename or where
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        reason += "; free some space and run again"
    return StorageError(f"{target}: {reason} (while writing {where}; nothing partial was left "
                        "there)")


def _parent_refused(err: OSError, final: Path) -> StorageError:
    """A temporary beside ``final`` that could not be made: its directory is missing, read-only
    or not ours, so the error names that directory rather than the temporary's name."""
    return storage_error(OSError(err.errno, err.strerror, str(final.parent)), final)


@contextlib.contextmanager
def build_dir_atomically(final: Path, check_replace: Callable[[Path], None] | None = None,
                         mode: int | None = None) -> Iterator[Path]:
    """A fresh directory beside ``final`` to build into; when the block succeeds it replaces
    ``final`` by a rename, and it is removed whatever happens, so ``final`` is never partial.
    It gets ``mode``, by default the one ``mkdir`` would give (a temporary directory's 0700
    would keep a published model from a server running as another user).

    The build is fsynced (files, directories) before the rename and the parent after it, so a
    power loss leaves the old ``final`` or the whole new one. An existing ``final`` is replaced
    only if ``check_replace(final)`` returns (it raises to refuse, and ``final`` stays as it was).
    An OSError (a full disk) becomes a StorageError naming the file.
    """
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        tmp.chmod(0o777 & ~umask() if mode is None else mode)
    except OSError as err:
        raise _parent_refused(err, final) from err
    old = final.with_name(f"{tmp.name}-old")
    try:
        try:
            yield tmp
            fsync_tree(tmp)
            if final.exists():
                if check_replace is not None:
                    check_replace(final)
                final.rename(old)  # kept whole until the new one is in place
            try:
                tmp.rename(final)
            except OSError:
                if old.exists():
                    old.rename(final)
                raise
            fsync_path(final.parent)
        except OSError as err:
            raise storage_error(err, final) from err
    finally:
        for leftover in (tmp, old):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(leftover)


def write_text_atomically(final: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``final``, flush it to disk and rename it into
    place, so a reader (or a run killed halfway, or a power loss) never sees a partial file."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise storage_error(err, final) from err
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}-", dir=final.parent)
    except OSError as err:
        raise _parent_refused(err, final) from err
    try:
        os.fchmod(fd, 0o666 & ~umask())  # as open() would create it, not mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(final.parent)
    except OSError as err:
        raise storage_error(err, final) from err
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def tracking_store_uri() -> str:
    """The embedded MLflow store: a SQLite file under the state directory."""
    return f"sqlite:///{state_dir() / 'mlflow.db'}"


def tracking_artifacts_uri() -> str:
    """Where the embedded MLflow store keeps run artifacts."""
    return (state_dir() / "mlartifacts").as_uri()
