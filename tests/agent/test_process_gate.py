"""ProcessGate: the processes an attach checked are the ones it pins, on real processes (root's attach too:
the identity check is for everyone, the owner check for callers other than root)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reamer.agent.policy import AGENT, Caller, Forbidden
from reamer.agent.training import ProcessGate
from reamer.host.identity import process_facts
from tests.conftest import IS_ROOT
from tests.security.pid_reuse import can_reuse_pids, spawn_at_pid

SLEEP = [sys.executable, "-c", "import time\ntime.sleep(120)"]


@pytest.fixture
def spawned():
    made: list[subprocess.Popen] = []

    def spawn(args=SLEEP, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(args, **kwargs)
        made.append(proc)
        return proc

    yield spawn, made
    for proc in made:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_the_checked_processes_pass_and_a_gone_one_is_dropped(spawned):
    spawn, _ = spawned
    a, b = spawn(), spawn()
    gate = ProcessGate(AGENT, [process_facts(a.pid), process_facts(b.pid)], agent_pid=os.getpid())
    b.kill()
    b.wait(timeout=30)
    assert gate.admit([a.pid, b.pid], []) == [a.pid]


@pytest.mark.skipif(not (IS_ROOT and can_reuse_pids()), reason="needs root and a writable ns_last_pid")
def test_a_named_pid_that_another_process_took_is_refused_even_for_root(spawned):
    spawn, made = spawned
    named = spawn()
    gate = ProcessGate(AGENT, [process_facts(named.pid)], agent_pid=os.getpid())
    named.kill()
    named.wait(timeout=30)
    usurper = spawn_at_pid(named.pid, SLEEP)
    if usurper is None:
        pytest.skip(f"other processes on this machine kept taking pid {named.pid}")
    made.append(usurper)
    with pytest.raises(Forbidden) as info:
        gate.admit([named.pid], [named.pid])
    assert info.value.rule == "process_identity" and str(named.pid) in info.value.message


@pytest.mark.skipif(not IS_ROOT, reason="needs root to start a process as another user")
def test_a_process_found_later_is_checked_before_it_is_admitted(spawned):
    spawn, _ = spawned
    user = Caller(uid=65534, gid=65534, pid=0)
    mine = spawn(user=65534, group=65534)
    gate = ProcessGate(user, [process_facts(mine.pid)], agent_pid=os.getpid())
    assert gate.admit([mine.pid], []) == [mine.pid]
    roots = spawn()  # found later (say, a new child): root's, not the caller's
    with pytest.raises(Forbidden) as info:
        gate.admit([mine.pid], [mine.pid, roots.pid])
    assert info.value.rule == "process_owner" and str(roots.pid) in info.value.message
    with pytest.raises(Forbidden) as info:
        gate.admit([mine.pid], [os.getpid()])  # the agent itself
    assert info.value.rule == "agent_process"
