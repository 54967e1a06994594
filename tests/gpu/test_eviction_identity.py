"""GPU eviction signals only the processes that were registered: a registered pid whose process exited and
whose pid another process took (forced with ns_last_pid) is left alone. Fake NVML/MPS, real processes."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from reamer.gpu.eviction import execute_eviction
from reamer.gpu.policies import eviction_plan
from reamer.host.identity import identity_of, is_running
from tests.conftest import IS_ROOT, wait_for
from tests.gpu.fakes import fake_mps
from tests.gpu.test_manager import U0, connect, fake, make_manager, pipe_dir, procs  # noqa: F401 - fixtures
from tests.security.pid_reuse import can_reuse_pids, spawn_at_pid

pytestmark = pytest.mark.skipif(not (IS_ROOT and can_reuse_pids()),
                                reason="needs root and a writable /proc/sys/kernel/ns_last_pid to reuse a pid")

SLEEPER = [sys.executable, "-c", "import time\nprint('ready', flush=True)\ntime.sleep(120)"]


@pytest.fixture
def newcomer():
    """newcomer(pid) -> a process (not the registered one) that took `pid`; killed afterwards."""
    made: list[subprocess.Popen] = []

    def take(pid: int) -> subprocess.Popen:
        proc = spawn_at_pid(pid, SLEEPER, stdout=subprocess.PIPE, text=True)
        if proc is None:
            pytest.skip(f"other processes on this machine kept taking pid {pid}")
        made.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    yield take
    for proc in made:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def exit_and_reap(proc: subprocess.Popen) -> int:
    proc.kill()
    proc.wait(timeout=30)
    return proc.pid


def test_the_executor_leaves_a_reused_pid_alone(procs, newcomer):
    registered = procs()
    identity = identity_of(registered.pid)
    pid = exit_and_reap(registered)
    other = newcomer(pid)
    result = execute_eviction(eviction_plan([pid], None, grace_s=0.2, kill_after_s=0.2), identities={pid: identity})
    assert other.poll() is None, "the process that took the pid was signalled"
    assert result.not_registered == [pid] and result.killed == [] and result.survivors == []
    assert any("not the registered process" in line for line in result.log)
    # The same plan with the newcomer's own identity does signal it: the check is what spared it.
    result = execute_eviction(eviction_plan([pid], None, grace_s=5, kill_after_s=5),
                              identities={pid: identity_of(pid)})
    assert other.wait(timeout=30) == -signal.SIGTERM and result.log == [f"send SIGTERM to {pid}"]


def test_overlimit_eviction_spares_the_process_that_took_a_registered_pid(make_manager, fake, procs,  # noqa: F811
                                                                          newcomer):
    m = make_manager(policies={"health": True, "health_thresholds": {"overlimit_hold_s": 10}})
    m.tick(now=1000)
    m.register_job("train", "0", 30)
    gone, stays = procs(), procs()
    m.update_job("train", pids=[gone.pid, stays.pid])
    connect(m, "train", stays)
    pid = exit_and_reap(gone)
    other = newcomer(pid)
    assert not is_running(m._jobs["train"].identities()[pid]), "the registered process is gone"
    fake.gpu(U0).util = 99
    m.tick(now=1001)  # over the limit: the job's offline processes are evicted
    wait_for(lambda: m.job("train")["state"] == "evicted", timeout=60, what="eviction")
    assert stays.wait(timeout=30) == -signal.SIGTERM, "the registered process is evicted"
    assert other.poll() is None, "the newcomer at a registered pid was signalled"
    assert pid not in m.job("train")["pids"], "a pid whose process is another now is no longer the job's"


def test_fault_handling_spares_the_process_that_took_a_registered_pid(make_manager, procs,  # noqa: F811
                                                                      newcomer):
    m = make_manager()
    m.register_job("train", "0", 30)
    gone, stays = procs(), procs()
    m.update_job("train", pids=[gone.pid, stays.pid])
    connect(m, "train", gone)
    client = connect(m, "train", stays)
    identity = m._jobs["train"].identities()[gone.pid]
    pid = exit_and_reap(gone)
    other = newcomer(pid)
    connect(m, "train", other)  # the newcomer is even an MPS client under that pid (another CUDA program)
    m.tick()
    fake_mps.fault(pipe_dir(m, U0), client["server_pid"])
    m.tick()
    wait_for(lambda: any(e["kind"] in ("gpu_fault_handled", "gpu_fault_recovered") for e in m.events()),
             timeout=60, what="fault handling")
    assert stays.wait(timeout=30) == -signal.SIGTERM, "the registered process is stopped"
    assert other.poll() is None, "fault handling signalled the newcomer at a registered pid"
    assert not is_running(identity)
