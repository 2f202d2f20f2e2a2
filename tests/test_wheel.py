"""thresher as a user who installs the wheel gets it: built from this source tree, installed in a
fresh virtual environment, run from a directory outside the checkout.

The wheel is built offline (``pip wheel --no-build-isolation``, this environment's setuptools)
and installed with ``--no-deps`` into a new venv that sees this environment's site-packages for
the dependencies (a ``.pth`` file), so nothing is downloaded; the checkout's own thresher is not
on that venv's path, which the test checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_WHEEL = ["thresher/configs/demo.yaml", "thresher/py.typed",
            "thresher/evaluate/tasks/utils.py", "thresher/evaluate/tasks/stdlib_next_line.yaml",
            "thresher/serve_kernels/kernels/cpu_q4.c",
            "thresher/serve_kernels/kernels/cpu_common.h",
            "thresher/recipe/__init__.py", "thresher/recipe/stages.py", "thresher/flows/sweep.py"]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_package_data_patterns_name_files_that_exist():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["thresher"]
    for pattern in patterns:
        assert list((ROOT / "thresher").glob(pattern)), f"package-data {pattern!r} matches nothing"


def test_root_demo_recipe_is_the_packaged_one():
    """configs/demo.yaml (where the README and the benchmarks point) is a copy of the recipe the
    package embeds (what `thresher demo` runs); edit both."""
    assert (ROOT / "configs" / "demo.yaml").read_bytes() == \
        (ROOT / "thresher" / "configs" / "demo.yaml").read_bytes()


def test_demo_prints_the_embedded_recipe():
    from typer.testing import CliRunner

    from thresher.cli import DEMO_RECIPE, app

    result = CliRunner().invoke(app, ["demo", "--print-recipe"])
    assert result.exit_code == 0, result.output
    assert result.output == DEMO_RECIPE.read_text()
    assert DEMO_RECIPE.is_relative_to(ROOT / "thresher")  # inside the package


@pytest.mark.slow
def test_the_installed_wheel_runs_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(tmp_path / "dist"), str(src)], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("thresher-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [f for f in IN_WHEEL if f not in names], sorted(names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(python), "-c", purelib], tmp_path, env).strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
          "--ignore-installed", str(wheel)], tmp_path, env)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = _run([str(python), "-c", "import thresher, thresher.cli as c; "
                  "print(thresher.__file__); print(c.DEMO_RECIPE)"], outside, env).split()
    assert all(Path(p).is_relative_to(site / "thresher") for p in where), where
    thresher = str(venv / "bin" / "thresher")
    assert "Usage" in _run([thresher, "--help"], outside, env)
    (outside / "demo.yaml").write_text(_run([thresher, "demo", "--print-recipe"], outside, env))
    for recipe in ("demo.yaml", where[1]):
        assert "recipe is valid" in _run([thresher, "check", recipe], outside, env)
    # the installed code finds its task files (it generates the tasks from them) and its kernels'
    # C sources
    out = _run([str(python), "-c", "from thresher.evaluate.builtin_tasks import "
                "prepare_builtin_tasks as p; from thresher.serve_kernels.kernels import "
                "cpu_native as n; print(p()); print(*n.SOURCES, *n.HEADERS)"], outside, env).split()
    assert (Path(out[0]) / "utils.py").is_file()
    assert all(Path(f).is_file() and Path(f).is_relative_to(site) for f in out[1:]), out
