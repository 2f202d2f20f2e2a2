"""The compress flow end to end on the tiny demo model: real Prefect, real MLflow (SQLite)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.flows.conftest import thresher_cmd
from thresher.errors import ArtifactError
from thresher.flows.compress import recipe_hash
from thresher.models import load_model
from thresher.models.source import hash_directory, resolve_model, sha256_file
from thresher.recipe import parse_recipe

pytestmark = pytest.mark.slow


def recipe_dict(model: Path, name: str = "ft") -> dict:
    return {
        "name": name,
        "model": str(model),
        "calibration": {"samples": 8, "seq_len": 64},
        "eval": {"perplexity": {"seq_len": 64, "max_windows": 4}, "tasks": ["stdlib_closing"],
                 "task_limit": 16},
        "variants": [
            {"name": "base", "stages": []},
            {"name": "p25", "stages": [{"prune": {"method": "frequency", "ratio": 0.25}}]},
            {"name": "p25-rtn4", "stages": [{"prune": {"method": "frequency", "ratio": 0.25}},
                                            {"quantize": {"method": "rtn", "bits": 4,
                                                          "group_size": 64}}],
             "validate": {"draft": "rtn4"}},  # a draft listed after its target
            {"name": "rtn4", "stages": [{"quantize": {"method": "rtn", "bits": 4,
                                                      "group_size": 64}}]},
        ],
        "publish": {"registry_name": name, "formats": ["hf", "gguf"],
                    "gguf_types": ["q8_0", "q4_k_m"], "gguf_imatrix": True},
        "validate": {"concurrency": [1, 4], "max_tokens": 8, "rounds": 1,
                     "draft_of_base": True, "num_speculative_tokens": 3},
    }


@pytest.fixture(scope="module")
def flow_env(tmp_path_factory, tiny_demo):
    root = tmp_path_factory.mktemp("flow")
    return {"uri": f"sqlite:///{root / 'mlflow.db'}", "store": str(root / "store"),
            "publish": str(root / "published"), "root": root, "model": tiny_demo}


@pytest.fixture(scope="module")
def first_run(flow_env, prefect_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from thresher.flows.compress import compress

    recipe = parse_recipe(recipe_dict(flow_env["model"]))
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
        summary = compress(recipe, tracking_uri=flow_env["uri"], store_dir=flow_env["store"],
                           publish_dir=flow_env["publish"])
    return summary


def test_runs_metrics_and_registry(first_run, flow_env, prefect_server):
    client = MlflowClient(flow_env["uri"], flow_env["uri"])
    parent = client.get_run(first_run["parent_run_id"])
    assert parent.data.tags["thresher.base_hash"] == hash_directory(flow_env["model"])
    # the parent run and the Prefect flow run are named after the recipe, and tagged with it
    assert parent.info.run_name.startswith("ft-")
    assert parent.data.tags["thresher.recipe"] == "ft"
    assert parent.data.tags["thresher.recipe_hash"] == recipe_hash(
        parse_recipe(recipe_dict(flow_env["model"])))
    assert parent.info.run_name in _prefect_flow_run_names(prefect_server["url"])
    assert parent.data.params["variants.1.stages.0.prune.method"] == "frequency"
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_name = {r.info.run_name: r for r in children}
    assert set(by_name) == {"base", "p25", "p25-rtn4", "rtn4"}
    for run in children:
        for metric in ("perplexity", "size_bytes", "bits_per_param", "compression_ratio",
                       "experts_kept"):
            assert metric in run.data.metrics, (run.info.run_name, metric)
    assert by_name["p25"].data.metrics["experts_kept"] == 6
    assert by_name["base"].data.metrics["experts_kept"] == 8
    # fp32 base; 4-bit experts and attention, 32-bit tied embeddings
    assert by_name["base"].data.metrics["bits_per_param"] > 31
    assert by_name["rtn4"].data.metrics["bits_per_param"] < 16
    assert by_name["rtn4"].data.metrics["compression_ratio"] > 2
    assert "quantize.wall_seconds" in by_name["rtn4"].data.metrics
    assert "prune_report.json" in {a.path for a in client.list_artifacts(by_name["p25"].info.run_id)}
    # GGUF files beside the published checkpoints: both types for every published variant (the
    # RTN ones requantized from their dequantized weights), each file's weights evaluated
    for name in ("p25", "rtn4"):
        gguf_files = {a.path for a in client.list_artifacts(by_name[name].info.run_id, "gguf")}
        assert gguf_files == {f"gguf/{name}-q8_0.gguf", f"gguf/{name}-q4_k_m.gguf"}
        m = by_name[name].data.metrics
        assert m["gguf/q4_k_m/requantized"] == float(name == "rtn4")
        assert m["gguf/q8_0/perplexity"] == pytest.approx(m["perplexity"], rel=0.05)
    # the shared prefix (frequency-25%) was computed once: p25-rtn4 found it in the store
    assert by_name["p25-rtn4"].data.metrics["stage_cache_hits"] == 1
    report = {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")}
    assert "comparison/comparison.md" in report
    assert {"comparison/report.html", "comparison/quality_vs_size.png"} <= report, report
    assert "task/stdlib_closing/acc" in by_name["rtn4"].data.metrics
    # per-document scores, logged per variant, give the table its paired differences
    samples = client.download_artifacts(by_name["rtn4"].info.run_id, "task_samples.json")
    assert len(json.loads(Path(samples).read_text())["stdlib_closing/acc"]) == 16
    # the validation run in the serving engine, logged for every variant
    for run in children:
        m = run.data.metrics
        assert m["validate/perplexity"] == pytest.approx(m["perplexity"], rel=0.02)
        assert 0 < m["validate/agreement"] <= 1 and m["validate/throughput_c4_tok_s"] > 0
        assert m["validate/ttft_p50_ms_c1"] > 0 and m["validate/tpot_p99_ms_c4"] > 0
    assert by_name["base"].data.metrics["validate/agreement"] == 1.0
    assert by_name["rtn4"].data.metrics["validate/agreement"] < 1.0
    table = client.download_artifacts(parent.info.run_id, "comparison/comparison.md")
    header = Path(table).read_text().splitlines()[0]
    assert "agreement" in header and "tok/s @c4" in header and "TTFT p50 ms @c1" in header
    assert ", Δ " in Path(table).read_text()
    # every compressed variant scored as a speculative-decoding draft of the base
    for name in ("p25", "p25-rtn4", "rtn4"):
        m = by_name[name].data.metrics
        assert 0 <= m["validate/draft_acceptance_rate"] <= 1, name
        assert 1 <= m["validate/draft_mean_accepted_length"] <= 4, name  # k = 3
        assert m["validate/speculative_tokens_per_s"] > 0
        assert m["validate/speculative_speedup"] > 0
    assert "validate/draft_acceptance_rate" not in by_name["base"].data.metrics
    # p25-rtn4 served with rtn4 as its draft: logged on the target's run, the draft named
    drafted = by_name["p25-rtn4"].data
    assert drafted.params["validate.draft"] == "rtn4"
    assert 0 <= drafted.metrics["validate/with_draft/draft_acceptance_rate"] <= 1
    assert "validate/with_draft/draft_acceptance_rate" not in by_name["rtn4"].data.metrics
    assert {"acceptance as draft", "speculative tok/s (base, this draft)",
            "with its draft: acceptance"} <= {c.strip() for c in header.split("|")}
    rtn4_row = next(row for row in Path(table).read_text().splitlines()
                    if row.startswith("| rtn4 |"))
    assert f"{by_name['rtn4'].data.metrics['validate/draft_acceptance_rate']:.3f}" in rtn4_row
    # every published variant is registered and models:/ resolves back to the artifact
    mlflow.set_tracking_uri(flow_env["uri"])
    mlflow.set_registry_uri(flow_env["uri"])
    try:
        for row in first_run["variants"]:
            if row["variant"] == "base":
                continue
            assert row["model_uri"] == f"models:/ft-{row['variant']}/1"
            assert resolve_model(row["model_uri"]) == Path(row["artifact"])
    finally:
        mlflow.set_tracking_uri(None)


def _prefect_flow_run_names(api_url: str) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as c:
        return {run.name for run in c.read_flow_runs()}


def test_rerun_uses_the_cache(first_run, flow_env, prefect_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from thresher.flows.compress import compress

    store = Path(flow_env["store"])
    before = sorted(p.parent.name for p in store.glob("*/*/.thresher-complete.json"))
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
        again = compress(parse_recipe(recipe_dict(flow_env["model"])),
                         tracking_uri=flow_env["uri"], store_dir=flow_env["store"],
                         publish_dir=flow_env["publish"])
    after = sorted(p.parent.name for p in store.glob("*/*/.thresher-complete.json"))
    assert before == after
    stages = {"base": 0, "p25": 1, "p25-rtn4": 2, "rtn4": 1}
    for row in again["variants"]:
        assert row["stage_cache_hits"] == stages[row["variant"]], row
        assert row.get("model_uri", "").endswith("/1") or row["variant"] == "base"
    first = {r["variant"]: r["perplexity"] for r in first_run["variants"]}
    assert {r["variant"]: r["perplexity"] for r in again["variants"]} == first
    # draft scores come from the store too: the same numbers, timings included
    key = "validate/speculative_tokens_per_s"
    scored = {r["variant"]: r.get(key) for r in first_run["variants"]}
    assert {r["variant"]: r.get(key) for r in again["variants"]} == scored
    assert len(list((store / "drafts").glob("*.json"))) == 4  # three of the base, one named


def test_tampered_published_artifact_is_refused(first_run, tmp_path):
    published = Path(next(r["artifact"] for r in first_run["variants"] if r["variant"] == "p25"))
    copy = tmp_path / "p25"
    shutil.copytree(published, copy)
    load_model(copy)  # intact: loads
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its manifest"):
        load_model(copy)


def test_invalid_recipe_fails_before_compute(tmp_path, tiny_demo):
    data = recipe_dict(tiny_demo)
    data["variants"][1]["stages"][0]["prune"]["ratio"] = 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    env = {**os.environ, "THRESHER_HOME": str(tmp_path / "home")}
    start = time.time()
    proc = subprocess.run(thresher_cmd("run", str(bad)), env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "variants.1.stages.0.prune.ratio" in proc.stdout + proc.stderr
    assert not (tmp_path / "home" / "store").exists() and not (tmp_path / "home" / "mlflow.db").exists()
    assert time.time() - start < 60


def _write(tmp_path: Path, data: dict, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _committed(store: Path) -> list[Path]:
    """The store's finished entries; not an entry still being flushed beside its final name
    (``.KEY-*``), whose completion record is written before the rename that commits it."""
    return [m.parent for m in store.glob("*/*/.thresher-complete.json")
            if not m.parent.name.startswith(".")]


def test_sigkill_mid_stage_then_resume(tmp_path, tiny_demo, prefect_server):
    """Kill -9 while the second stage runs; the rerun keeps the first and recomputes the second."""
    data = recipe_dict(tiny_demo, name="kill")
    data["calibration"] = {"samples": 32, "seq_len": 128}
    data["eval"] = {"perplexity": {"seq_len": 64, "max_windows": 2}}
    data["validate"] = {"enabled": False}
    data["variants"] = [{"name": "p25-gptq4", "stages": [
        {"prune": {"method": "frequency", "ratio": 0.25}},
        {"quantize": {"method": "gptq", "bits": 4, "group_size": 64}}]}]
    recipe = _write(tmp_path, data, "kill")
    store = tmp_path / "store"
    env = {**prefect_server["env"], "THRESHER_HOME": str(tmp_path / "home")}
    args = ["run", str(recipe), "--store-dir", str(store),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    proc = subprocess.Popen(thresher_cmd(*args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    killed = False
    while time.time() < deadline and proc.poll() is None:
        complete = _committed(store)
        partial = list((store / ".scratch").glob("*")) if (store / ".scratch").exists() else []
        if len(complete) == 1 and partial:  # the GPTQ stage has started
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.2)
    proc.wait(30)
    assert killed, "the flow finished before it could be killed; the test needs a slower stage"
    prune_entry = _committed(store)[0]
    prune_mtime = prune_entry.stat().st_mtime_ns
    rerun = subprocess.run(thresher_cmd(*args), env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert prune_entry.stat().st_mtime_ns == prune_mtime, "the finished stage was not recomputed"
    assert len(_committed(store)) == 2
    assert not list((store / ".scratch").glob("*")), "partial output of the killed run removed"
    # Same artifacts as an uninterrupted run in a fresh store.
    clean_store = tmp_path / "clean-store"
    clean = subprocess.run(thresher_cmd("run", str(recipe), "--store-dir", str(clean_store),
                                        "--tracking-uri", f"sqlite:///{tmp_path / 'm2.db'}"),
                           env=env, capture_output=True, text=True, timeout=600)
    assert clean.returncode == 0, clean.stdout + clean.stderr

    def hashes(root: Path) -> set[str]:
        """Weights and config of every stage output (reports hold timings, which differ)."""
        return {sha256_file(f) for marker in root.glob("*/*/.thresher-complete.json")
                for f in marker.parent.iterdir() if f.suffix == ".safetensors"
                or f.name == "config.json"}

    assert hashes(store) == hashes(clean_store)


def test_two_flows_at_once_write_distinct_artifacts(tmp_path, tiny_demo, prefect_server):
    env = {**prefect_server["env"], "THRESHER_HOME": str(tmp_path / "home")}
    store = tmp_path / "store"
    procs = []
    for bits in (3, 4):
        data = recipe_dict(tiny_demo, name=f"par{bits}")
        data["eval"] = {"perplexity": {"seq_len": 64, "max_windows": 2}}
        data["validate"] = {"enabled": False}
        data["variants"] = [{"name": f"rtn{bits}", "stages": [
            {"quantize": {"method": "rtn", "bits": bits, "group_size": 64}}]}]
        recipe = _write(tmp_path, data, f"par{bits}")
        procs.append(subprocess.Popen(
            thresher_cmd("run", str(recipe), "--store-dir", str(store),
                         "--publish-dir", str(tmp_path / "pub"),
                         "--tracking-uri", f"sqlite:///{tmp_path / f'm{bits}.db'}"),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
    entries = list(store.glob("*/*/.thresher-complete.json"))
    assert len(entries) == 2
    pub3, pub4 = tmp_path / "pub" / "par3" / "rtn3", tmp_path / "pub" / "par4" / "rtn4"
    assert hash_directory(pub3) != hash_directory(pub4)
    assert json.loads((pub3 / "config.json").read_text())["quantization_config"]["bits"] == 3


def test_damage_budget_prune_then_gptq_runs_validates_and_says_what_loads_it(tmp_path, tiny_demo,
                                                                              prefect_server):
    """A damage-budget prune followed by GPTQ: quantized, evaluated, published with a model card
    that says standard runtimes cannot load it, and validated in the serving engine."""
    import json.encoder

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from thresher.flows.compress import compress

    data = {
        "name": "dmg", "model": str(tiny_demo),
        # a file outside this repository, so that editing thresher does not change the split, and
        # of the stdlib train split, so that the held-out perplexity does not score it
        "calibration": {"source": {"files": [json.encoder.__file__]}, "samples": 8, "seq_len": 64},
        "eval": {"perplexity": {"seq_len": 64, "max_windows": 4}},
        "variants": [{"name": "dmg-gptq4", "stages": [
            {"prune": {"method": "reap", "ratio": 0.5, "budget": "damage"}},
            {"quantize": {"method": "gptq", "bits": 4, "group_size": 64}}]}],
        "validate": {"concurrency": [1], "max_tokens": 8, "rounds": 1},
    }
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
        summary = compress(parse_recipe(data), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                           store_dir=str(tmp_path / "store"), publish_dir=str(tmp_path / "pub"))
    rows = {row["variant"]: row for row in summary["variants"]}
    assert set(rows) == {"base", "dmg-gptq4"}  # the base is evaluated as the reference
    row = rows["dmg-gptq4"]
    artifact = Path(row["artifact"])
    config = json.loads((artifact / "config.json").read_text())
    counts = config["layer_num_experts"]
    assert len(set(counts)) > 1 and "quantization_config" in config
    assert row["experts_kept"] == sum(counts) / len(counts)
    card = (artifact / "README.md").read_text()
    assert f"layer_num_experts {counts}" in card and "vLLM" in card and "transformers" in card
    assert "README.md" in json.loads((artifact / "thresher.json").read_text())["files"]
    # validated in the serving engine (no longer skipped), perplexity matching the evaluator's
    assert row["validate/perplexity"] == pytest.approx(row["perplexity"], rel=0.02)
    assert 0 < row["validate/agreement"] <= 1
