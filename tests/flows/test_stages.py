"""The flow's stage and publish tasks at the edges: a full disk, a damaged store entry, a publish
directory thresher did not make. The tasks run as plain functions (``.fn``), on demo:tiny."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import CALIBRATION_FILE
from thresher.errors import ArtifactError, StorageError
from thresher.flows.stages import publish_artifact, run_stage
from thresher.flows.store import VERIFY_ENV, ArtifactStore, stage_key
from thresher.formats.artifact import STORE_COMPLETE
from thresher.models.checkpoint import _ShardStream
from thresher.models.manifest import verify_artifact
from thresher.models.source import hash_directory
from thresher.recipe import CalibrationConfig, FilesSource, Stage

STAGE = Stage.model_validate({"quantize": {"method": "rtn", "bits": 4, "group_size": -1}})
CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2, seq_len=16)


def _stage(tiny_demo, store_root):
    return run_stage.fn(str(tiny_demo), "base-hash", STAGE, CAL, str(store_root), label="rtn4")


def _snapshot(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_full_disk_during_a_stage_is_named_and_leaves_no_entry(tiny_demo, tmp_path,
                                                                 monkeypatch):
    written = []

    def add_until_full(self, key, tensor):
        if len(written) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.data_path))
        written.append(key)
        return real_add(self, key, tensor)

    real_add = _ShardStream.add
    monkeypatch.setattr(_ShardStream, "add", add_until_full)
    with pytest.raises(StorageError, match="No space left on device; free some space") as err:
        _stage(tiny_demo, tmp_path / "store")
    assert ".safetensors.data: " in str(err.value)  # the file whose write failed
    store = ArtifactStore(tmp_path / "store")
    key = stage_key("base-hash", STAGE, CAL)
    assert not store.entry(key).path.exists()
    leftovers = [p for p in store.root.rglob("*") if p.is_dir() and "lock" not in p.name]
    assert {p.relative_to(store.root).as_posix() for p in leftovers} <= {".scratch", key[:2]}
    assert not any((store.root / ".scratch").iterdir()), "the partial output was removed"

    monkeypatch.setattr(_ShardStream, "add", real_add)
    assert _stage(tiny_demo, tmp_path / "store")["cache_hit"] is False  # the disk has room again


def test_a_cache_hit_whose_files_changed_is_recomputed(tiny_demo, tmp_path, monkeypatch):
    first = _stage(tiny_demo, tmp_path / "store")
    weights = Path(first["path"]) / "model.safetensors"
    good = weights.read_bytes()
    assert _stage(tiny_demo, tmp_path / "store")["cache_hit"] is True

    with open(weights, "ab") as f:  # a size change: always caught
        f.write(b"\0" * 64)
    again = _stage(tiny_demo, tmp_path / "store")
    assert again["cache_hit"] is False and weights.read_bytes() == good

    flipped = bytearray(good)  # same size, other bytes: caught by the full re-hash only
    flipped[-1] ^= 0xFF
    weights.write_bytes(bytes(flipped))
    monkeypatch.delenv(VERIFY_ENV, raising=False)
    assert _stage(tiny_demo, tmp_path / "store")["cache_hit"] is True
    monkeypatch.setenv(VERIFY_ENV, "hash")
    assert _stage(tiny_demo, tmp_path / "store")["cache_hit"] is False
    assert weights.read_bytes() == good


def test_a_stage_computed_again_keeps_its_hash_so_the_next_stage_is_found(tiny_demo, tmp_path):
    """The stage report (wall time, input path) is provenance, not content: recomputing a removed
    entry gives it the hash it had, and the stage that read it is not computed again."""
    store = str(tmp_path / "store")
    prune = Stage.model_validate({"prune": {"method": "reap", "ratio": 0.25}})
    first = run_stage.fn(str(tiny_demo), "base-hash", prune, CAL, store, label="reap")
    second = run_stage.fn(first["path"], first["content_hash"], STAGE, CAL, store, label="rtn4")
    assert second["cache_hit"] is False

    ArtifactStore(store).discard(first["key"])
    again = run_stage.fn(str(tiny_demo), "base-hash", prune, CAL, store, label="reap")
    assert again["cache_hit"] is False and again["content_hash"] == first["content_hash"]
    assert run_stage.fn(again["path"], again["content_hash"], STAGE, CAL, store,
                        label="rtn4")["cache_hit"]


def test_an_entry_recorded_under_the_earlier_hash_is_computed_again(tiny_demo, tmp_path):
    first = _stage(tiny_demo, tmp_path / "store")
    entry = ArtifactStore(tmp_path / "store").entry(first["key"])
    record = entry.record()
    record.pop("hash_scheme")  # as an earlier thresher wrote it
    (Path(first["path"]) / STORE_COMPLETE).write_text(json.dumps(record))
    assert "made by an earlier thresher" in entry.damage()
    again = _stage(tiny_demo, tmp_path / "store")
    assert again["cache_hit"] is False and entry.damage() is None


def _fields(recipe="r", variant="v"):
    return {"recipe": {"name": recipe}, "variant": variant}


def _artifact(tiny_demo, tmp_path):
    src = tmp_path / "artifact"
    shutil.copytree(tiny_demo, src)
    return src, hash_directory(src)


def test_publish_refuses_a_directory_it_did_not_make_and_leaves_it_untouched(tiny_demo, tmp_path):
    src, content = _artifact(tiny_demo, tmp_path)
    dest = tmp_path / "pub" / "v"
    dest.mkdir(parents=True)
    (dest / "notes.txt").write_text("someone's work")
    (dest / "sub").mkdir()
    (dest / "sub" / "data.bin").write_bytes(b"\1\2\3")
    before = _snapshot(dest)
    with pytest.raises(ArtifactError, match=rf"^{dest}: exists and is not a thresher publish"):
        publish_artifact.fn(str(src), content, str(tmp_path / "pub"), "v", _fields())
    assert _snapshot(dest) == before

    other = tmp_path / "pub" / "w"  # a publish, but of another recipe
    publish_artifact.fn(str(src), content, str(tmp_path / "pub"), "w", _fields(recipe="other"))
    before = _snapshot(other)
    with pytest.raises(ArtifactError, match="not a thresher publish of recipe 'r', variant 'w'"):
        publish_artifact.fn(str(src), content, str(tmp_path / "pub"), "w", _fields())
    assert _snapshot(other) == before
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["v", "w"]  # no temporaries


def test_republishing_the_same_recipe_and_variant_replaces_it(tiny_demo, tmp_path):
    src, content = _artifact(tiny_demo, tmp_path)
    dest = publish_artifact.fn(str(src), content, str(tmp_path / "pub"), "v", _fields())
    assert verify_artifact(dest)["content_hash"] == content

    (src / "generation_config.json").write_text("{}")  # a new result of the same variant
    changed = hash_directory(src)
    assert publish_artifact.fn(str(src), changed, str(tmp_path / "pub"), "v", _fields()) == dest
    manifest = verify_artifact(dest)
    assert manifest["content_hash"] == changed and manifest["recipe"] == {"name": "r"}
    assert (tmp_path / "pub" / "v" / "generation_config.json").read_text() == "{}"


def test_publish_rehashes_the_artifact_and_refuses_one_that_changed(tiny_demo, tmp_path):
    src, content = _artifact(tiny_demo, tmp_path)
    (src / "config.json").write_text((src / "config.json").read_text() + " ")
    with pytest.raises(ArtifactError, match="no longer match the content hash"):
        publish_artifact.fn(str(src), content, str(tmp_path / "pub"), "v", _fields())
    assert list((tmp_path / "pub").iterdir()) == []


def test_a_full_disk_during_publish_keeps_the_earlier_publish_whole(tiny_demo, tmp_path,
                                                                    monkeypatch):
    """The disk fills while the new copy is flushed (where delayed allocation reports it): the
    earlier publish stays as it was and no temporary is left beside it."""
    src, content = _artifact(tiny_demo, tmp_path)
    dest = publish_artifact.fn(str(src), content, str(tmp_path / "pub"), "v", _fields())
    before = _snapshot(tmp_path / "pub")
    (src / "generation_config.json").write_text("{}")
    real_fsync = os.fsync

    def fsync_full(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("model.safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_full)
    with pytest.raises(StorageError, match=rf"^{dest}: No space left on device"):
        publish_artifact.fn(str(src), hash_directory(src), str(tmp_path / "pub"), "v", _fields())
    assert _snapshot(tmp_path / "pub") == before
    assert [p.name for p in (tmp_path / "pub").iterdir()] == ["v"]


def test_an_evaluation_that_cannot_fit_names_its_variant(tiny_demo, tmp_path, monkeypatch):
    """The flow's message says which variant, not only the store directory (a content hash)."""
    from thresher.errors import ModelError
    from thresher.flows.stages import evaluate_artifact
    from thresher.models import inspect
    from thresher.recipe import EvalConfig

    monkeypatch.setattr(inspect, "available_memory", lambda: (1 << 20, "free memory and swap"))
    with pytest.raises(ModelError, match=r"^evaluating base: loading \S+ in float32 needs at least"):
        evaluate_artifact.fn(str(tiny_demo), "base-hash", EvalConfig(), str(tmp_path), label="base")
