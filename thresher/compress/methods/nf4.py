"""NF4 as a method: each weight quantized by bitsandbytes from the dtype the checkpoint stores."""

from __future__ import annotations

from typing import ClassVar

from thresher.compress.methods.protocol import LayerJob
from thresher.compress.nf4 import nf4_quantize
from thresher.compress.targets import all_targets
from thresher.formats import nf4 as nf4_format
from thresher.recipe import NF4Stage


class NF4Method:
    name: ClassVar[str] = "nf4"
    format: ClassVar[str] = "nf4"
    calibrated: ClassVar[bool] = False
    grid = None

    def __init__(self, stage: NF4Stage):
        self.stage = stage

    def quantization_config(self, skip: list[str]) -> dict:
        return nf4_format.quantization_config(self.stage.double_quant, self.stage.compute_dtype,
                                              skip)

    def quantize_layer(self, job: LayerJob) -> None:
        for t in job.progress(all_targets(job.parts), f"layer {job.parts.idx} nf4"):
            job.commit(t, nf4_quantize(t.weight, self.stage.double_quant, job.store_dtype))
