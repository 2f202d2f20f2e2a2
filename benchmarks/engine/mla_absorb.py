"""Latent attention decode: kv_b absorbed into the query and the output, or expanded per step.

One decode token of one MLA layer at DeepSeek-V3's head shapes (latent 512, rotary key 64, nope
128, v 128) over a cache of L latent rows, computed both ways on the same random weights (checked
equal first): absorbed (the query to latent space, attention over the cache rows, the output back
through kv_b's value part: what ``serve_kernels/modeling/mla.py`` runs) and expanded (kv_b over
every cached latent, then ordinary attention). Prints ms per token and the ratio.

    PYTHONPATH=. python benchmarks/engine/mla_absorb.py --heads 16 --context 256 1024 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

RANK, ROPE, NOPE, V = 512, 64, 128, 128


def _time(fn, repeats: int, *args) -> float:
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats * 1e3


def absorbed(q_nope, q_rot, cache, kv_b, scale) -> torch.Tensor:
    per_head = kv_b.view(q_nope.shape[0], NOPE + V, RANK)
    query = torch.cat([torch.einsum("hn,hnr->hr", q_nope, per_head[:, :NOPE]), q_rot], -1)
    probs = torch.softmax(query @ cache.T * scale, -1)
    return torch.einsum("hr,hvr->hv", probs @ cache[:, :RANK], per_head[:, NOPE:])


def expanded(q_nope, q_rot, cache, kv_b, scale) -> torch.Tensor:
    length, heads = cache.shape[0], q_nope.shape[0]
    kv = (cache[:, :RANK] @ kv_b.T).view(length, heads, NOPE + V)
    keys = torch.cat([kv[..., :NOPE], cache[:, None, RANK:].expand(length, heads, ROPE)], -1)
    scores = torch.einsum("hd,lhd->hl", torch.cat([q_nope, q_rot], -1), keys) * scale
    return torch.einsum("hl,lhv->hv", torch.softmax(scores, -1), kv[..., NOPE:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h = args.heads
    kv_b = torch.randn(h * (NOPE + V), RANK) / RANK**0.5
    q_nope, q_rot = torch.randn(h, NOPE), torch.randn(h, ROPE)
    scale = (NOPE + ROPE) ** -0.5
    print("| heads | context | absorbed ms | expanded ms | expanded / absorbed |\n"
          "|---|---|---|---|---|")
    for length in args.context:
        inputs = (q_nope, q_rot, torch.randn(length, RANK + ROPE), kv_b, scale)
        torch.testing.assert_close(absorbed(*inputs), expanded(*inputs), rtol=1e-3, atol=1e-3)
        a, e = _time(absorbed, args.repeats, *inputs), _time(expanded, args.repeats, *inputs)
        print(f"| {h} | {length} | {a:.2f} | {e:.2f} | {e / a:.1f} |")


if __name__ == "__main__":
    main()
