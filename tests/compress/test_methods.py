"""Every recipe method has a registered method module, and every method writes a packable format."""

from thresher.compress.methods import METHODS, method_for
from thresher.formats.registry import FORMATS
from thresher.recipe import QUANTIZE_STAGES, QuantizeStage


def test_every_recipe_method_is_registered_with_a_packable_format():
    assert set(METHODS) == set(QUANTIZE_STAGES)
    for name, method in METHODS.items():
        assert method.name == name
        built = method_for(QuantizeStage(method=name))
        assert isinstance(built, method)
        assert built.format in FORMATS


def test_awq_writes_gemm_at_4_bits_and_gptq_at_other_widths():
    assert method_for(QuantizeStage(method="awq")).format == "awq"
    for bits in (2, 3, 8):
        awq = method_for(QuantizeStage(method="awq", bits=bits))
        assert awq.format == "gptq" and awq.grid.min_zero == 1  # GPTQ v1 stores zero - 1
        assert awq.quantization_config([])["bits"] == bits


def test_calibration_is_asked_for_by_gptq_and_awq_only():
    assert {n for n, m in METHODS.items() if m.calibrated} == {"gptq", "awq"}
