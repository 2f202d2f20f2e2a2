"""benchmarks/peers/peer_quality.py without its peer venv (which CI does not have): the table, the skip
and the command line. The comparison itself is run by hand (docs/benchmarks.md)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "peer_quality.py"


@pytest.fixture(scope="module")
def peer_quality():
    spec = importlib.util.spec_from_file_location("peer_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_table_sets_both_sides_against_their_own_float(peer_quality):
    rows = [peer_quality.Row("gptq", 4, ours=101.0, theirs=102.0),
            peer_quality.Row("awq", 2, ours=130.0, theirs=120.0)]
    lines = peer_quality.format_table(rows, fp_ours=100.0, fp_theirs=100.0).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 9
    assert lines[2] == "| float | 32 | 100.000 | - | 100.000 | - | - | - |"
    # thresher loses less: negative difference, ratio below 1; loses more: the opposite
    assert lines[3] == "| gptq | 4 | 101.000 | +1.00% | 102.000 | +2.00% | -1.00 | 0.50 |"
    assert lines[4] == "| awq | 2 | 130.000 | +30.00% | 120.000 | +20.00% | +10.00 | 1.50 |"


def test_no_ratio_when_the_peer_does_not_lose(peer_quality):
    table = peer_quality.format_table([peer_quality.Row("gptq", 4, 100.5, 99.0)], 100.0, 100.0)
    assert table.splitlines()[-1].endswith("| +0.50% | 99.000 | -1.00% | +1.50 | - |")


def test_skips_cleanly_without_the_peer_venv(peer_quality, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLMC_PYTHON", raising=False)
    assert peer_quality.main([]) == 0
    assert peer_quality.main(["--peer-python", str(tmp_path / "bin" / "python")]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped: no llm-compressor venv") == 2
    assert "--setup" in out


def test_help(peer_quality, capsys):
    with pytest.raises(SystemExit) as exc:
        peer_quality.main(["--help"])
    assert exc.value.code == 0
    assert "--peer-python" in capsys.readouterr().out
