"""The importance matrix (llama.cpp's ``--imatrix``) from thresher's own calibration windows.

For every weight matrix, the mean over calibration tokens of each input column's square: the
diagonal of the Hessian that GPTQ accumulates, and what llama.cpp's ``llama-imatrix`` collects.
Routed experts see only the tokens routed to them (their gate and up projections read the MoE
block's input, their down projection act(gate x) * up x), so each expert has its own row, as in
llama.cpp's imatrix for ``ffn_*_exps``. The full-precision model runs layer by layer, as the
quantizers' calibration does, so memory stays near one decoder layer.

With ``hessians`` the pass also keeps each matrix's full second moment E[x x^T] (its diagonal is
the importance), which GGUF's GPTQ rounding (``block_gptq``) compensates errors against: one
[C, C] matrix per weight matrix, expert matrices included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from thresher.models.adapters import MLP_PROJECTIONS, Adapter
from thresher.models.layerwise import LayerwiseModel
from thresher.models.loading import model_calibration_windows
from thresher.recipe import CalibrationConfig

log = logging.getLogger(__name__)


@dataclass
class ImportanceMatrix:
    """Per-column mean squares of each weight's inputs, keyed by checkpoint key (``….weight``)."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    windows: int = 0
    dataset: str = ""
    hessians: dict[str, torch.Tensor] | None = None  # key -> sum x x^T, when collected


    def add(self, key: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if key not in self.sums:
            self.sums[key] = torch.zeros(x.shape[-1], dtype=torch.float64)
            self.tokens[key] = 0
        self.sums[key] += (x * x).sum(dim=0).double()
        self.tokens[key] += x.shape[0]
        if self.hessians is not None:
            xd = x.double()
            if key not in self.hessians:
                self.hessians[key] = torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64)
            self.hessians[key] += xd.T @ xd

    def get(self, key: str) -> np.ndarray | None:
        """The importance of ``key``'s input columns; None if no calibration token reached it
        (an expert the router never picked), which leaves it to the unweighted search."""
        count = self.tokens.get(key, 0)
        if count == 0:
            return None
        return (self.sums[key] / count).float().numpy()

    def hessian(self, key: str) -> np.ndarray | None:
        """E[x x^T] of ``key``'s inputs [C, C] (float32); None if not collected or no token
        reached it."""
        count = self.tokens.get(key, 0)
        if self.hessians is None or count == 0:
            return None
        return (self.hessians[key] / count).float().numpy()

    def __len__(self) -> int:
        return sum(1 for n in self.tokens.values() if n)


def compute_importance(model_dir: str | Path, calibration: CalibrationConfig | None = None, *,
                       windows: torch.Tensor | None = None, batch_size: int = 8,
                       show_progress: bool = True, hessians: bool = False) -> ImportanceMatrix:
    """Run the calibration windows through the plain checkpoint in ``model_dir`` and collect the
    importance of every weight matrix's inputs (the output head's too; not the embeddings');
    ``hessians`` keeps their full second moments too, for GPTQ rounding.
    ``windows`` (token ids [N, S]) runs those instead, for a caller that has them tokenized."""
    calibration = calibration or CalibrationConfig()
    lw = LayerwiseModel(model_dir)
    if windows is None:
        windows = model_calibration_windows(model_dir, calibration)
    imatrix = ImportanceMatrix(windows=int(windows.shape[0]), dataset=str(calibration.source),
                               hessians={} if hessians else None)
    lw.load_outer()
    with torch.no_grad():
        hidden = [lw.embed(b) for b in windows.split(batch_size)]
        for i in tqdm(range(lw.num_layers), desc="imatrix", unit="layer",
                      disable=not show_progress):
            layer = lw.load_layer(i)
            handles = _hooks(lw.adapter, layer, i, imatrix)
            try:
                hidden = [lw.layer_forward(i, h) for h in hidden]
            finally:
                for handle in handles:
                    handle.remove()
            lw.release_layer(i)
        final_norm = lw.adapter.final_norm(lw.model)
        for h in hidden:
            imatrix.add(lw.adapter.disk_lm_head_key() + ".weight", final_norm(h))
    log.info("importance matrix: %d weights from %d windows of %d tokens", len(imatrix),
             windows.shape[0], windows.shape[1])
    return imatrix


def _hooks(adapter: Adapter, layer: nn.Module, i: int, imatrix: ImportanceMatrix) -> list:
    """Forward pre-hooks that add each weight's input of decoder layer ``i`` to ``imatrix``."""
    linears: dict[str, nn.Module] = {
        adapter.disk_attention_key(i, name): module
        for name, module in adapter.attention_projections(layer).items()}
    if adapter.is_moe_layer(layer):
        shared = adapter.shared_expert(layer)
        if shared is not None:
            linears.update({adapter.disk_shared_expert_key(i, proj): getattr(shared, proj)
                            for proj in MLP_PROJECTIONS})
    else:
        linears.update({adapter.disk_dense_mlp_key(i, proj): module
                        for proj, module in adapter.dense_mlp_projections(layer).items()})

    def linear_hook(key: str):
        def hook(module, args, kwargs):
            imatrix.add(key, args[0] if args else kwargs["input"])
        return hook

    def experts_hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        for e in range(module.gate_up_proj.shape[0]):
            rows = (index == e).any(dim=1)
            if not rows.any():
                continue
            xe = x[rows]
            imatrix.add(adapter.disk_expert_key(i, e, "gate") + ".weight", xe)
            imatrix.add(adapter.disk_expert_key(i, e, "up") + ".weight", xe)
            imatrix.add(adapter.disk_expert_key(i, e, "down") + ".weight",
                        adapter.expert_hidden(layer, e, xe))

    handles = [module.register_forward_pre_hook(linear_hook(key + ".weight"), with_kwargs=True)
               for key, module in linears.items()]
    if adapter.is_moe_layer(layer):
        handles.append(adapter.experts(layer).register_forward_pre_hook(experts_hook,
                                                                        with_kwargs=True))
    return handles
