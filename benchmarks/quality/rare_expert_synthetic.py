"""GPTQ against RTN on few calibration tokens, with and without the rare-expert shrink (synthetic).

Held-out output error of GPTQ against RTN on few calibration tokens, with and without the
rare-expert rule's diagonal shrink (docs/quantization.md's table).

    python benchmarks/quality/rare_expert_synthetic.py [--columns 1024] [--bits 4]

Inputs are either isotropic (nothing for GPTQ to exploit) or correlated with a decaying
spectrum; 8 channels are 10x larger in both. Prints, per calibration token count, GPTQ's error
on 4,096 held-out tokens relative to RTN's, for shrink r = min(1, c * columns / tokens) at
c = 0 (plain GPTQ), 0.1 (the rule), 0.3 and 1.
"""

from __future__ import annotations

import argparse

import torch

from thresher.compress.gptq import GPTQ
from thresher.compress.rtn import rtn_quantize
from thresher.quant.grid import GridSpec

CONSTANTS = (0.0, 0.1, 0.3, 1.0)
TOKENS = (8, 32, 128, 512, 1024, 4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--columns", type=int, default=1024)
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args()
    d = args.columns
    spec = GridSpec(args.bits, sym=True, min_zero=1)
    print("| inputs | tokens | " + " | ".join(f"c = {c}" for c in CONSTANTS) + " |")
    print("|---|---|" + "---|" * len(CONSTANTS))
    for inputs in ("isotropic", "correlated"):
        torch.manual_seed(0)
        mix = (torch.eye(d) if inputs == "isotropic" else
               torch.randn(d, d) * (torch.arange(1, d + 1).float() ** -0.5).unsqueeze(1))
        scale = torch.ones(d)
        scale[:8] = 10

        def sample(n: int, mix: torch.Tensor = mix, scale: torch.Tensor = scale) -> torch.Tensor:
            return (torch.randn(n, d) @ mix) * scale + 0.1 * torch.randn(n, d)

        w = torch.randn(128, d) * 0.02
        held_out = sample(4096)

        def error(q: torch.Tensor, w: torch.Tensor = w, x: torch.Tensor = held_out) -> float:
            return float(((x @ (q - w).T) ** 2).mean())

        rtn = error(rtn_quantize(w, spec, 128).dequantize())
        for n in TOKENS:
            x = sample(n)
            ratios = []
            for c in CONSTANTS:
                h = GPTQ(d, "synthetic")
                h.add_batch(x)
                q, _ = h.quantize(w, spec, 128, diag_shrink=min(1.0, c * d / n))
                ratios.append(error(q.dequantize()) / rtn)
            print(f"| {inputs} | {n} | " + " | ".join(f"{r:.3g}" for r in ratios) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
