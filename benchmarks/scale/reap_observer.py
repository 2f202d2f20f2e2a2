"""REAP observer cost: routed-tokens-only (thresher) vs running every expert on every token.

Both observers walk the model one decoder layer at a time on the same calibration windows and
must produce the same statistics; the naive one computes all experts' outputs for all tokens (as
the REAP reference observer's forward hook does) and keeps the routed ones afterwards. Each runs in
a fresh process; memory is its peak resident set during observation above the resident set
before it (``thresher.resources``: Linux VmHWM, reset at the start).

    python benchmarks/scale/reap_observer.py --model demo:small --samples 64
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform

import torch

from thresher.data.windows import calibration_windows
from thresher.models import load_tokenizer, resolve_model
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.observer import ExpertObserver, observe_experts
from thresher.recipe import CalibrationConfig
from thresher.resources import measure, peak_rss_mb, reset_peak


class EveryExpertObserver(ExpertObserver):
    """Same statistics, computed the naive way: every expert on every token, then masked."""

    @torch.no_grad()
    def add_batch(self, hidden: torch.Tensor) -> None:
        routing = self.adapter.route(self.layer, hidden, self.config)
        s = self.stats
        s.tokens += hidden.shape[0]
        outputs = torch.stack([self.adapter.expert_forward(self.layer, j, hidden)
                               for j in range(s.num_experts)])  # [E, T, H]
        norms = outputs.double().norm(dim=-1)  # [E, T]
        gates = torch.zeros_like(routing.probs).scatter(
            1, routing.top_k_index, self.gates(routing))
        routed = torch.zeros_like(routing.probs, dtype=torch.bool).scatter(
            1, routing.top_k_index, True)
        s.count += routed.sum(0)
        s.norm_sum += (norms * routed.T).sum(1)
        s.gated_norm_sum += (norms * gates.T.double() * routed.T).sum(1)


OBSERVERS = {"routed tokens only (thresher)": ExpertObserver,
             "every expert on every token": EveryExpertObserver}


def _run(name: str, model_dir: str, windows: torch.Tensor, batch_size: int, threads: int, queue):
    torch.set_num_threads(threads)
    lw = LayerwiseModel(model_dir)
    reset_peak()
    base_mb = peak_rss_mb()  # right after a reset the peak is the current resident set
    with measure() as usage:
        stats = observe_experts(lw, windows, batch_size=batch_size, show_progress=False,
                                observer_cls=OBSERVERS[name])
    queue.put((usage.wall_seconds, usage.peak_rss_mb - base_mb, [(s.count.tolist(), s.gated_norm_sum.tolist()) for s in stats]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo:small")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    model_dir = str(resolve_model(args.model))
    cal = CalibrationConfig(samples=args.samples, seq_len=args.seq_len)
    windows = calibration_windows(load_tokenizer(model_dir), cal)
    ctx = mp.get_context("spawn")
    results = {}
    for name in OBSERVERS:
        queue = ctx.Queue()
        proc = ctx.Process(target=_run, args=(name, model_dir, windows, args.batch_size,
                                              args.threads, queue))
        proc.start()
        results[name] = queue.get()
        proc.join()
    (fast_s, fast_mb, fast), (slow_s, slow_mb, slow) = results.values()
    for (c1, r1), (c2, r2) in zip(fast, slow, strict=True):
        assert c1 == c2, "the two observers disagree on routing"
        torch.testing.assert_close(torch.tensor(r1), torch.tensor(r2), rtol=1e-4, atol=1e-6)

    tokens = args.samples * args.seq_len
    print(f"REAP observer on {args.model}: {args.samples} x {args.seq_len} = {tokens:,} calibration "
          f"tokens, batch {args.batch_size}, {args.threads} threads, {platform.machine()} "
          f"(statistics of both observers agree)\n")
    print("| observer | seconds | tokens/s | peak memory above start (MB) |")
    print("|---|---:|---:|---:|")
    for name, (sec, mb, _) in results.items():
        print(f"| {name} | {sec:.1f} | {tokens / sec:,.0f} | {mb:.0f} |")
    print(f"| ratio naive / thresher | {slow_s / fast_s:.2f}x | | {slow_mb / fast_mb:.2f}x |")


if __name__ == "__main__":
    main()
