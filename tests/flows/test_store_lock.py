"""Two processes reach the same store key at once: one computes the stage, the other waits on
the key's lock and reuses the entry (what two workers sharing a store do)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.conftest import ROOT
from thresher.flows.store import ArtifactStore, stage_key
from thresher.models.source import hash_directory
from thresher.recipe import CalibrationConfig, Stage

pytestmark = pytest.mark.slow

# Each process imports everything, says it is about to ask, then asks for the stage (a real
# frequency prune of the tiny demo model) and reports when it finished. The test holds the key's
# lock until both have asked, so both reach the same prefix at once however loaded the machine is.
# Times are CLOCK_MONOTONIC (shared by every process on Linux): the wall clock can be stepped
# between two readings, which once put a worker's finish 1 ms before the lock's release.
WORKER = """
import json, sys, time
from pathlib import Path
from thresher.flows.stages import run_stage
from thresher.models.source import hash_directory
from thresher.recipe import CalibrationConfig, Stage

model, store, me = sys.argv[1:4]
stage = Stage.model_validate({"prune": {"method": "frequency", "ratio": 0.25}})
calibration = CalibrationConfig(samples=4, seq_len=32)
input_hash = hash_directory(model)
Path(me).touch()
out = run_stage.fn(model, input_hash, stage, calibration, store, label="lock")
print(json.dumps({**out, "done": time.monotonic()}))
"""


def test_two_processes_same_key_compute_once(tiny_demo, tmp_path):
    store = tmp_path / "store"
    stage = Stage.model_validate({"prune": {"method": "frequency", "ratio": 0.25}})
    key = stage_key(hash_directory(str(tiny_demo)), stage,
                    CalibrationConfig(samples=4, seq_len=32))
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    with ArtifactStore(store).locked(key):
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tiny_demo), str(store),
                                   str(ready[i])], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        deadline = time.monotonic() + 240
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline, "the workers did not start"
            assert all(p.poll() is None for p in procs), procs[0].stderr or procs[1].stderr
            time.sleep(0.05)
        time.sleep(1.0)  # both are now blocked on the key's lock
        released = time.monotonic()  # one clock for all processes, never stepped by NTP
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    computed = [r for r in results if not r["cache_hit"]]
    reused = [r for r in results if r["cache_hit"]]
    assert len(computed) == 1 and len(reused) == 1
    # both waited for the lock; the reuser got it after the other had committed the entry
    assert released < computed[0]["done"] < reused[0]["done"]
    assert reused[0]["path"] == computed[0]["path"]
    assert reused[0]["content_hash"] == computed[0]["content_hash"]
    entries = list(Path(store).glob("*/*/.thresher-complete.json"))
    assert len(entries) == 1
    assert not list((Path(store) / ".scratch").iterdir())
