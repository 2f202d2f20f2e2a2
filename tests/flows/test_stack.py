"""`thresher stack down` ends only the processes `stack up` started: a recorded pid that now
belongs to another process (the stack died, the pid was reused) is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import time

from thresher.flows.stack import STATE_FILE, Stack, _spawn, process_identity, read_stack, stop_stack


def test_stop_ends_its_own_processes_and_leaves_a_reused_pid_alone(tmp_path):
    stack = Stack(str(tmp_path), "http://127.0.0.1:1/api", "http://127.0.0.1:2", "pool")
    _spawn("worker-1", ["sleep", "300"], stack, dict(os.environ))
    ours = stack.pids["worker-1"]
    assert read_stack(tmp_path) == stack  # recorded at once, identity included
    assert stack.identities["worker-1"][1:] == ["sleep", "300"]

    # what a stale stack.json looks like after the pid was reused by an unrelated process
    stranger = subprocess.Popen(["sleep", "301"], start_new_session=True)
    stack.pids["mlflow-server"] = stranger.pid
    stack.identities["mlflow-server"] = ["1", "mlflow", "server"]
    gone = subprocess.Popen(["true"], start_new_session=True)
    gone.wait()
    stack.pids["prefect-server"] = gone.pid
    stack.identities["prefect-server"] = process_identity(os.getpid())  # any; the pid is free
    (tmp_path / STATE_FILE).write_text(json.dumps(stack.__dict__))
    try:
        assert stop_stack(tmp_path, grace_s=10) == ["worker-1"]
        assert process_identity(ours) is None  # ended (and reaped by stop_stack)
        assert stranger.poll() is None  # untouched
        assert not (tmp_path / STATE_FILE).exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_identity_is_start_time_and_command_line():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10  # until the child has exec'd (a loaded machine is slow)
        while (first := process_identity(proc.pid)) and first[1:] != ["sleep", "30"]:
            assert time.monotonic() < deadline, first
            time.sleep(0.01)
        assert first is not None and first[1:] == ["sleep", "30"] and first[0].isdigit()
        assert process_identity(proc.pid) == first
    finally:
        proc.kill()
        proc.wait()
    assert process_identity(proc.pid) is None
