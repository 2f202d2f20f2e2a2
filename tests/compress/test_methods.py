"""Every recipe method has a registered method module, and every method writes a packable format."""

from thresher.compress.methods import METHODS, method_for
from thresher.formats.registry import PACKERS
from thresher.recipe import QUANTIZE_STAGES, QuantizeStage


def test_every_recipe_method_is_registered_with_a_packable_format():
    assert set(METHODS) == set(QUANTIZE_STAGES)
    for name, method in METHODS.items():
        assert method.name == name
        assert method.format in PACKERS
        assert isinstance(method_for(QuantizeStage(method=name)), method)


def test_calibration_is_asked_for_by_gptq_and_awq_only():
    assert {n for n, m in METHODS.items() if m.calibrated} == {"gptq", "awq"}
