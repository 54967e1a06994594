"""Fixtures for the NRI tests: a private containerd 1.7 (NRI on), a private agent, and `reamer nri run`."""
from __future__ import annotations

import signal
import subprocess
import sys
from typing import Iterator

import pytest

from tests.agent.conftest import REPO, Daemon, started_daemon
from tests.conftest import wait_for
from tests.nri.runtime import Containerd, Cri, missing

WHY_NOT = missing()
needs_containerd17 = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")


class PluginProcess:
    """`reamer nri run` against the test's containerd and agent."""

    def __init__(self, agent: Daemon, runtime: Containerd) -> None:
        self.agent, self.runtime = agent, runtime
        self.log_path = runtime.base / "plugin.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "PluginProcess":
        mark = len(self.log())
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "reamer.cli.main", "--socket", self.agent.socket, "nri",
                                      "run", "--nri-socket", self.runtime.nri_socket, "--index", "90", "--stale-after", "3"],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        log.close()
        wait_for(lambda: self._alive() and "registered NRI plugin 90-reamer" in self.log()[mark:], timeout=60,
                 what=f"the NRI plugin to register; log {self.log_path}")
        return self

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the NRI plugin exited with {self.proc.returncode}: {self.log()[-3000:]}")
        return True

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def runtime() -> Iterator[Containerd]:
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    containerd = Containerd()
    try:
        containerd.start()
        yield containerd
    finally:
        containerd.cleanup()


@pytest.fixture(scope="module")
def agent(runtime: Containerd) -> Iterator[Daemon]:
    with started_daemon(reserved_cpus=[]) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def plugin(agent: Daemon, runtime: Containerd) -> Iterator[PluginProcess]:
    process = PluginProcess(agent, runtime)
    try:
        yield process.start()
    finally:
        process.kill()


@pytest.fixture
def cri(runtime: Containerd) -> Iterator[Cri]:
    client = Cri(runtime.socket)
    yield client
    client.close()

