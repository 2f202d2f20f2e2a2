"""The demo models' cache key: what defines a model, not the libraries of the machine."""

from __future__ import annotations

import json
import platform

import pytest
import torch

from thresher.data import demo_model
from thresher.errors import ModelError


def test_key_ignores_library_versions(monkeypatch):
    spec = demo_model.SPECS["tiny"]
    key = demo_model.demo_key(spec)
    monkeypatch.setattr(platform, "python_version", lambda: "3.12.0")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert demo_model.demo_key(spec) == key


def test_key_follows_spec_code_and_text(monkeypatch):
    spec = demo_model.SPECS["tiny"]
    key = demo_model.demo_key(spec)
    assert demo_model.demo_key(demo_model.DemoSpec(**{**vars(spec), "seed": spec.seed + 1})) != key
    monkeypatch.setattr(demo_model, "BUILDER_VERSION", demo_model.BUILDER_VERSION + 1)
    assert demo_model.demo_key(spec) != key
    monkeypatch.undo()
    monkeypatch.setattr(demo_model, "corpus_digest", lambda: "another standard library")
    assert demo_model.demo_key(spec) != key


def test_pinned_models_are_used_as_they_are(tmp_path, monkeypatch):
    monkeypatch.setenv("THRESHER_DEMO_MODELS", str(tmp_path / "demo-models"))
    own = demo_model.demo_model_dir("tiny")
    assert own.name == f"tiny-{demo_model.demo_key(demo_model.SPECS['tiny'])}"
    (tmp_path / "demo-models" / demo_model.PINNED).write_text(json.dumps({"tiny": "tiny-carried"}))
    assert demo_model.demo_model_dir("tiny") == tmp_path / "demo-models" / "tiny-carried"
    assert demo_model.demo_model_dir("small") == tmp_path / "demo-models" / (
        f"small-{demo_model.demo_key(demo_model.SPECS['small'])}")
    (tmp_path / "demo-models" / demo_model.PINNED).write_text("[1, 2]")
    with pytest.raises(ModelError, match="pinned.json"):
        demo_model.demo_model_dir("tiny")
