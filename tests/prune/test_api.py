"""The prune stage end to end on tiny random-init models of every MoE family."""

import contextlib
import json
import json.decoder

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import CALIBRATION_FILE, build_random_model
from thresher.errors import ArtifactError, CompressionError, UnsupportedArchitectureError
from thresher.formats.artifact import PRUNE_REPORT
from thresher.models import get_adapter, load_model, save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.models.random_init import MOE_FAMILIES
from thresher.prune import api
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage

# A small local text keeps tokenization out of these tests' time (the stdlib source is 13 MB).
CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)


@pytest.fixture
def saved_family(tmp_path, tiny_tokenizer):
    """A saved random-init model of a family, with the demo tokenizer (for calibration text)."""

    def make(family: str, **kw):
        model = build_random_model(family, num_layers=2, vocab_size=len(tiny_tokenizer), **kw)
        path = tmp_path / f"{family}-base"
        save_model(model, tiny_tokenizer, path)
        return model, path

    return make


@contextlib.contextmanager
def experts_disabled(model, removed: dict[int, list[int]]):
    """The unpruned model with ``removed`` experts masked out of routing (logit -inf): what a
    correctly pruned model must compute."""
    adapter = get_adapter(model.config)
    handles = []
    for i, experts in removed.items():
        kept = torch.ones(adapter.num_experts(model.config), dtype=torch.bool)
        kept[experts] = False
        layer = adapter.layers(model)[i]
        rule = adapter.routing_rule(layer, model.config)

        def hook(_mod, _args, out, kept=kept, rule=rule):
            top_w, top_i = rule.select(out[0], kept)
            return out[0], top_w.to(out[1].dtype), top_i

        handles.append(adapter.router(layer).register_forward_hook(hook))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_pruned_checkpoint_reloads_in_transformers_and_computes_the_masked_model(
        family, saved_family, tmp_path):
    model, base = saved_family(family)
    out = tmp_path / "pruned"
    report = prune_model(base, PruneStage(method="reap", ratio=0.5), CAL, out, show_progress=False)

    adapter = get_adapter(model.config)
    config = AutoConfig.from_pretrained(out)
    assert adapter.num_experts(config) == 4 and adapter.top_k(config) == 2
    pruned = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers
    moe = [r.layer for r in report.layers]
    assert moe == [i for i, layer in enumerate(adapter.layers(model)) if adapter.is_moe_layer(layer)]
    for r in report.layers:
        layer, orig, kept = adapter.layers(pruned)[r.layer], adapter.layers(model)[r.layer], r.kept
        assert adapter.router(layer).weight.shape == (4, model.config.hidden_size)
        assert adapter.experts(layer).gate_up_proj.shape[0] == 4
        assert adapter.experts(layer).down_proj.shape[0] == 4
        torch.testing.assert_close(adapter.router(layer).weight, adapter.router(orig).weight[kept])
        for name, buffer in adapter.router(orig).named_buffers():  # GLM's score correction bias
            torch.testing.assert_close(getattr(adapter.router(layer), name), buffer[kept])
        torch.testing.assert_close(adapter.experts(layer).down_proj,
                                   adapter.experts(orig).down_proj[kept])
        if adapter.shared_expert(orig) is not None:
            torch.testing.assert_close(adapter.shared_expert(layer).up_proj.weight,
                                       adapter.shared_expert(orig).up_proj.weight)

    reader = CheckpointReader(out)
    names = reader.tensor_names()
    for i in moe:
        if adapter.fused_experts_on_disk:  # gpt-oss keeps them fused, biases beside them
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                assert reader.shape(f"model.layers.{i}.mlp.experts.{name}")[0] == 4
            assert reader.shape(adapter.disk_router_key(i) + ".bias") == (4,)
        else:
            for e in range(4):
                for proj in ("gate", "up", "down"):
                    assert adapter.disk_expert_key(i, e, proj) + ".weight" in names
            assert adapter.disk_expert_key(i, 4, "gate") + ".weight" not in names
        assert reader.get(adapter.disk_router_key(i) + ".weight").shape[0] == 4
        correction = adapter.disk_router_correction_key(i)  # [E] (GLM-4.5) or [1, E] (ERNIE)
        assert correction is None or reader.shape(correction)[-1] == 4
    assert adapter.fused_experts_on_disk or not any(".experts.gate_up_proj" in n for n in names)

    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    removed = {r.layer: r.removed for r in report.layers}
    with torch.no_grad(), experts_disabled(model, removed):
        expected = model(input_ids=ids).logits
    with torch.no_grad():
        got = pruned(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (out / "tokenizer.json").is_file()


def test_report_records_every_saliency_and_removes_the_lowest(saved_family, tmp_path):
    _, base = saved_family("qwen3_moe")
    out = tmp_path / "pruned"
    report = prune_model(base, PruneStage(method="ean", keep=5), CAL, out, show_progress=False)
    data = json.loads((out / PRUNE_REPORT).read_text())
    assert data["method"] == "ean" and data["experts_kept"] == 5 and len(data["layers"]) == 2
    for layer in data["layers"]:
        assert len(layer["saliency"]) == 8 and len(layer["tokens_routed"]) == 8
        assert sorted(layer["kept"] + layer["removed"]) == list(range(8))
        assert len(layer["removed"]) == 3
        assert max(layer["saliency"][e] for e in layer["removed"]) <= min(
            layer["saliency"][e] for e in layer["kept"])
        assert layer["dead_experts"] == [e for e, n in enumerate(layer["tokens_routed"]) if n == 0]
        assert sum(layer["tokens_routed"]) == CAL.samples * CAL.seq_len * 2  # top-2 slots
    metrics = report.metrics()
    assert metrics["experts_kept"] == 5 and metrics["layers"] == 2
    assert metrics["calibration_tokens"] == CAL.samples * CAL.seq_len
    assert 0.0 <= metrics["removed_routed_share"] < 1.0
    assert metrics["wall_seconds"] > 0 and metrics["peak_rss_mb"] > 0
    assert data["metrics"] == metrics
    assert all(isinstance(v, float) for v in metrics.values())


def test_random_control_is_seeded_and_observes_nothing(saved_family, tmp_path, monkeypatch):
    _, base = saved_family("olmoe")

    def no_observation(*_a, **_k):
        raise AssertionError("the random control must not run the observer")

    monkeypatch.setattr(api, "observe_experts", no_observation)
    removed = []
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        r = prune_model(base, PruneStage(method="random", ratio=0.5, seed=seed), CAL,
                        tmp_path / name, show_progress=False)
        removed.append([layer.removed for layer in r.layers])
        assert all(layer.tokens_routed is None for layer in r.layers)
    assert removed[0] == removed[1] and removed[0] != removed[2]


@pytest.fixture
def no_compute(monkeypatch):
    """Fail if a stage gets as far as observing or writing."""

    def tripwire(*_a, **_k):
        raise AssertionError("options must be checked before any compute")

    monkeypatch.setattr(api, "observe_experts", tripwire)
    monkeypatch.setattr(api, "LayerwiseModel", tripwire)


def test_errors_before_compute(saved_family, tmp_path, no_compute):
    _, base = saved_family("qwen3_moe")
    bad_ratio = PruneStage.model_construct(method="reap", ratio=1.5, keep=None, seed=0)
    with pytest.raises(CompressionError, match="ratio must be in \\(0, 1\\)"):
        prune_model(base, bad_ratio, CAL, tmp_path / "o1")
    with pytest.raises(CompressionError, match="fewer than the 2"):
        prune_model(base, PruneStage(method="reap", keep=1), CAL, tmp_path / "o2")
    (tmp_path / "exists").mkdir()
    with pytest.raises(ArtifactError, match="already exists"):
        prune_model(base, PruneStage(method="reap", ratio=0.5), CAL, tmp_path / "exists")

    dense = build_random_model("llama", num_layers=1)
    save_model(dense, None, tmp_path / "dense")
    with pytest.raises(CompressionError, match="dense model"):
        prune_model(tmp_path / "dense", PruneStage(ratio=0.5), CAL, tmp_path / "o3")

    alien = tmp_path / "alien"
    alien.mkdir()
    (alien / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        prune_model(alien, PruneStage(ratio=0.5), CAL, tmp_path / "o4")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "alien", "dense", "exists", "qwen3_moe-base"]


def test_a_crash_leaves_no_partial_artifact(saved_family, tmp_path, monkeypatch):
    _, base = saved_family("mixtral")

    def crash(*_a, **_k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(api, "canonical_layer_state", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        prune_model(base, PruneStage(method="frequency", ratio=0.25), CAL, tmp_path / "out",
                    show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixtral-base"]


def test_damage_budget_checkpoint_loads_per_layer_expert_counts_and_computes_the_masked_model(
        saved_family, tmp_path):
    model, base = saved_family("qwen3_moe")
    out = tmp_path / "pruned"
    stage = PruneStage(method="auto", ratio=0.5, budget="damage")
    # The uneven split depends on the text: calibrate on one that thresher's edits do not change.
    cal = CAL.model_copy(update={"source": FilesSource(files=[json.decoder.__file__])})
    report = prune_model(base, stage, cal, out, show_progress=False)

    counts = [len(r.kept) for r in report.layers]
    assert sum(counts) == 8 and len(set(counts)) == 2  # the uniform total, split unevenly
    config = AutoConfig.from_pretrained(out)
    assert config.layer_num_experts == counts and config.num_experts == max(counts)
    data = json.loads((out / PRUNE_REPORT).read_text())
    assert data["budget"] == "damage" and data["heldout_windows"] == 1
    for layer in data["layers"]:
        assert layer["criterion"] in layer["errors"]
        assert layer["local_error"] == min(layer["errors"].values())
    pruned = load_model(out)
    adapter = get_adapter(model.config)
    for i, layer in enumerate(adapter.layers(pruned)):
        assert adapter.router(layer).weight.shape[0] == counts[i]
        assert adapter.experts(layer).down_proj.shape[0] == counts[i]
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad(), experts_disabled(model, {r.layer: r.removed for r in report.layers}):
        expected = model(input_ids=ids).logits
    with torch.no_grad():
        got = pruned(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_random_control_refuses_damage_budgets_and_protection():
    for options in ({"budget": "damage"}, {"protect_super_experts": True}):
        with pytest.raises(ValueError, match="'random' control observes nothing"):
            PruneStage(method="random", ratio=0.5, **options)
    with pytest.raises(ValueError, match="min_keep_fraction"):
        PruneStage(method="auto", ratio=0.5, budget="damage", min_keep_fraction=0.0)
