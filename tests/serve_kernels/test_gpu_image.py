"""The GPU suite's test section runs with only what the GPU machine's image has.

That image (shared/reference/gpu.md) has torch, Triton, transformers and the engine's few
dependencies, but no bitsandbytes, Prefect, MLflow, lm-eval or datasets. A module-level import of
any of them in a test file the suite runs stops pytest at collection, and then no ``cuda`` test
runs at all. Here the suite's files are collected, and the NF4 kernel tests run, by a Python that
does not see those packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("bitsandbytes", "prefect", "mlflow", "lm_eval", "datasets")
CARRIED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection")  # in the carry
SUITE_FILES = ["tests/serve_kernels/test_cuda.py", "tests/serve_kernels/kernels"]  # gpu_suite.py


def _absent(entry: str, absent: tuple[str, ...]) -> bool:
    """A site-packages entry (package, module or dist-info) of one of the ``absent``
    distributions."""
    name = entry.lower().replace("-", "_")
    return any(name == a or name.startswith((f"{a}.", f"{a}-", f"{a}_")) for a in absent)


def _site_without(site: Path, absent: tuple[str, ...]) -> Path:
    """This environment's site-packages as links in ``site``, less the ``absent`` distributions:
    importing or looking up one of them there behaves as on a machine that never had it."""
    for source in {Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()}:
        for entry in source.iterdir():
            if not _absent(entry.name, absent) and not entry.name.endswith(".pth") \
                    and not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    return site


@pytest.fixture(scope="module")
def image_site(tmp_path_factory) -> Path:
    """The image once the suite has installed its carry."""
    return _site_without(tmp_path_factory.mktemp("gpu-image-site"), ABSENT)


def run_on_image(site: Path, args: list[str]) -> subprocess.CompletedProcess:
    """pytest in a Python that sees ``site`` and the checkout only (``-S``: no site-packages)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    cmd = [sys.executable, "-S", "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_image_lacks_them(image_site):
    probe = f"import importlib.util as u; print([u.find_spec(m) is None for m in {ABSENT!r}])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(image_site)])}
    out = subprocess.run([sys.executable, "-S", "-c", probe], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == str([True] * len(ABSENT))


def test_suite_collects_without_packages_the_gpu_image_lacks(image_site):
    proc = run_on_image(image_site, ["--collect-only", "-q", *SUITE_FILES])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert any("test_nf4.py::test_triton_matches_ref" in line for line in collected)
    assert any("test_cuda.py::" in line for line in collected)


def test_nf4_kernel_tests_run_without_bitsandbytes(image_site):
    proc = run_on_image(image_site, ["-q", "-rs", "tests/serve_kernels/kernels/test_nf4.py",
                                     "-k", "not aot"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" in summary, summary  # bitsandbytes' own tests skip


def test_suite_starts_before_its_carry_is_installed(tmp_path):
    """The suite installs the carried wheels (pydantic, which thresher needs) in ``main``:
    anything it imports before that must not need them, or the run stops at its first line."""
    site = _site_without(tmp_path, ABSENT + CARRIED)
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = ("import runpy, sys; sys.argv = ['gpu_suite.py', '--help']; "
             "runpy.run_path('benchmarks/scale/gpu_suite.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-S", "-c", probe], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--carry" in proc.stdout
    lacks = subprocess.run([sys.executable, "-S", "-c", "import pydantic"], env=env,
                           capture_output=True, text=True)
    assert lacks.returncode != 0  # the probe ran where pydantic is absent


def test_parity_models_runs_the_named_ones_and_refuses_unknown_names(tmp_path):
    """``--parity-models`` spends the device's minutes on the models not yet measured; a
    misspelt name is refused before the run with the bundle's names."""
    import runpy

    suite = runpy.run_path(str(ROOT / "benchmarks/scale/gpu_suite.py"), run_name="gpu_suite")
    for where in ("demo-models/tiny-1", "artifacts/glm4_moe-random", "artifacts/demo-tiny-nf4"):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "config.json").write_text("{}")
    names = [p.name for p in suite["parity_models"](tmp_path)]
    assert names == ["tiny-1", "demo-tiny-nf4", "glm4_moe-random"]
    chosen = suite["parity_models"](tmp_path, ("glm4_moe-random", "tiny-1"))
    assert [p.name for p in chosen] == ["tiny-1", "glm4_moe-random"]
    with pytest.raises(ValueError, match="gpt_oss-random not in the bundle.*demo-tiny-nf4"):
        suite["parity_models"](tmp_path, ("gpt_oss-random",))
