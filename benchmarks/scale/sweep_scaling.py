"""Wall time of one sweep on a local stack with 1 worker against 2 workers.

    python benchmarks/scale/sweep_scaling.py                       # demo:tiny, 2 REAP ratios x 2 RTN bits
    python benchmarks/scale/sweep_scaling.py --workers 1 2 4

Run it from the repository root with ``PYTHONPATH=.`` when the editable install points at
another checkout.

For each worker count it starts ``thresher stack up``'s stack (a Prefect server, an MLflow
server, N process workers with one flow run each) on free ports in a temporary directory, runs
the same sweep through ``compress(..., work_pool=...)`` with an empty store, and times the
parent flow from submission to the comparison report. Stack start-up is not timed. Prints a
table with the speed-up against the first worker count.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import tempfile
import time
from pathlib import Path

from thresher.flows.stack import start_stack, stop_stack
from thresher.flows.sweep import parse_recipe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep(model: str, samples: int) -> dict:
    return {
        "name": "sweep-scaling", "model": model,
        "calibration": {"samples": samples, "seq_len": 128},
        "eval": {"perplexity": {"seq_len": 128, "max_windows": 8}},
        "sweep": {"prune": {"method": "reap", "ratio": [0.25, 0.5]},
                  "quantize": {"method": "rtn", "bits": [3, 4], "group_size": 64}},
        "validate": {"enabled": False},
        "execution": {"poll_seconds": 1},
    }


def run_once(workers: int, recipe: dict, root: Path) -> float:
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from thresher.flows.compress import compress

    stack = start_stack(workers, "bench", free_port(), free_port(), root=root / "stack")
    try:
        with temporary_settings(updates={PREFECT_API_URL: stack.prefect_url}):
            start = time.perf_counter()
            summary = compress(parse_recipe(recipe), tracking_uri=stack.mlflow_url,
                               store_dir=str(root / "store"), publish_dir=str(root / "pub"),
                               work_pool="bench")
            wall = time.perf_counter() - start
            # send this process's pending Prefect events while their server still runs: after
            # stop_stack they would be retried against a dead API until the process gives up
            EventsWorker.drain_all(timeout=30)
    finally:
        stop_stack(root / "stack")
    assert len(summary["variants"]) == 5  # the four variants and the base model, the reference
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:tiny")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--samples", type=int, default=16, help="calibration windows")
    args = ap.parse_args()
    from thresher.models.source import resolve_model

    model = str(resolve_model(args.model))
    rows = []
    for n in args.workers:
        with tempfile.TemporaryDirectory(prefix="sweep-scaling-") as tmp:
            rows.append((n, run_once(n, sweep(model, args.samples), Path(tmp))))
    print(f"\nsweep of 4 variants (2 groups) on {args.model}; {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")
    print(f"| workers | wall s | speed-up vs {rows[0][0]} worker(s) |")
    print("|---:|---:|---:|")
    for n, wall in rows:
        print(f"| {n} | {wall:.1f} | {rows[0][1] / wall:.2f}x |")


if __name__ == "__main__":
    main()
