"""Round-to-nearest as a method: every weight on its own min-max grid, no calibration data."""

from __future__ import annotations

from typing import ClassVar

from thresher.compress.methods.protocol import LayerJob, grid_spec
from thresher.compress.rtn import rtn_quantize
from thresher.compress.targets import all_targets
from thresher.formats.gptq import GPTQ
from thresher.recipe import RTNStage


class RTNMethod:
    name: ClassVar[str] = "rtn"
    format: ClassVar[str] = GPTQ.kind
    calibrated: ClassVar[bool] = False

    def __init__(self, stage: RTNStage):
        self.stage = stage
        self.grid = grid_spec(stage.bits, stage.sym, self.format, stage.scale_search)

    def quantization_config(self, skip: list[str]) -> dict:
        # No Hessian: the GPTQ-only fields get the values of a plain, in-order GPTQ checkpoint.
        return GPTQ.quantization_config(
            bits=self.stage.bits, group_size=self.stage.group_size, sym=self.grid.sym, desc_act=False,
            static_groups=True, damp_percent=0.01, true_sequential=False,
            modules_to_not_convert=skip)

    def quantize_layer(self, job: LayerJob) -> None:
        for t in job.progress(all_targets(job.parts), f"layer {job.parts.idx} rtn"):
            job.commit(t, rtn_quantize(t.weight, self.grid, self.stage.group_size))
