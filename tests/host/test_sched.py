"""Real scheduling policies on real threads (root; this test process sits in the root cpu cgroup)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from reamer.host import sched
from reamer.host.errors import HostError, PermissionProblem
from reamer.host.sched import ThreadGone
from tests.conftest import needs_root

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            try:
                sched.set_other(proc.pid)
            except HostError:
                pass
            proc.kill()
        proc.wait(timeout=30)


def _cpu_cgroup_is_root() -> bool:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path == "/"
    return True


def test_threads_of_lists_every_thread() -> None:
    started, stop = threading.Event(), threading.Event()
    native: list[int] = []

    def body() -> None:
        native.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    thread = threading.Thread(target=body)
    thread.start()
    try:
        assert started.wait(30)
        tids = sched.threads_of(os.getpid())
        assert os.getpid() in tids and native[0] in tids
    finally:
        stop.set()
        thread.join()


def test_threads_of_a_gone_process(sleeper: subprocess.Popen) -> None:
    sleeper.kill()
    sleeper.wait()
    with pytest.raises(ThreadGone):
        sched.threads_of(sleeper.pid)


@needs_root
@pytest.mark.skipif(not _cpu_cgroup_is_root(), reason="SCHED_RR test needs the root cpu cgroup (RT group sched)")
def test_rr_other_idle_round_trip(sleeper: subprocess.Popen) -> None:
    pid = sleeper.pid
    assert sched.policy_of(pid) == ("other", 0)
    sched.set_rr(pid, 7)
    assert sched.policy_of(pid) == ("rr", 7)
    sched.set_other(pid)
    assert sched.policy_of(pid) == ("other", 0)
    sched.set_idle_policy(pid)
    assert sched.policy_of(pid) == ("idle", 0)
    sched.set_other(pid)
    assert sched.policy_of(pid) == ("other", 0)


def test_priority_out_of_range(sleeper: subprocess.Popen) -> None:
    with pytest.raises(HostError, match="out of range") as caught:
        sched.set_rr(sleeper.pid, 100)
    assert "1 to 99" in caught.value.fix
    assert sched.policy_of(sleeper.pid)[0] == "other"


def test_vanished_thread_raises_thread_gone(sleeper: subprocess.Popen) -> None:
    sleeper.kill()
    sleeper.wait()
    for action in (lambda: sched.set_rr(sleeper.pid, 5), lambda: sched.set_other(sleeper.pid),
                   lambda: sched.policy_of(sleeper.pid), lambda: sched.set_affinity(sleeper.pid, [0])):
        with pytest.raises(ThreadGone) as caught:
            action()
        assert caught.value.tid == sleeper.pid


def test_affinity(sleeper: subprocess.Popen) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    sched.set_affinity(sleeper.pid, [allowed[-1]])
    assert sched.affinity_of(sleeper.pid) == [allowed[-1]]
    sched.set_affinity(sleeper.pid, allowed)
    assert sched.affinity_of(sleeper.pid) == allowed
    with pytest.raises(HostError, match="cannot pin"):
        sched.set_affinity(sleeper.pid, [4095])
    with pytest.raises(HostError, match="no CPUs"):
        sched.set_affinity(sleeper.pid, [])


@needs_root
def test_non_root_gets_permission_problem(sleeper: subprocess.Popen) -> None:
    code = (
        "import os, sys\n"
        "from reamer.host.sched import set_rr\n"
        "from reamer.host.errors import PermissionProblem\n"
        "os.setuid(65534)\n"
        "try:\n"
        f"    set_rr({sleeper.pid}, 5)\n"
        "except PermissionProblem as e:\n"
        "    print('PermissionProblem:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "PermissionProblem: not allowed to set thread" in result.stdout, result.stderr
    assert "not root" in result.stdout
    assert sched.policy_of(sleeper.pid)[0] == "other"


def test_rt_throttling_real() -> None:
    runtime, period = sched.rt_throttling()
    assert period > 0
    assert runtime == -1 or 0 <= runtime <= period
    assert runtime == int(Path("/proc/sys/kernel/sched_rt_runtime_us").read_text())


def test_rt_throttling_disabled_and_missing(tmp_path: Path) -> None:
    kernel = tmp_path / "sys/kernel"
    kernel.mkdir(parents=True)
    (kernel / "sched_rt_runtime_us").write_text("-1\n")
    (kernel / "sched_rt_period_us").write_text("1000000\n")
    assert sched.rt_throttling(tmp_path) == (-1, 1_000_000)
    with pytest.raises(HostError, match="RT throttling"):
        sched.rt_throttling(tmp_path / "missing")


def test_permission_problem_is_a_host_error() -> None:
    assert issubclass(PermissionProblem, HostError) and issubclass(ThreadGone, HostError)


def test_set_nice_changes_only_the_given_thread():
    import threading

    from reamer.host.sched import ThreadGone, set_nice

    ready, done = threading.Event(), threading.Event()
    tids = {}

    def body():
        tids["t"] = threading.get_native_id()
        ready.set()
        done.wait(10)

    t = threading.Thread(target=body)
    t.start()
    try:
        ready.wait(10)
        set_nice(tids["t"], 19)
        assert os.getpriority(os.PRIO_PROCESS, tids["t"]) == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19
    finally:
        done.set()
        t.join()
    with pytest.raises(ThreadGone):
        set_nice(2**22 + 12345, 19)
