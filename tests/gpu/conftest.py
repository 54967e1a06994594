"""Fixtures for the GPU layer: the fake MPS control binary and cleanup of every daemon it starts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.gpu.fakes import fake_mps

FAKES_DIR = Path(__file__).parent / "fakes"
FAKE_CONTROL = FAKES_DIR / "nvidia-cuda-mps-control"


@pytest.fixture(scope="session")
def fake_control(tmp_path_factory) -> str:
    """The fake control binary, started by this interpreter without site (-SE): `env python3` can be a
    slow shim, and the manager runs the binary for every MPS command."""
    body = FAKE_CONTROL.read_text().split("\n", 1)[1]
    path = tmp_path_factory.mktemp("fakebin") / "nvidia-cuda-mps-control"
    path.write_text(f"#!{sys.executable} -SE\nFAKES_DIR = {str(FAKES_DIR)!r}\n{body}")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def run_dir(tmp_path: Path):
    """A run directory; every fake MPS daemon started under it is killed afterwards, pass or fail."""
    yield tmp_path
    for pid_file in tmp_path.rglob(fake_mps.PID_FILE):
        fake_mps.kill_daemon(pid_file.parent)
