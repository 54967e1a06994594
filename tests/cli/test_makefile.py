"""`make demo` installs the package alone (no test or bench extras: torch, transformers, ...); `make test` and
`make test-hosts` still install them."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def dry_run(target: str, venv: Path) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    return subprocess.run(["make", "-n", "-C", str(REPO), f"VENV={venv}", target], capture_output=True, text=True,
                          check=True).stdout


def test_demo_installs_no_extras(tmp_path):
    commands = dry_run("demo", tmp_path / "venv")
    assert "pip install --quiet -e .\n" in commands
    assert "[test" not in commands and "bench]" not in commands
    assert "reamer demo" in commands


@pytest.mark.parametrize("target", ["test", "test-hosts"])
def test_tests_install_the_extras(tmp_path, target):
    assert "-e '.[test,bench]'" in dry_run(target, tmp_path / "venv")
