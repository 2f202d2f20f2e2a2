import os

import pytest

from thresher.errors import ArtifactError
from thresher.flows.store import ArtifactStore, stage_key
from thresher.models.manifest import verify_artifact, write_manifest
from thresher.recipe import CalibrationConfig, Stage


def test_stage_key_depends_on_everything_that_determines_the_output():
    stage = Stage.model_validate({"quantize": {"method": "rtn", "bits": 4}})
    cal = CalibrationConfig()
    key = stage_key("abc", stage, cal)
    assert key == stage_key("abc", Stage.model_validate({"quantize": {"method": "rtn", "bits": 4}}),
                            CalibrationConfig())
    assert key != stage_key("abd", stage, cal)
    assert key != stage_key("abc", Stage.model_validate({"quantize": {"method": "rtn", "bits": 3}}),
                            cal)
    assert key != stage_key("abc", stage, CalibrationConfig(samples=64))


def test_store_commit_and_partial_cleanup(tmp_path):
    store = ArtifactStore(tmp_path)
    out = store.scratch_dir("k1")
    out.mkdir()
    (out / "x.bin").write_bytes(b"1")
    stale = store.scratch_dir("k2")
    stale.mkdir()  # a killed run's leftover
    assert not store.entry("k1").complete
    entry = store.commit("k1", out, {"note": 1})
    assert entry.complete and (entry.path / "x.bin").read_bytes() == b"1"
    assert entry.record()["note"] == 1 and len(entry.content_hash) == 64
    store.scratch_dir("k2")
    assert not stale.exists(), "a new attempt removes the partial output of a killed one"


def test_tampered_artifact_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    write_manifest(tmp_path, variant="v")
    assert verify_artifact(tmp_path)["variant"] == "v"
    (tmp_path / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(ArtifactError, match="modified: model.safetensors"):
        verify_artifact(tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(ArtifactError, match="missing: config.json"):
        verify_artifact(tmp_path)


def test_store_commit_fsyncs_every_file_and_the_entry_before_it_is_visible(tmp_path,
                                                                          monkeypatch):
    store = ArtifactStore(tmp_path)
    synced = []  # (path flushed, whether the entry was visible yet)
    real = os.fsync

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), store.entry("k3").path.exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = store.scratch_dir("k3")
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"w" * 10)
    (out / "config.json").write_text("{}")
    entry = store.commit("k3", out, {})
    names = {os.path.basename(p) for p, _ in synced}
    assert {"model.safetensors", "config.json", ".thresher-complete.json"} <= names
    before_rename = [p for p, visible in synced if not visible]
    assert len(before_rename) == 4  # three files and the entry's directory
    assert synced[-1] == (str(entry.path.parent), True)  # then the parent that names it
    assert entry.record()["files"] == {"config.json": 2, "model.safetensors": 10}


def test_a_corrupt_or_unreadable_manifest_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "thresher.json").write_text('["not", "a", "manifest"]')
    with pytest.raises(ArtifactError, match=rf"^{tmp_path / 'thresher.json'}: corrupt manifest"):
        verify_artifact(tmp_path)
    (tmp_path / "thresher.json").write_bytes(b'{"files": {"config.json": "\xff')
    with pytest.raises(ArtifactError, match="corrupt manifest"):
        verify_artifact(tmp_path)
