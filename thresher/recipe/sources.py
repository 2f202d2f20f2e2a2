"""Where a recipe's text comes from: calibration and evaluation sources, and their overlap check.

``stdlib`` (the Python standard library's source) is split by a stable hash of each file's path:
calibration reads the train split, evaluation the held-out one, so the two never share a file.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from thresher.recipe.base import StrictModel


class HFDatasetSource(StrictModel):
    """A Hugging Face dataset (hub name or a local dataset script/dir)."""

    hf: str = Field(description="dataset name, e.g. 'wikitext' or 'allenai/c4'")
    config: str | None = Field(None, description="dataset configuration, e.g. 'wikitext-2-raw-v1'")
    split: str = "train"
    field: str = Field("text", description="column that holds the text")


class FilesSource(StrictModel):
    """Local files: paths or globs of .txt, .py, .md or .jsonl files."""

    files: list[str] = Field(min_length=1)
    field: str = Field("text", description="key that holds the text in .jsonl records")


Split = Literal["train", "heldout"]

# Tests, IDLE and bundled third-party code are not "the standard library's source" in any useful
# sense and would make the corpus depend on how Python was packaged.
STDLIB_EXCLUDE = ("test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
                  "__pycache__")
HELDOUT_PERCENT = 10


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_split_of(relpath: str) -> Split:
    """The split a standard-library file belongs to: a stable hash of its relative path.

    It lives beside the schema because it is what ``stdlib`` means (calibration reads the train
    split, evaluation the held-out one) and what the overlap check below compares files against."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def _stdlib_split_of_file(path: Path) -> Split | None:
    """The ``stdlib`` split that reads ``path``; None when the corpus does not hold it."""
    root = stdlib_root().resolve()
    if path.suffix != ".py" or not path.is_relative_to(root):
        return None
    rel = path.relative_to(root).as_posix()
    if any(part in STDLIB_EXCLUDE for part in rel.split("/")[:-1]):
        return None
    return stdlib_split_of(rel)


SOURCE_FORMS = ("stdlib", "hf", "files")


def _source_kind(value: Any) -> str | None:
    """Which form a source takes, so that an error names that form's fields alone (not every
    form's)."""
    if isinstance(value, str):
        return "stdlib"
    if isinstance(value, HFDatasetSource) or (isinstance(value, dict) and "hf" in value):
        return "hf"
    if isinstance(value, FilesSource) or (isinstance(value, dict) and "files" in value):
        return "files"
    return None


def _forms_as_any_of(schema: dict[str, Any]) -> None:
    """Spell the forms as ``anyOf``: Prefect's run form draws no ``oneOf``, and the forms are
    disjoint (a string, or an object with its own required key and no other form's), so both
    spellings accept the same documents."""
    if "oneOf" in schema:
        schema["anyOf"] = schema.pop("oneOf")


TextSource = Annotated[
    Annotated[Literal["stdlib"], Tag("stdlib")] | Annotated[HFDatasetSource, Tag("hf")]
    | Annotated[FilesSource, Tag("files")],
    Discriminator(_source_kind, custom_error_type="source_form",
                  custom_error_message="a source is 'stdlib', {files: [paths or globs]} or "
                  "{hf: dataset name, config, split, field}"),
    Field(
        description="'stdlib' (the Python standard library's source; calibration uses its train "
        "split, evaluation its held-out split), {hf: ...} or {files: [...]}",
        json_schema_extra=_forms_as_any_of,
    ),
]


class CalibrationConfig(StrictModel):
    """The text that pruning and quantization observe."""

    source: TextSource = "stdlib"
    samples: int = Field(128, gt=0, description="number of calibration windows")
    seq_len: int = Field(256, gt=0, description="tokens per window (at most the model's "
                         "max_position_embeddings)")
    seed: int = Field(0, description="seed of the calibration sample")
    allow_eval_overlap: bool = Field(
        False, description="accept calibration text that evaluation also scores (the same local "
        "files, the same dataset split, or files of the stdlib held-out split): the recipe is "
        "refused without it, because every variant's perplexity would flatter it. Not part of "
        "a stage's store key: it changes no artifact")


class PerplexityConfig(StrictModel):
    """Token-level perplexity on non-overlapping windows of held-out text."""

    source: TextSource = "stdlib"
    seq_len: int = Field(256, gt=0, description="tokens per window (at most the model's "
                         "max_position_embeddings)")
    max_windows: int | None = Field(64, gt=0, description="cap on windows scored (null: all)")
    batch_size: int = Field(8, gt=0, description="windows per forward pass")


class EvalConfig(StrictModel):
    """How every variant is scored: held-out perplexity, optionally lm-evaluation-harness tasks."""

    perplexity: PerplexityConfig = Field(default_factory=PerplexityConfig)
    tasks: list[str] = Field(default_factory=list, description="lm-evaluation-harness task names")
    task_limit: int | None = Field(None, gt=0, description="cap on documents per task")



def shared_text(calibration: Any, evaluation: Any) -> str | None:
    """What a calibration source and an evaluation source both read, described (None: nothing).

    ``stdlib`` against itself is apart by its hash split; local files are compared by their
    resolved paths (and against the stdlib split the other side reads); datasets by name,
    configuration and split.
    """
    if isinstance(calibration, HFDatasetSource) and isinstance(evaluation, HFDatasetSource):
        same = (calibration.hf, calibration.config, calibration.split) == (
            evaluation.hf, evaluation.config, evaluation.split)
        return (f"dataset {calibration.hf!r} (config {calibration.config!r}, split "
                f"{calibration.split!r})") if same else None
    cal_files, eval_files = _named_files(calibration), _named_files(evaluation)
    both = sorted(cal_files & eval_files)
    if evaluation == "stdlib":
        both = [f for f in sorted(cal_files) if _stdlib_split_of_file(Path(f)) == "heldout"]
    elif calibration == "stdlib":
        both = [f for f in sorted(eval_files) if _stdlib_split_of_file(Path(f)) == "train"]
    if not both:
        return None
    split = (" (of the stdlib held-out split)" if evaluation == "stdlib" else
             " (of the stdlib train split)" if calibration == "stdlib" else "")
    more = f" and {len(both) - 3} more" if len(both) > 3 else ""
    return f"the local file{'s' if len(both) > 1 else ''} {', '.join(both[:3])}{more}{split}"


def _named_files(source: Any) -> set[str]:
    """The resolved paths a files source names (a pattern that matches nothing yet stands for
    itself, so two equal patterns still count as the same files)."""
    if not isinstance(source, FilesSource):
        return set()
    out: set[str] = set()
    for pattern in source.files:
        matched = glob.glob(os.path.expanduser(pattern), recursive=True)
        out.update(str(Path(p).resolve()) for p in matched or [pattern])
    return out

