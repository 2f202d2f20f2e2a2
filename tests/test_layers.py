"""The import contract of docs/architecture.md: each layer imports only from the layers below it.

Runs import-linter on the ``[tool.importlinter]`` contract in pyproject.toml; when an import
breaks it, the failure shows import-linter's report, which names the importing module, the
imported one and the line.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layers_contract_holds():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports), "--no-cache", "--config", "pyproject.toml"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"import contract broken:\n{result.stdout}{result.stderr}"
