"""NF4 as a method: each weight quantized by bitsandbytes from the dtype the checkpoint stores."""

from __future__ import annotations

from typing import ClassVar

from thresher.compress.methods.protocol import LayerJob
from thresher.compress.nf4 import nf4_quantize
from thresher.compress.targets import all_targets
from thresher.formats.nf4 import NF4
from thresher.recipe import NF4Stage


class NF4Method:
    name: ClassVar[str] = "nf4"
    format: ClassVar[str] = NF4.kind
    calibrated: ClassVar[bool] = False
    grid = None

    def __init__(self, stage: NF4Stage):
        self.stage = stage

    def quantization_config(self, skip: list[str]) -> dict:
        return NF4.quantization_config(double_quant=self.stage.double_quant,
                                       compute_dtype=self.stage.compute_dtype, skip_modules=skip)

    def quantize_layer(self, job: LayerJob) -> None:
        for t in job.progress(all_targets(job.parts), f"layer {job.parts.idx} nf4"):
            job.commit(t, nf4_quantize(t.weight, self.stage.double_quant, job.store_dtype))
