"""Artifacts the export tests share: the tiny demo quantized to 4 bits in groups of 32."""

import pytest

from thresher.recipe import CalibrationConfig, QuantizeStage

CAL = CalibrationConfig(samples=4, seq_len=64)


@pytest.fixture(scope="session")
def packed(tiny_demo, tmp_path_factory):
    """The tiny demo quantized by GPTQ (asymmetric zeros) and AWQ, 4 bits in groups of 32."""
    from thresher.compress.api import quantize_model

    root = tmp_path_factory.mktemp("packed")
    for method, kw in (("gptq", {"sym": False}), ("awq", {})):
        quantize_model(tiny_demo, QuantizeStage(method=method, group_size=32, **kw), CAL,
                       root / method, show_progress=False)
    return root
