"""The import layers of `[tool.importlinter]` in pyproject.toml (docs/architecture.md) hold: `lint-imports`
passes on the package as it is."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("importlinter")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def lint_imports() -> str:
    beside = pathlib.Path(sys.executable).parent / "lint-imports"
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "import-linter is installed but its lint-imports command is not on PATH"
    return found


def test_the_import_layers_hold():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    result = subprocess.run([lint_imports(), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 1 kept, 0 broken." in result.stdout
