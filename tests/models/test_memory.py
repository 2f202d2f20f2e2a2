"""A load that cannot fit in memory is refused with a message, before the OOM killer's SIGKILL."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from thresher import resources
from thresher.errors import ModelError
from thresher.models import inspect, load_model
from thresher.models.inspect import resident_bytes


def test_available_memory_reads_this_machine():
    room = resources.available_memory()
    assert room is not None  # the suite runs on Linux
    free, where = room
    total = sum(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text()
                .splitlines() if line.startswith(("MemTotal:", "SwapTotal:")))
    assert 0 < free <= total and where


def test_a_container_limit_caps_it_without_its_page_cache(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\nSwapFree: 1000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{6 << 30}\n")  # 5 GiB of it page cache
    (cgroup / "memory.stat").write_text(f"anon {1 << 30}\nfile {5 << 30}\n")
    monkeypatch.setattr(resources, "_MEMINFO", meminfo)
    monkeypatch.setattr(resources, "_CGROUP", cgroup)
    assert resources.available_memory() == (7 << 30, "this container's memory limit")
    (cgroup / "memory.max").write_text("max\n")
    assert resources.available_memory() == ((60000000 + 1000) * 1024, "free memory and swap")
    meminfo.write_text("garbage")
    assert resources.available_memory() is None


def test_resident_bytes_counts_floats_at_the_serving_width(tiny_demo):
    values = sum(t.numel() for t in load_file(tiny_demo / "model.safetensors").values())
    assert resident_bytes(tiny_demo, 4) == 4 * values
    assert resident_bytes(tiny_demo, 2) == 2 * values


def test_load_model_and_the_engine_refuse_what_cannot_fit(monkeypatch, tiny_demo):
    from thresher.serve_kernels import LLM

    need = resident_bytes(tiny_demo, 4)
    monkeypatch.setattr(inspect, "available_memory", lambda: (need - 1, "free memory and swap"))
    with pytest.raises(ModelError, match=r"loading \S+/tiny-\w+ in float32 needs at least \d+ MiB of "
                                         r"memory; \d+ MiB is available here \(free memory"):
        load_model(tiny_demo)
    with pytest.raises(ModelError, match=r"serving \S+/tiny-\w+ in float32 .* Serve a quantized "
                                         r"variant of it or --dtype bfloat16"):
        LLM(tiny_demo, dtype="float32")
    load_model(tiny_demo, "bfloat16")  # half the bytes fit
    monkeypatch.setattr(inspect, "available_memory", lambda: (need, "free memory and swap"))
    load_model(tiny_demo)


def test_serve_prints_the_refusal_as_one_line(monkeypatch, tiny_demo):
    from typer.testing import CliRunner

    from thresher.cli import app

    monkeypatch.setattr(inspect, "available_memory", lambda: (1 << 20, "free memory and swap"))
    result = CliRunner().invoke(app, ["serve", str(tiny_demo), "--dtype", "float32"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "needs at least 6 MiB of memory; 1 MiB is available here" in text
    assert "Traceback" not in result.output
