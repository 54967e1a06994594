"""The house stays as drawn: `lint-imports` checks pyproject.toml's [tool.importlinter] layer contract over
reamer, and the same contract, pointed at a small package with one import running up a layer, catches it."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")

pytestmark = pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed: "
                                "pip install import-linter==2.16 (the test extra)")


def lint(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--no-cache", "--no-logo", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_reamer_keeps_its_layers():
    result = lint(ROOT)
    assert result.returncode == 0, f"a layer rule is broken (pyproject.toml [tool.importlinter]):\n{result.stdout}"
    assert "0 broken" in result.stdout


def test_the_contract_catches_an_import_that_runs_up_a_layer(tmp_path):
    """The contract as configured (same layers) over a package of empty layers where agent imports api."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    package = tmp_path / "house"
    for layer in contract["layers"]:
        for name in (part.strip() for part in layer.replace(":", "|").split("|")):
            (package / name).mkdir(parents=True, exist_ok=True)
            (package / name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "agent" / "service.py").write_text("from house.api import app\n")
    (package / "api" / "app.py").write_text("")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_package = house\n\n[importlinter:contract:layers]\nname = layers\ntype = layers\n"
        "containers = house\nlayers =\n" + "\n".join(f"    {layer}" for layer in contract["layers"]) + "\n")
    result = subprocess.run([LINT_IMPORTS, "--no-cache", "--no-logo", "--config", str(tmp_path / ".importlinter")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "house.agent.service -> house.api.app" in result.stdout
