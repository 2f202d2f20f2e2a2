"""Text sources: the embedded ``stdlib`` corpus, local files, and Hugging Face datasets.

``stdlib`` is the running Python's standard-library source, split deterministically into train
and held-out by a hash of each file's path, so calibration and evaluation never share a file and
every machine with the same Python gets the same split without downloading anything.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

from thresher.errors import DataError
from thresher.recipe import (
    STDLIB_EXCLUDE,
    FilesSource,
    HFDatasetSource,
    Split,
    TextSource,
    stdlib_root,
    stdlib_split_of,
)


def stdlib_files(split: Split) -> list[Path]:
    root = stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in STDLIB_EXCLUDE for part in rel.split("/")[:-1]):
            continue
        if stdlib_split_of(rel) == split:
            out.append(path)
    if not out:
        raise DataError(f"no standard-library source found under {root}")
    return out


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def iter_documents(source: TextSource, split: Split = "train") -> Iterator[str]:
    """Yield the documents of a source in a fixed order.

    ``split`` only applies to ``stdlib``; a files or HF source is used as given (name a held-out
    split in the recipe for evaluation).
    """
    if source == "stdlib":
        for path in stdlib_files(split):
            yield _read_text(path)
    elif isinstance(source, FilesSource):
        yield from _iter_files(source)
    elif isinstance(source, HFDatasetSource):
        yield from _iter_hf(source)
    else:
        raise DataError(f"unknown text source {source!r}")


def unmatched_patterns(source: FilesSource) -> list[str]:
    """The paths or globs of ``source`` that name no file (checked before a run starts)."""
    return [p for p in source.files if not glob.glob(p, recursive=True)]


def _iter_files(source: FilesSource) -> Iterator[str]:
    paths: list[Path] = []
    for pattern in source.files:
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise DataError(f"calibration/eval files: {pattern!r} matches no file")
        paths.extend(Path(p) for p in matched)
    for path in paths:
        if path.suffix == ".jsonl":
            for lineno, line in enumerate(_read_text(path).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno}: not valid JSON: {err}") from None
                if source.field not in record:
                    raise DataError(f"{path}:{lineno}: record has no field {source.field!r}")
                yield str(record[source.field])
        else:
            yield _read_text(path)


def _iter_hf(source: HFDatasetSource) -> Iterator[str]:
    import datasets

    try:
        ds = datasets.load_dataset(source.hf, source.config, split=source.split)
    except Exception as err:  # datasets raises many types; the user needs the name and the cause
        raise DataError(
            f"cannot load dataset {source.hf!r} (config {source.config!r}, split {source.split!r}): "
            f"{err}. Offline, point 'files:' at local copies instead."
        ) from err
    if source.field not in ds.column_names:
        raise DataError(f"dataset {source.hf!r} has no column {source.field!r}: {ds.column_names}")
    for text in ds[source.field]:
        if text:
            yield text


def load_text(source: TextSource, split: Split = "train", separator: str = "\n\n") -> str:
    """All documents of a source joined by ``separator`` (the GPTQ/AWQ papers join by "\\n\\n")."""
    text = separator.join(iter_documents(source, split))
    if not text.strip():
        raise DataError(f"text source {source!r} ({split}) is empty")
    return text
