"""The eviction executor on real processes, with a recording terminate_client."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from reamer.gpu.eviction import execute_eviction
from reamer.host.identity import process_alive
from reamer.gpu.policies import eviction_plan


def spawn(ignore_term: bool) -> subprocess.Popen:
    code = ("import signal,time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "print('ready', flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def procs():
    made: list[subprocess.Popen] = []
    yield lambda ignore_term=False: made.append(spawn(ignore_term)) or made[-1]
    for p in made:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_polite_process_exits_on_sigterm_and_is_not_killed(procs):
    p = procs()
    calls = []
    result = execute_eviction(eviction_plan([p.pid], 77, grace_s=30, kill_after_s=30),
                              lambda s, c: calls.append((s, c)))
    assert p.wait(timeout=30) == -signal.SIGTERM
    assert calls == [] and result.killed == [] and result.survivors == []
    assert result.log == [f"send SIGTERM to {p.pid}"]


def test_stubborn_process_gets_terminate_client_then_sigkill(procs):
    stubborn, polite = procs(ignore_term=True), procs()
    calls = []
    result = execute_eviction(eviction_plan([stubborn.pid, polite.pid], 77, grace_s=0.3, kill_after_s=0.3),
                              lambda s, c: calls.append((s, c)))
    assert stubborn.wait(timeout=30) == -signal.SIGKILL
    assert polite.wait(timeout=30) == -signal.SIGTERM
    assert calls == [(77, stubborn.pid)]
    assert result.terminated_clients == [stubborn.pid] and result.killed == [stubborn.pid]
    assert result.survivors == [] and not process_alive(stubborn.pid)


def test_terminate_client_failure_is_logged_and_kill_still_happens(procs):
    p = procs(ignore_term=True)

    def refuse(server: int, client: int) -> None:
        raise RuntimeError("no such client")

    result = execute_eviction(eviction_plan([p.pid], 5, grace_s=0.2, kill_after_s=0.2), refuse)
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert any("failed: no such client" in line for line in result.log)


def test_gone_processes_are_skipped():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    result = execute_eviction(eviction_plan([p.pid], None, grace_s=60, kill_after_s=60))
    assert result.log == [] and result.survivors == []
