"""Decode attention on the CPU: the C walk over the paged KV cache against the operator path.

    PYTHONPATH=. python benchmarks/engine/cpu_attention.py --threads 1 2

One new token per sequence attends to its cached context, as in a decode step: thresher's C
walk (``kernels/cpu_attention.c``, what the one-call decode step runs) against the operator
path (the blocks gathered with ``index_select``, then ``scaled_dot_product_attention``), on the
same bf16 caches with scattered blocks of 16 tokens. Enough layers' caches are cycled (256 MB)
that each call reads its keys and values from memory, as a step over many layers does. Prints
the median time per layer, the cache bytes read per second and the ratio; the copy bandwidth of
a 512 MB copy measured in the same run bounds the GB/s column.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from cpu_gemv import copy_bandwidth  # this directory: the script's own

from thresher.serve_kernels.kernels import cpu_attention, cpu_native

SHAPES = [(16, 4, 64), (32, 8, 128)]  # query heads, kv heads, head dim


def operators(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              tables: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """The operator path's decode attention (modeling/attention.py): gather, then SDPA."""
    batch, block = tables.shape[0], k_cache.shape[1]
    flat = tables.reshape(-1)
    shape = (batch, flat.numel() // batch * block, *k_cache.shape[2:])
    k = k_cache.index_select(0, flat).view(shape)[:, :length].transpose(1, 2)
    v = v_cache.index_select(0, flat).view(shape)[:, :length].transpose(1, 2)
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale,
                                          enable_gqa=True).squeeze(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--mb", type=int, default=256, help="MB of layer caches cycled")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if cpu_native.library() is None:
        raise SystemExit("thresher's C kernels do not build here")
    block = 16
    print(f"bf16 caches, blocks of {block}; torch {torch.__version__}\n")
    print("| threads | heads (q / kv) x D | batch | context | KV MB / layer | copy GB/s "
          "| C walk us | GB/s | operators us | GB/s | operators / C walk |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for hq, hkv, d in SHAPES:
            for batch in args.batch:
                for length in args.contexts:
                    per_seq = -(-length // block)
                    blocks = per_seq * batch + 1
                    kv_bytes = 2 * batch * length * hkv * d * 2
                    layers = max(2, min(64, (args.mb << 20) // (2 * blocks * block * hkv * d * 2)))
                    caches = [(torch.randn(blocks, block, hkv, d, generator=gen).bfloat16(),
                               torch.randn(blocks, block, hkv, d, generator=gen).bfloat16())
                              for _ in range(layers)]
                    tables = (torch.randperm(blocks - 1, generator=gen)[: per_seq * batch] + 1
                              ).view(batch, per_seq).to(torch.int32)
                    lens = torch.full((batch,), length, dtype=torch.int32)
                    q = torch.randn(batch, hq, d, generator=gen).bfloat16()
                    scale = d**-0.5
                    c_walk = functools.partial(cpu_attention.paged_decode_c, q,
                                               block_tables=tables, context_lens=lens,
                                               scale=scale, max_context=length)
                    ops_path = functools.partial(operators, q, tables=tables, length=length,
                                                 scale=scale)
                    calls = {"c": lambda k, v, f=c_walk: f(k_cache=k, v_cache=v),
                             "ops": lambda k, v, f=ops_path: f(k_cache=k, v_cache=v)}
                    got = calls["c"](*caches[0])
                    want = calls["ops"](*caches[0])
                    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
                    times: dict[str, list[float]] = {name: [] for name in calls}
                    for _ in range(args.repeats):
                        for name, fn in calls.items():
                            start = time.perf_counter()
                            for k, v in caches:
                                fn(k, v)
                            times[name].append((time.perf_counter() - start) / layers)
                    c, ops = (statistics.median(times[n]) for n in ("c", "ops"))
                    bw = copy_bandwidth()
                    print(f"| {threads} | {hq} / {hkv} x {d} | {batch} | {length} "
                          f"| {kv_bytes / 2**20:.2f} | {bw / 1e9:.1f} | {c * 1e6:.1f} "
                          f"| {kv_bytes / c / 1e9:.1f} | {ops * 1e6:.1f} | {kv_bytes / ops / 1e9:.1f} "
                          f"| {ops / c:.2f}x |", flush=True)
                    del caches


if __name__ == "__main__":
    main()
