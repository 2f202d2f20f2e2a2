from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from thresher.cli import app
from thresher.recipe import (
    QUANTIZE_STAGES,
    CalibrationConfig,
    ExecutionConfig,
    MergeStage,
    PerplexityConfig,
    PruneStage,
)

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_help_explains_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("check", "demo", "perplexity", "demo-model"):
        assert command in result.output


def _commands(group, path=()):
    for name, command in group.commands.items():
        yield (*path, name), command
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


def test_help_at_80_columns_shows_every_option_and_summary_whole():
    """A terminal of 80 columns (and a pipe) must show each option's full name and each
    command's whole summary: a truncated option name cannot be typed."""
    root = typer.main.get_command(app)
    for path, command in [((), root), *_commands(root)]:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, (path, result.output)
        body = [line for line in result.output.splitlines() if not line.startswith("Usage:")]
        assert not any(line.endswith(("…", "...")) for line in body), (path, result.output)
        for param in command.params:
            for opt in (*param.opts, *param.secondary_opts):
                if opt.startswith("--"):
                    assert opt in result.output, (path, opt, result.output)
        long = [line for line in result.output.splitlines() if len(line) > 80]
        assert not long, (path, long)


def test_check_prints_plan():
    result = runner.invoke(app, ["check", str(ROOT / "configs" / "demo.yaml")])
    assert result.exit_code == 0, result.output
    assert "recipe is valid" in result.output
    assert "prune auto ratio=0.5" in result.output


def test_check_says_what_the_evaluation_needs_in_memory(monkeypatch):
    from thresher import resources

    demo = ["check", str(ROOT / "configs" / "demo.yaml")]
    result = runner.invoke(app, demo)
    assert "memory: 5.0 M parameters; evaluation holds the model whole in float32, at least 19 " \
        "MiB; " in " ".join(result.output.split())
    monkeypatch.setattr(resources, "available_memory", lambda: (8 << 20, "free memory and swap"))
    result = runner.invoke(app, demo)
    assert result.exit_code == 0, result.output  # a warning: the run may go to a larger machine
    assert "only 8 MiB available here (free memory and swap)" in " ".join(result.output.split())


def test_served_name_defaults_to_what_the_user_named(tmp_path):
    from thresher.cli import default_served_name

    snapshot = tmp_path / "snapshots" / ("0" * 40)
    assert default_served_name("Qwen/Qwen3-30B-A3B", snapshot) == "Qwen/Qwen3-30B-A3B"
    assert default_served_name("demo:tiny", tmp_path / "tiny-98c3c11e5817") == "demo:tiny"
    assert default_served_name("models:/thresher-demo-gptq4/2", tmp_path / "x") == \
        "thresher-demo-gptq4/2"
    artifact = tmp_path / "published" / "reap50-gptq4"
    artifact.mkdir(parents=True)
    assert default_served_name(str(artifact), artifact) == "reap50-gptq4"


def test_check_reports_field_without_traceback(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\nmodel: demo:tiny\nvariants:\n  - name: a\n    stages:\n"
                   "      - quantize: {method: gptq, bits: 7}\n")
    result = runner.invoke(app, ["check", str(bad)])
    assert result.exit_code == 2
    assert "variants.0.stages.0.quantize.bits" in result.output
    assert "Traceback" not in result.output


def test_run_refuses_a_missing_model_before_the_flow_starts(tmp_path, monkeypatch):
    """The shapes check runs before Prefect: one line and exit 2, no flow run (whose failure
    Prefect would log with its traceback)."""
    import thresher.flows.compress as compress_module

    bad = tmp_path / "r.yaml"
    bad.write_text(f"name: x\nmodel: {tmp_path / 'none'}\nvariants: [{{name: base}}]\n")
    monkeypatch.setattr(compress_module, "compress", lambda *a, **k: pytest.fail("flow started"))
    result = runner.invoke(app, ["run", str(bad)])
    assert result.exit_code == 2
    assert "is not a model directory (no config.json)" in result.output
    assert "Traceback" not in result.output


def test_run_refuses_an_unreachable_tracking_server_before_the_flow_starts(tmp_path,
                                                                          monkeypatch):
    import thresher.flows.compress as compress_module

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\nmodel: demo:tiny\nvariants: [{name: base}]\n")
    monkeypatch.setattr(compress_module, "compress", lambda *a, **k: pytest.fail("flow started"))
    result = runner.invoke(app, ["run", str(recipe), "--tracking-uri", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "MLflow tracking server http://127.0.0.1:9 is unreachable" in result.output


def test_serve_on_an_address_in_use_fails_before_loading(monkeypatch):
    """The listening socket is bound first: a port in use is exit 2 naming it, without loading
    the model (and not the engine-failure status, which asks a supervisor to restart)."""
    import socket

    import thresher.models as models

    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("model loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "demo:tiny", "--port", str(port)])
    assert result.exit_code == 2
    text = " ".join(result.output.translate(str.maketrans("", "", "│╭╮╰╯─")).split())
    assert f"cannot listen on 127.0.0.1:{port}" in text


@pytest.mark.parametrize(("args", "option"), [
    (["serve", "demo:tiny", "--port", "-1"], "'--port'"),
    (["serve", "demo:tiny", "--max-model-len", "0"], "'--max-model-len'"),
    (["serve", "demo:tiny", "--max-queue", "-1"], "'--max-queue'"),
    (["serve", "demo:tiny", "--port", "0", "--dtype", "int8"], "'--dtype'"),
    (["serve", "demo:tiny", "--port", "0", "--kv-cache-gb", "0"], "'--kv-cache-gb'"),
    (["tasks", "--model", "demo:tiny", "--limit", "-1"], "'--limit'"),
    (["tasks", "--model", "demo:tiny", "--batch-size", "0"], "'--batch-size'"),
])
def test_numeric_options_out_of_range_are_named(args, option):
    """Exit 2 naming the option (were a traceback, or a context of 0 silently taken as the
    model's own)."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {option}" in result.output and "Traceback" not in result.output


def test_a_registry_uri_without_a_version_says_what_it_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    for uri in ("models:/nope", "models:/nope/"):
        result = runner.invoke(app, ["perplexity", "--model", uri])
        assert result.exit_code == 2, result.output
        assert "models:/NAME/VERSION or models:/NAME@ALIAS" in result.output, result.output


def test_windows_longer_than_the_context_are_refused_by_the_commands(tmp_path):
    """Perplexity and calibration windows past demo:tiny's 1,024 positions: one line, exit 2,
    before any window is scored or any statistic gathered; a bad value names the option."""
    result = runner.invoke(app, ["perplexity", "--model", "demo:tiny", "--seq-len", "2048"])
    assert result.exit_code == 2
    assert "perplexity seq_len 2048 is longer than the model's context (1024" in result.output
    result = runner.invoke(app, ["prune", "--model", "demo:tiny", "--out", str(tmp_path / "p"),
                                 "--seq-len", "2048"])
    assert result.exit_code == 2 and "calibration seq_len 2048 is longer than" in result.output
    assert not (tmp_path / "p").exists()
    result = runner.invoke(app, ["perplexity", "--model", "demo:tiny", "--seq-len", "0"])
    assert result.exit_code == 2 and "--seq-len: Input should be greater than 0" in result.output


def test_run_summary_prints_the_compact_table_and_where_the_full_one_is(tmp_path):
    from thresher.cli import console, print_summary_table
    from thresher.evaluate.report import VariantRecord

    records = [VariantRecord.from_metrics(n, {"size_bytes": 4e6, "perplexity": p},
                                          {"variant": n, "stages": s})
               for n, s, p in (("base", "base", 10.0), ("awq4", "quantize awq 4-bit g64", 11.0))]
    records[0].window_nll = {"perplexity": [2.0, 2.4, 2.2, 2.3]}
    records[1].window_nll = {"perplexity": [2.1, 2.5, 2.3, 2.4]}
    with console.capture() as out:
        print_summary_table({"variants": [r.to_dict() for r in records],
                             "report_dir": str(tmp_path)})
    text = out.get()
    table, where = text.split("full table: ")
    assert max(len(line) for line in table.splitlines()) <= 120
    assert "reference" in table and "+10.52% [+10.52, +10.52]*" in table
    assert where.startswith(str(tmp_path / "comparison.md"))


# Which recipe sections each command's options set; an option named like a field of one of them
# must take that field's default (or, left unset so the recipe decides, name it in its help).
COMMAND_FIELDS = {
    ("perplexity",): [PerplexityConfig],
    ("prune",): [PruneStage, CalibrationConfig, ExecutionConfig],
    ("merge",): [MergeStage, CalibrationConfig, ExecutionConfig],
    ("quantize",): [*QUANTIZE_STAGES.values(), CalibrationConfig, ExecutionConfig],
}


def _options(*path: str) -> dict:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {p.name: p for p in command.params if isinstance(p, typer.core.TyperOption)}


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


@pytest.mark.parametrize("path", list(COMMAND_FIELDS), ids=" ".join)
def test_cli_defaults_are_the_recipe_fields_defaults(path):
    checked = 0
    for name, option in _options(*path).items():
        for model in COMMAND_FIELDS[path]:
            field = model.model_fields.get(name)
            if field is None or (name == "method" and model in QUANTIZE_STAGES.values()):
                continue  # quantize --method picks the stage class, whose method is its own
            checked += 1
            if option.default is None and field.default is not None:
                stated = option.help.lower().partition("default")[2]
                assert _shown(field.default) in stated, (
                    f"{' '.join(path)} --{name}: help does not name {model.__name__}'s default")
            else:
                assert str(option.default) == str(field.default), (
                    f"{' '.join(path)} --{name}: {option.default!r} on the command line, "
                    f"{field.default!r} in {model.__name__}")
    assert checked >= 3


def test_export_calibration_samples_is_the_recipe_default():
    option = _options("export", "gguf")["calibration_samples"]
    assert option.default == CalibrationConfig.model_fields["samples"].default


def test_an_os_error_on_a_named_path_is_one_line_and_its_traceback_needs_debug():
    """A path the command cannot read or write (``compare --out`` under a file, say) is the
    system's reason for that path, not a traceback; --debug still shows where it came from."""
    from thresher.cli import _state, handles_errors

    def writes(out: Path) -> None:
        raise PermissionError(13, "Permission denied", str(out))

    mini = typer.Typer()
    mini.command()(handles_errors(writes))
    result = runner.invoke(mini, ["/srv/reports"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: /srv/reports: Permission denied"
    _state["debug"] = True
    try:
        assert isinstance(runner.invoke(mini, ["/srv/reports"]).exception, PermissionError)
    finally:
        _state["debug"] = False


def test_tasks_refuses_a_json_path_it_cannot_write_before_running(tmp_path, monkeypatch):
    """--json under a missing directory, or naming a directory: refused before the model is
    loaded (the results were computed, then lost to a traceback)."""
    import thresher.evaluate.tasks as tasks

    monkeypatch.setattr(tasks, "run_tasks", lambda *a, **k: pytest.fail("tasks ran"))
    for path, why in ((tmp_path / "missing" / "r.json", f"{tmp_path / 'missing'} does not exist"),
                      (tmp_path, "is a directory")):
        result = runner.invoke(app, ["tasks", "--model", "demo:tiny", "--json", str(path)])
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert f"Invalid value for '--json': {path}: {why}" in text, text


def test_a_model_given_as_a_file_is_named_as_one(tmp_path):
    """A GGUF file (or any file) where a checkpoint directory belongs: it was taken for a hub
    id and refused as 'cannot fetch from the Hugging Face hub'."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    result = runner.invoke(app, ["perplexity", "--model", str(gguf)])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert f"error: {gguf}: a file, not a model directory" in text
    assert "a GGUF file runs in llama.cpp or Ollama" in text and "hub" not in text
