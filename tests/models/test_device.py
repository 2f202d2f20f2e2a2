"""The compression stages' device: resolving ``--device``, the activation budget and its offload
path (on the CPU through the same placement code a GPU takes), and, with a GPU, CPU against CUDA
on the trained demo model."""

import pytest
import torch

from tests.conftest import CALIBRATION_FILE
from thresher import recipe
from thresher.compress.api import quantize_in_memory, quantize_model
from thresher.compress.gptq import GPTQ
from thresher.compress.methods.protocol import grid_spec
from thresher.data.windows import calibration_windows
from thresher.errors import CompressionError, RecipeError
from thresher.models.device import ActivationStore, Compute, resolve_device
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.observer import observe_experts
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=6, seq_len=32)
HAS_CUDA = torch.cuda.is_available()


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    with pytest.raises(CompressionError, match="choose 'auto'"):
        resolve_device("gpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the error of a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(CompressionError, match="no CUDA device is available.*--device cpu"):
            resolve_device(spec)


def test_budget_defaults():
    assert Compute.resolve("cpu").budget_bytes == float("inf")  # host memory is the device
    assert Compute.resolve("cpu", 0).budget_bytes == 0
    assert Compute.resolve("cpu", 1.5).budget_bytes == 1.5 * 2**30


def test_activation_store_keeps_the_budget_and_offloads_the_rest():
    batches = [torch.randn(4, 8, 16) for _ in range(5)]  # 2 KiB each
    store = ActivationStore(torch.device("cpu"), budget_bytes=2.5 * batches[0].nbytes)
    for b in batches:
        store.append(b)
    assert store.offloaded == 3 and store.device_bytes == 2 * batches[0].nbytes
    assert store._items[0] is batches[0]  # kept as it is
    assert store._items[4] is not batches[4]  # a host copy
    for b, got in zip(batches, store, strict=True):
        assert torch.equal(b, got)
    store[0] = torch.zeros(4, 8, 16)  # a replaced batch frees its share of the budget first
    store[3] = torch.ones(4, 8, 16)
    assert store.offloaded == 3 and torch.equal(store[3], torch.ones(4, 8, 16))
    store[3] = torch.ones(4, 8, 16, dtype=torch.float64)  # too large for what is left
    assert store.offloaded == 3 and store[3].dtype == torch.float64
    nothing = ActivationStore(torch.device("cpu"), budget_bytes=0)
    nothing.append(batches[0])
    assert nothing.offloaded == 1 and torch.equal(nothing[0], batches[0])


def _same_models(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("stage", [
    # experts fall back to RTN (their Hessians are still captured): GPTQ's column loop is slow
    QuantizeStage(method="gptq", bits=4, group_size=32, min_expert_tokens=10**9),
    QuantizeStage(method="awq", bits=4, group_size=32, clip=False),
], ids=["gptq", "awq"])
def test_everything_offloaded_gives_identical_results(tiny_demo, stage):
    """Budget 0 sends every activation batch through host copies: bit-identical on demo:tiny."""
    on_device, rec_a = quantize_in_memory(tiny_demo, stage, CAL, device="cpu")
    offloaded, rec_b = quantize_in_memory(tiny_demo, stage, CAL, device="cpu",
                                          offload_budget_gb=0)
    _same_models(on_device, offloaded)
    assert [r.errors for r in rec_a] == [r.errors for r in rec_b]
    assert all(r.peak_device_mb is None for r in rec_a)  # no device number on the CPU


def test_observer_offloaded_gives_identical_statistics(tiny_demo, tiny_tokenizer):
    windows = calibration_windows(tiny_tokenizer, CAL)
    kept = observe_experts(LayerwiseModel(tiny_demo, device="cpu"), windows, batch_size=2,
                           show_progress=False)
    moved = observe_experts(LayerwiseModel(tiny_demo, device="cpu"), windows, batch_size=2,
                            show_progress=False, offload_budget_bytes=0)
    assert len(kept) == len(moved) > 0
    for a, b in zip(kept, moved, strict=True):
        assert torch.equal(a.count, b.count) and a.count.sum() > 0
        assert torch.equal(a.gated_norm_sum, b.gated_norm_sum)
        assert torch.equal(a.max_activation, b.max_activation)


def test_report_names_the_device(tiny_demo, tmp_path):
    stage = QuantizeStage(method="rtn", bits=4, group_size=32)
    report = quantize_model(tiny_demo, stage, CAL, tmp_path / "q", device="cpu",
                            show_progress=False)
    assert report.device == "cpu" and report.peak_device_mb is None
    assert "peak_device_mb" not in report.metrics() and report.peak_rss_mb > 0
    assert all(layer["peak_device_mb"] is None for layer in report.layers)


def test_device_is_an_execution_setting_not_content():
    r = recipe.parse_recipe({"name": "r", "model": "demo:tiny", "variants": [{"name": "a"}],
                             "execution": {"device": "cuda:1", "offload_budget_gb": 4}})
    assert r.execution.device == "cuda:1"
    schema = recipe.recipe_json_schema()["$defs"]["ExecutionConfig"]["properties"]
    assert {"device", "offload_budget_gb"} <= set(schema)
    with pytest.raises(RecipeError, match="execution.device"):
        recipe.parse_recipe({"name": "r", "model": "demo:tiny", "variants": [{"name": "a"}],
                             "execution": {"device": "gpu"}})


# --- on a GPU: the same stages on CUDA agree with the CPU up to floating-point order ------------


def _relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / a.float().norm().clamp(min=1e-12))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gptq_hessian_and_codes_agree_on_cuda():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen)
    w = torch.randn(64, 128, generator=gen)
    spec = grid_spec(4, True, "gptq")
    results = []
    for device in ("cpu", "cuda"):
        h = GPTQ(128, "w", device)
        h.add_batch(x.to(device))
        q, _ = h.quantize(w.to(device), spec, group_size=32)
        results.append((h.H.cpu(), q))
    (h_cpu, q_cpu), (h_gpu, q_gpu) = results
    assert torch.allclose(h_cpu, h_gpu, rtol=1e-4, atol=1e-5)
    assert q_gpu.codes.device.type == "cuda"
    agree = (q_cpu.codes == q_gpu.codes.cpu()).float().mean()
    assert agree > 0.99
    assert _relative_diff(q_cpu.dequantize(), q_gpu.dequantize().cpu()) < 0.02


@pytest.mark.parametrize("stage", [
    QuantizeStage(method="gptq", bits=4, group_size=32),
    QuantizeStage(method="awq", bits=4, group_size=32),
    QuantizeStage(method="rtn", bits=4, group_size=32),
], ids=["gptq", "awq", "rtn"])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_quantize_on_cuda_matches_cpu(tiny_demo, stage):
    cpu, rec_cpu = quantize_in_memory(tiny_demo, stage, CAL, device="cpu")
    gpu, rec_gpu = quantize_in_memory(tiny_demo, stage, CAL, device="cuda")
    for k, v in cpu.state_dict().items():
        assert _relative_diff(v, gpu.state_dict()[k]) < 0.02, k
    assert all(r.peak_device_mb and r.peak_device_mb > 0 for r in rec_gpu)
    err_cpu = sum(r.mean_error for r in rec_cpu)
    assert abs(sum(r.mean_error for r in rec_gpu) - err_cpu) < 0.05 * err_cpu


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_observer_on_cuda_matches_cpu(tiny_demo, tiny_tokenizer):
    windows = calibration_windows(tiny_tokenizer, CAL)
    cpu = observe_experts(LayerwiseModel(tiny_demo, device="cpu"), windows, show_progress=False)
    gpu = observe_experts(LayerwiseModel(tiny_demo, device="cuda"), windows, show_progress=False,
                          offload_budget_bytes=0)  # offloaded to pinned memory and back
    for a, b in zip(cpu, gpu, strict=True):
        assert b.count.device.type == "cpu"
        assert (a.count - b.count).abs().sum() <= 0.01 * a.count.sum()  # rare routing ties
        assert _relative_diff(a.gated_norm_sum, b.gated_norm_sum) < 0.01


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_quantize_report_records_device_memory(tiny_demo, tmp_path):
    report = quantize_model(tiny_demo, QuantizeStage(method="gptq", bits=4, group_size=32), CAL,
                            tmp_path / "q", device="cuda", show_progress=False)
    assert report.device.startswith("cuda") and report.metrics()["peak_device_mb"] > 0
    assert all(layer["peak_device_mb"] > 0 for layer in report.layers)
