"""Quality on the trained tiny demo MoE: held-out perplexity, same calibration for every method.

Only what holds across training runs of the demo recipe is asserted: at low bit widths every
method stays within a bound of the float model, and at 2 bits g64 GPTQ at most halves RTN's
increase (18 of 18 training runs). The finer orderings at 3 bits per row (GPTQ at most half of
RTN: 9 of 14 runs; AWQ below RTN: 10 of 14) are measured, not asserted:
`benchmarks/quality/tiny_recipes.py` across training runs, `benchmarks/quality/awq_paired.py` on one model with
paired intervals (docs/benchmarks.md).
"""

import pytest

from thresher.compress.api import quantize_in_memory, quantize_model
from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import perplexity
from thresher.models import get_adapter, load_model
from thresher.models.quantized import load_quantized_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, QuantizeStage

pytestmark = pytest.mark.slow

CAL = CalibrationConfig(samples=32, seq_len=256)
GROUP = 64  # the tiny model's down projections have 64 inputs: the largest group dividing all


@pytest.fixture(scope="module")
def windows(tiny_tokenizer):
    return eval_windows(tiny_tokenizer, PerplexityConfig(max_windows=24))


@pytest.fixture(scope="module")
def float_ppl(tiny_demo, windows):
    return perplexity(load_model(tiny_demo), windows, show_progress=False).perplexity


def ppl(model, windows):
    return perplexity(model, windows, show_progress=False).perplexity


# the largest increase measured over the demo recipe's training runs was 2.1% at 3 bits per row
# and 5.4% at 2 bits g64 (RTN); a quantizer that breaks costs far more
@pytest.mark.parametrize(("bits", "group_size", "bound"), [(3, -1, 0.04), (2, -1, 0.10),
                                                           (2, GROUP, 0.10)])
def test_low_bit_quantization_stays_near_the_float_model(tiny_demo, windows, float_ppl, bits,
                                                         group_size, bound):
    def increase(**kw):
        stage = QuantizeStage(method="rtn").model_copy(
            update={"bits": bits, "group_size": group_size, **kw})
        model, records = quantize_in_memory(tiny_demo, stage, CAL)
        return ppl(model, windows) - float_ppl

    increases = {m: increase(method=m) for m in ("rtn", "gptq", "awq")}  # AWQ with clipping
    assert all(abs(v) < bound * float_ppl for v in increases.values()), (increases, float_ppl)
    if (bits, group_size) == (2, GROUP):
        assert increases["gptq"] <= 0.5 * increases["rtn"], increases


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "nf4"])
def test_4bit_artifact_matches_in_memory_model_and_float(tiny_demo, windows, float_ppl, tmp_path,
                                                         method):
    stage = QuantizeStage(method=method, group_size=GROUP)
    states = {}
    report = quantize_model(tiny_demo, stage, CAL, tmp_path / method, show_progress=False,
                            observer=lambda i, layer, q: states.__setitem__(
                                i, {k: v.clone() for k, v in layer.state_dict().items()}))
    in_memory = load_model(tiny_demo)
    layers = get_adapter(in_memory.config).layers(in_memory)
    for i, s in states.items():
        layers[i].load_state_dict(s)
    memory_ppl = ppl(in_memory, windows)
    disk_ppl = ppl(load_quantized_model(tmp_path / method), windows)
    assert disk_ppl == pytest.approx(memory_ppl, rel=1e-4)
    assert abs(disk_ppl - float_ppl) < 0.01 * float_ppl
    assert report.metrics()["mean_quant_error"] < 0.05
