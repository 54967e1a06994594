"""Fixtures for agent tests: a real daemon subprocess on a temp socket/state dir, training processes,
and cleanup of every cgroup and process a test created (also when it fails)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import yaml

from tests.conftest import IS_ROOT, unique_name, wait_for

REPO = Path(__file__).resolve().parents[2]
TEST_RT_RUNTIME_US = 50000  # small: other test suites share the machine-wide 950000 budget

# A "training job": threads that mostly sleep (never spin: they become SCHED_RR), driven by stdin:
# "thread" starts one more thread, "fork" starts a child process (that also sleeps), "exit" ends.
TRAINER = r"""
import os, sys, threading, time, subprocess
def idle():
    while True:
        time.sleep(0.05)
for _ in range(int(sys.argv[1])):
    threading.Thread(target=idle, daemon=True).start()
children = []
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "thread":
        threading.Thread(target=idle, daemon=True).start()
        print("ok", threading.active_count(), flush=True)
    elif cmd == "fork":
        children.append(subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]))
        print("child", children[-1].pid, flush=True)
    elif cmd == "exit":
        break
for child in children:
    child.kill()
"""


def rt_throttling_on() -> bool:
    try:
        return int(Path("/proc/sys/kernel/sched_rt_runtime_us").read_text()) != -1
    except OSError:
        return False


def cgroup_v1_rt() -> bool:
    return Path("/sys/fs/cgroup/cpu/cpu.rt_runtime_us").exists() and Path("/sys/fs/cgroup/cpuset").is_dir()


needs_rt_host = pytest.mark.skipif(
    not (IS_ROOT and rt_throttling_on() and cgroup_v1_rt()),
    reason="needs root, RT throttling on and cgroup v1 cpu/cpuset hierarchies (real SCHED_RR + cgroups)")


class Trainer:
    """A training process the test controls."""

    def __init__(self, threads: int = 2) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def command(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def add_thread(self) -> None:
        self.command("thread")

    def fork(self) -> int:
        return int(self.command("fork").split()[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def thread_policies(pid: int) -> list[tuple[int, int]]:
    """(policy, priority) of every thread of `pid` (os.SCHED_* constants)."""
    out = []
    for entry in Path(f"/proc/{pid}/task").iterdir():
        tid = int(entry.name)
        try:
            out.append((os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority))
        except ProcessLookupError:
            continue
    return out


def all_rr(pid: int, priority: int | None = None) -> bool:
    policies = thread_policies(pid)
    return bool(policies) and all(p == os.SCHED_RR and (priority is None or prio == priority) for p, prio in policies)


def none_rt(pid: int) -> bool:
    return all(p not in (os.SCHED_RR, os.SCHED_FIFO) for p, _ in thread_policies(pid))


def cgroup_path(pid: int, controller: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return ""


def cleanup_cgroups(name: str) -> None:
    """Demote, move out and remove everything under the cgroup `name` (cpu and cpuset trees)."""
    root = Path("/sys/fs/cgroup")
    for controller in ("cpuset", "cpu", "memory"):
        base = root / controller / name
        if not base.is_dir():
            continue
        for tasks in base.rglob("tasks"):
            for tid in tasks.read_text().split():
                try:
                    os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
                except OSError:
                    pass
        for procs in base.rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    (root / controller / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
    for controller in ("cpu", "cpuset", "memory"):  # memory: inference jobs' memory cgroups
        base = root / controller / name
        if not base.is_dir():
            continue
        if controller == "cpu":
            for rt in sorted(base.rglob("cpu.rt_runtime_us"), key=lambda p: -len(p.parts)):
                try:
                    rt.write_text("0")
                except OSError:
                    pass
        for directory in sorted((d for d in base.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            try:
                directory.rmdir()
            except OSError:
                pass
        try:
            base.rmdir()
        except OSError:
            pass


def kill_jobs_under(run_dir: Path) -> None:
    """Kill inference job processes (and their sessions) started for this run dir."""
    marker = str(run_dir)
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if any(marker in part for part in cmd):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            kill_tree(proc.pid)


class Daemon:
    """`python -m reamer.node` on a temp socket, state dir and unique cgroup name."""

    def __init__(self, base: Path, cgroup_name: str, **config: Any) -> None:
        self.base = base
        self.socket = str(base / "r.sock")
        self.state_dir = base / "state"
        self.run_dir = base / "run"
        self.cgroup_name = cgroup_name
        self.config: dict[str, Any] = {
            "socket": self.socket, "state_dir": str(self.state_dir), "run_dir": str(self.run_dir),
            "cgroup_name": cgroup_name, "reserved_cpus": [], "reconcile_interval_s": 0.3,
            "training": {"priority": 20, "rt_runtime_us": TEST_RT_RUNTIME_US}, "log_level": "info",
            # a deploy without a layout searches: keep that search short in tests
            "inference": {"search_max_batch": 2, "search_warmup_s": 0.05, "search_window_s": 0.05},
        }
        for key, value in config.items():
            if isinstance(value, dict) and isinstance(self.config.get(key), dict):
                self.config[key].update(value)
            else:
                self.config[key] = value
        self.config_path = base / "reamer.yaml"
        self.log_path = base / "agent.log"
        self.proc: subprocess.Popen | None = None
        self._client = None
        self.since = 0  # events() shows only events after this id (set per test on a shared daemon)

    def start(self, wait: bool = True, env: dict[str, str] | None = None) -> "Daemon":
        self.config_path.write_text(yaml.safe_dump(self.config))
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "reamer.node", "--config", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})})
        log.close()
        if wait:
            wait_for(self._ready, timeout=60, what=f"the agent to answer on {self.socket}; log: {self.log_path}")
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the agent exited with {self.proc.returncode}: {self.log()[-3000:]}")
        if not os.path.exists(self.socket):
            return False
        try:
            self.client.health()
            return True
        except Exception:  # noqa: BLE001
            return False

    @property
    def client(self):
        from reamer.api.client import ApiClient

        if self._client is None:
            self._client = ApiClient(self.socket, timeout=60)
        return self._client

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._client is not None:
            self._client.close()
            self._client = None
        return self.proc.returncode

    def kill(self) -> None:
        """kill -9 of the agent alone (its job processes live in their own sessions)."""
        self.proc.kill()
        self.proc.wait()
        if self._client is not None:
            self._client.close()
            self._client = None

    def restart(self) -> "Daemon":
        self.stop()
        return self.start()

    def events(self, kind: str | None = None) -> list:
        found = self.client.events(since=self.since).events
        return [e for e in found if kind is None or e.kind == kind]

    def reset(self) -> None:
        """Detach/remove every job so the next test starts from an empty agent."""
        for job in self.client.list_inference_jobs():
            self.client.remove_inference(job.name)
        for job in self.client.list_training_jobs():
            try:
                self.client.detach_training(job.name)
            except Exception:  # noqa: BLE001 - it may have ended meanwhile
                pass
        self.since = self.client.events(since=0).last_id

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            kill_jobs_under(self.run_dir)
            cleanup_cgroups(self.cgroup_name)
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def trainer_factory() -> Iterator:
    made: list[Trainer] = []

    def make(threads: int = 2) -> Trainer:
        trainer = Trainer(threads)
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.stop()


@pytest.fixture
def daemon_factory() -> Iterator:
    """make(**config) -> a started Daemon; everything it made is cleaned up afterwards."""
    made: list[Daemon] = []

    def make(start: bool = True, **config: Any) -> Daemon:
        daemon = _new_daemon(**config)
        made.append(daemon)
        return daemon.start() if start else daemon

    yield make
    for daemon in made:
        daemon.cleanup()


def _new_daemon(**config: Any) -> Daemon:
    # Unix socket paths are limited to ~108 bytes: keep the base dir short.
    base = Path(tempfile.mkdtemp(prefix="rmr-", dir="/tmp"))
    return Daemon(base, unique_name("reamer-test"), **config)


@contextmanager
def started_daemon(**config: Any) -> Iterator[Daemon]:
    """A started Daemon, cleaned up on leaving (also when its start fails)."""
    daemon = _new_daemon(**config)
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[Daemon]:
    """One daemon per test module (starting one costs seconds on a loaded machine)."""
    with started_daemon() as daemon:
        yield daemon


@pytest.fixture
def daemon(shared_daemon: Daemon) -> Iterator[Daemon]:
    """The module's daemon, emptied of jobs before and after the test."""
    if shared_daemon.proc is None or shared_daemon.proc.poll() is not None:
        shared_daemon.start()
    shared_daemon.reset()
    yield shared_daemon
    if shared_daemon.proc.poll() is None:
        shared_daemon.reset()


def wait_event(daemon: Daemon, kind: str, timeout: float = 20.0, job: str | None = None):
    return wait_for(lambda: next((e for e in daemon.events(kind) if job is None or e.job == job), None),
                    timeout=timeout, what=f"event {kind}")


__all__ = ["Daemon", "Trainer", "all_rr", "cgroup_path", "cleanup_cgroups", "daemon", "daemon_factory",
           "needs_rt_host", "none_rt", "shared_daemon", "thread_policies", "trainer_factory", "wait_event", "wait_for"]
