"""Dense decode matmuls against the memory: cpu_step.c's bf16 / fp32 GEMV, torch's and oneDNN's.

    PYTHONPATH=. python benchmarks/engine/cpu_gemv.py --threads 1 2 --rows 1 16

``--rows`` activation rows (one decode batch) times a [N, K] weight streamed from memory: ``--mb``
of weight copies per shape are cycled so that no call finds its matrix in cache. Prints GB/s of
weight bytes read for thresher's C matmul (``kernels/cpu_step.c``, the one-call decode step's:
on the AMX tiles where the CPU has them, and on the vector units alone), torch's row-major
``F.linear`` and oneDNN's blocked layout (``kernels/cpu_blocked.py``; bf16 only), each against a
512 MB copy (read + write bytes) timed in the same run, best of ``--passes`` interleaved passes.
"""

from __future__ import annotations

import argparse
import time

import torch

from thresher.serve_kernels.kernels import cpu_blocked, cpu_native, cpu_step

SHAPES = [(4096, 1024), (1024, 2048), (2048, 1024), (1536, 1024)]


def copy_bandwidth(mb: int = 512) -> float:
    """Bytes per second a large tensor copy moves (read + write), best of five."""
    src = torch.ones(mb << 18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def rate(fn, copies: list, nbytes: int) -> float:
    """GB/s of weight bytes over one pass through every copy."""
    fn(copies[0])
    start = time.perf_counter()
    for w in copies:
        fn(w)
    return nbytes * len(copies) / (time.perf_counter() - start) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--mb", type=int, default=512, help="MB of weight copies per shape")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="activation rows (batch)")
    args = ap.parse_args()
    lib = cpu_native.library()
    if lib is None:
        raise SystemExit("thresher's C kernels do not build here")
    has_amx = cpu_step.amx()
    print(f"cpu_step matmul ISA: {lib.thr_dense_isa().decode()}{'+amx' if has_amx else ''}")
    print("| threads | dtype | rows | N x K | copy GB/s | cpu_step GB/s | % copy "
          "| cpu_step vector GB/s | % copy | torch GB/s | % copy | oneDNN blocked GB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.dtypes:
            dtype = getattr(torch, name)
            for n, k in SHAPES:
                nbytes = n * k * dtype.itemsize
                copies = [torch.randn(n, k).to(dtype) for _ in range(max(2, (args.mb << 20)
                                                                         // nbytes))]
                blocked = ([cpu_blocked.block(w) for w in copies]
                           if dtype != torch.float32 and cpu_blocked.blocked_supported(dtype)
                           else None)
                for rows in args.rows:
                    x = torch.randn(rows, k).to(dtype)
                    x32 = x.float()  # a bf16 model's activations are bf16 values (AMX, vdpbf16ps)
                    best = dict.fromkeys("cvtb", 0.0)
                    bw = 0.0
                    for _ in range(args.passes):
                        bw = max(bw, copy_bandwidth())
                        for key in "cv" if has_amx and dtype == torch.bfloat16 else "c":
                            cpu_step.amx(key == "c")
                            best[key] = max(best[key], rate(
                                lambda w, x32=x32: cpu_step.dense_matmul(x32, w), copies, nbytes))
                        cpu_step.amx(True)
                        best["t"] = max(best["t"], rate(
                            lambda w, x=x: torch.nn.functional.linear(x, w), copies, nbytes))
                        if blocked:
                            best["b"] = max(best["b"], rate(
                                lambda w, x=x: cpu_blocked.blocked_matmul(x, w), blocked, nbytes))
                    cells = [f"{best[key]:.1f} | {best[key] * 1e9 / bw:.0%}" if best[key]
                             else "- | -" for key in "cvtb"]
                    print(f"| {threads} | {name} | {rows} | {n} x {k} | {bw / 1e9:.1f} | "
                          f"{' | '.join(cells)} |", flush=True)
                del copies, blocked


if __name__ == "__main__":
    main()
