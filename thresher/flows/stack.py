"""The local stack: a Prefect server, an MLflow server and N process workers on one machine.

It is the single-machine twin of the multi-machine set-up in docs/operations.md: the same
servers, the same work pool, the same ``compress-variant`` deployment, so the distributed path
can be tried with one command before renting machines. Every process starts in its own session
(process group), its log and its pid go under ``$THRESHER_HOME/stack``, and ``stop_stack`` ends
exactly those process groups: a recorded pid is signalled only while its process is still the
one started (same start time and command line in ``/proc``), since after a reboot or a crash the
pid may belong to anything. The workers run the ``compress-variant`` flow from the installed
thresher package, so the stack needs no source checkout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from thresher.errors import ExecutionError
from thresher.flows.fanout import HEARTBEAT_SECONDS, deploy_variant_flow
from thresher.paths import state_dir, write_text_atomically

log = logging.getLogger(__name__)

STATE_FILE = "stack.json"


@dataclass
class Stack:
    """What ``start_stack`` started: URLs, the pool, one pid (= process group) per process and
    each process's identity (``process_identity``) when it was started."""

    root: str
    prefect_url: str
    mlflow_url: str
    pool: str
    pids: dict[str, int] = field(default_factory=dict)
    identities: dict[str, list[str]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The variables a client exports to use the stack."""
        return {"PREFECT_API_URL": self.prefect_url, "MLFLOW_TRACKING_URI": self.mlflow_url}

    def worker_pids(self) -> dict[str, int]:
        return {name: pid for name, pid in self.pids.items() if name.startswith("worker-")}


def stack_dir() -> Path:
    return state_dir() / "stack"


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def process_identity(pid: int) -> list[str] | None:
    """What tells a process from a later one with the same pid: its start time (clock ticks since
    boot, ``/proc/PID/stat`` field 22) and its command line; None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    start = stat.rpartition(")")[2].split()[19]  # the fields after the command name start at 3
    return [start, *cmdline.decode(errors="replace").split("\0")[:-1]]


def _spawn(name: str, cmd: list[str], stack: Stack, env: dict[str, str]) -> None:
    root = Path(stack.root)
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(root))
    stack.pids[name] = proc.pid
    identity = process_identity(proc.pid)
    deadline = time.time() + 5
    # until the exec: before it the child shows its parent's command line, or none
    while identity is not None and identity[1:] != cmd and time.time() < deadline:
        time.sleep(0.01)
        identity = process_identity(proc.pid)
    if identity is not None:
        stack.identities[name] = identity
    _write(stack)  # recorded before anything can fail, so that `stop_stack` finds it


def _wait_healthy(url: str, name: str, pid: int, root: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not _alive(pid):
            break
        time.sleep(1)
    tail = (root / "logs" / f"{name}.log").read_text()[-2000:]
    raise ExecutionError(f"stack: the {name} did not come up at {url} within {timeout:.0f} s "
                         f"(log: {root / 'logs' / f'{name}.log'}):\n{tail}")


def _check_port_free(name: str, port: int) -> None:
    """Refuse a taken port: a server already there would answer the health check instead."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise ExecutionError(f"stack: port {port} for the {name} server is in use; pass "
                                 f"--{name}-port with a free one") from None


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):  # reap it if this process started it
        os.waitpid(pid, os.WNOHANG)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_stack(workers: int = 2, pool: str = "thresher", prefect_port: int = 4200,
                mlflow_port: int = 5000, root: Path | None = None) -> Stack:
    """Start the servers, create the pool and the deployment, start the workers."""
    root = Path(root) if root else stack_dir()
    if (root / STATE_FILE).is_file():
        raise ExecutionError(f"stack: one is already recorded in {root / STATE_FILE}; run "
                             "`thresher stack down` first")
    for name, port in (("prefect", prefect_port), ("mlflow", mlflow_port)):
        _check_port_free(name, port)
    root.mkdir(parents=True, exist_ok=True)
    prefect_url = f"http://127.0.0.1:{prefect_port}/api"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    stack = Stack(str(root), prefect_url, mlflow_url, pool)
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect"), "PREFECT_API_URL": prefect_url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "MLFLOW_TRACKING_URI": mlflow_url,
           "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS)}
    try:
        _spawn("prefect-server", [
            _bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            stack, env)
        (root / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
        _spawn("mlflow-server", [
            _bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
            "--workers", "1",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow' / 'mlflow.db'}",
            "--artifacts-destination", str(root / "mlflow" / "artifacts"), "--serve-artifacts"],
            stack, env)
        _wait_healthy(f"{prefect_url}/health", "prefect-server", stack.pids["prefect-server"], root)
        _wait_healthy(f"{mlflow_url}/health", "mlflow-server", stack.pids["mlflow-server"], root)
        _create_pool_and_deployment(pool, prefect_url)
        for i in range(1, workers + 1):
            _spawn(f"worker-{i}", [
                _bin("prefect"), "worker", "start", "--pool", pool, "--type", "process",
                "--name", f"worker-{i}", "--limit", "1"], stack, env)
    except BaseException:
        stop_stack(root)
        raise
    return stack


def _create_pool_and_deployment(pool: str, prefect_url: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_url}):
        with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        deploy_variant_flow(pool)


def _write(stack: Stack) -> None:
    write_text_atomically(Path(stack.root) / STATE_FILE, json.dumps(asdict(stack), indent=1))


def read_stack(root: Path | None = None) -> Stack | None:
    path = Path(root or stack_dir()) / STATE_FILE
    return Stack(**json.loads(path.read_text())) if path.is_file() else None


def stop_stack(root: Path | None = None, grace_s: float = 20) -> list[str]:
    """End the recorded process groups (workers first), SIGTERM then SIGKILL; names stopped. A
    process that is gone, or whose pid now belongs to another process, is left alone."""
    stack = read_stack(root)
    if stack is None:
        return []
    order = []
    for name in sorted(stack.pids, key=lambda n: not n.startswith("worker-")):
        pid = stack.pids[name]
        identity = process_identity(pid) if _alive(pid) else None  # _alive reaps a zombie child
        if identity is not None and identity == stack.identities.get(name):
            order.append(name)
        elif identity is not None:
            log.warning("stack: pid %d is no longer the %s it started (now %s); left alone",
                        pid, name, " ".join(identity[1:]) or "a process without a command line")
    for name in order:
        _signal_group(stack.pids[name], signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(_alive(stack.pids[n]) for n in order):
        time.sleep(0.5)
    for name in order:
        _signal_group(stack.pids[name], signal.SIGKILL)
    (Path(stack.root) / STATE_FILE).unlink(missing_ok=True)
    return order


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # each process leads its own session, so its group id is its pid
