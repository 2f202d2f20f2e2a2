"""Shared fixtures: offline environment, a temporary THRESHER_HOME, per-test timeouts, the
trained demo model, random-init family models."""

from __future__ import annotations

import os

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)
# The demo models' matrices are all small enough that a CPU engine would serve them dequantized
# (serve_kernels/kernels/cpu_dense.py); the tests keep them on the packed 4-bit kernels, which they
# test, unless a test asks for the default (tests/serve_kernels/engine/test_cpu_dense.py).
os.environ.setdefault("THRESHER_CPU_DENSE_MAX", "0")

import atexit  # noqa: E402
import json.decoder  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from thresher.paths import demo_models_dir  # noqa: E402

# Every test's state (store, MLflow, compiled kernels, task files) goes to a temporary
# THRESHER_HOME, never the user's; the demo models stay where the user keeps them, since training
# `tiny` takes minutes. Set at import: test modules build the C kernels while they are collected.
os.environ.setdefault("THRESHER_DEMO_MODELS", str(demo_models_dir()))
TEST_HOME = tempfile.mkdtemp(prefix="thresher-test-home-")
atexit.register(shutil.rmtree, TEST_HOME, ignore_errors=True)  # after every fixture's teardown
os.environ["THRESHER_HOME"] = TEST_HOME
# A C kernel that fails to compile fails the tests with the compiler's message (for users the
# engine warns and keeps torch's operators); only a machine without a C compiler skips them.
os.environ.setdefault("THRESHER_REQUIRE_C_KERNELS", "1")
# Per-test timeouts: pyproject's `timeout` for most tests; more for the marked ones (a distributed
# sweep takes about 9 minutes on 2 idle cores, most of it heartbeat grace and a retry).
MARKED_TIMEOUT_S = {"distributed": 1800, "slow": 900}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("timeout"):
            continue
        marked = [s for name, s in MARKED_TIMEOUT_S.items() if item.get_closest_marker(name)]
        if marked:
            item.add_marker(pytest.mark.timeout(marked[0]))


# Without a GPU, every Triton kernel in the session runs in Triton's interpreter. This must hold
# before any test imports the kernel modules: a kernel decorated in compiled mode and launched
# later under the interpreter fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Calibration text for tests that quantize or prune: a standard-library file, so the artifacts
# (and the near-ties some tests compare) do not move when thresher's own sources are edited.
CALIBRATION_FILE = json.decoder.__file__


@pytest.fixture(scope="session")
def tiny_demo() -> Path:
    """The trained `tiny` demo model (built once, then reused from the cache)."""
    from thresher.data.demo_model import build_demo_model

    return build_demo_model("tiny")


@pytest.fixture(scope="session")
def small_demo() -> Path:
    """The `small` demo model if it is already cached (`make demo` builds it); tests using it are
    skipped otherwise, since training it takes about 7.5 minutes on 2 cores."""
    from thresher.data.demo_model import demo_model_dir

    path = demo_model_dir("small")
    if not (path / "config.json").is_file():
        pytest.skip("demo:small is not built here; `thresher demo-model build small` builds it")
    return path


@pytest.fixture(scope="session")
def tiny_damage_pruned(tiny_demo, tmp_path_factory) -> tuple[Path, list[int]]:
    """demo:tiny half-pruned by REAP with a damage budget, whose MoE layers keep different expert
    counts (``layer_num_experts``), and those counts; pruned once per session (~10 s)."""
    import json.decoder

    from thresher.prune.api import prune_model
    from thresher.recipe import CalibrationConfig, FilesSource, PruneStage

    # a file outside this repository, so that editing thresher does not change the split
    cal = CalibrationConfig(source=FilesSource(files=[json.decoder.__file__]), samples=8, seq_len=64)
    out = tmp_path_factory.mktemp("damage") / "pruned"
    report = prune_model(tiny_demo, PruneStage(method="reap", ratio=0.5, budget="damage"), cal,
                         out, show_progress=False)
    counts = [len(layer.kept) for layer in report.layers]
    assert len(set(counts)) > 1, counts  # the premise of every test using it: an uneven split
    return out, counts


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_demo):
    from thresher.models import load_tokenizer

    return load_tokenizer(tiny_demo)


def build_random_model(model_type: str, seed: int = 0, **kw):
    """A random-init model of ``model_type`` with non-trivial norms and router weights."""
    from transformers import AutoModelForCausalLM

    from thresher.models.random_init import random_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(random_config(model_type, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # distinct per channel, so a wrong mapping shows up
            elif "gate.weight" in name and p.dim() == 2 and "gate_proj" not in name:
                p.normal_(0, 0.5)  # routers start at zero in some families
            elif ".router." in name:  # gpt-oss: weight and bias
                p.normal_(0, 0.5)
            elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.normal_(0, 0.1)  # gpt-oss's expert biases start at zero
            elif name.endswith("self_attn.sinks"):  # gpt-oss: large enough to matter
                p.normal_(0, 1.0)
            elif name.endswith("e_score_correction_bias"):  # ERNIE-4.5's is a parameter
                p.uniform_(-0.1, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # starts at zero: make it choose
                b.uniform_(-0.2, 0.2)
    return model.eval()


def first_moe_layer(adapter, model):
    """The first MoE decoder layer (GLM-4.5 starts with dense ones)."""
    return next(layer for layer in adapter.layers(model) if adapter.is_moe_layer(layer))
