"""Helpers for the host-level tests inside a lab VM: commands, systemd, the agent's API, threads' scheduling.

Everything here is slow inside the VM (Python runs about 13x slower under emulation), so waits are
generous and poll instead of sleeping a fixed time."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
SOCKET = "/run/reamer/reamer.sock"
WORKLOAD = Path(__file__).resolve().parent / "workload.py"
T = TypeVar("T")

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from lab.profiles import PROFILES  # noqa: E402  (one description of each profile for the driver and the tests)

PROFILE = PROFILES.get(os.environ.get("REAMER_LAB_PROFILE", ""))


def sh(cmd: str | list[str], *, timeout: float = 300, check: bool = True, env: dict | None = None) -> str:
    """Run a command; returns stdout (stderr appended on failure in the assertion message)."""
    result = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout,
                            env=None if env is None else {**os.environ, **env})
    if check and result.returncode != 0:
        pytest.fail(f"{cmd!r} exited {result.returncode}\nstdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}")
    return result.stdout


def wait_for(predicate: Callable[[], T], timeout: float = 120.0, interval: float = 0.5, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
        except AssertionError as exc:  # a predicate may assert to say why it is not there yet
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last: {last})" if last else ""))
        time.sleep(interval)


# --- systemd -------------------------------------------------------------------------------------

def unit_props(unit: str = "reamer", *names: str) -> dict[str, str]:
    out = sh(["systemctl", "show", unit, *(f"--property={n}" for n in names)])
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def main_pid(unit: str = "reamer") -> int:
    return int(unit_props(unit, "MainPID")["MainPID"])


def wait_active(previous_pid: int | None = None, timeout: float = 240) -> int:
    """Wait until the unit is active with a main pid (other than `previous_pid`) and its socket answers."""
    def ready() -> int | None:
        props = unit_props("reamer", "ActiveState", "SubState", "MainPID")
        pid = int(props["MainPID"])
        if props["ActiveState"] != "active" or pid == 0 or pid == previous_pid:
            return None
        return pid if api_get("/healthz", quiet=True) is not None else None
    return wait_for(ready, timeout=timeout, interval=1.0, what="reamer.service active with a new agent")


def journal(unit: str = "reamer", since_cursor: str | None = None) -> str:
    cmd = ["journalctl", "-u", unit, "--no-pager", "-o", "cat", "-b"]
    return sh(cmd, check=False)


# --- the agent's API -----------------------------------------------------------------------------

def _client(timeout: float = 120.0):
    from reamer.api.client import ApiClient
    return ApiClient(SOCKET, timeout=timeout)


def api(method: str, path: str, body: Any = None, timeout: float = 300.0) -> Any:
    with _client(timeout) as client:
        return client.request(method, path, json=body)


def api_error(method: str, path: str, body: Any = None):
    """The ApiError an API call raises (fails the test when it succeeds)."""
    from reamer.api.client import ApiError
    with pytest.raises(ApiError) as info:
        api(method, path, body)
    return info.value


def api_get(path: str, quiet: bool = False) -> Any:
    from reamer.host.errors import ReamerError
    try:
        return api("GET", path, timeout=30)
    except ReamerError:
        if quiet:
            return None
        raise


# --- threads ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ThreadSched:
    tid: int
    policy: int
    priority: int
    affinity: frozenset[int]

    @property
    def rr(self) -> bool:
        return self.policy == os.SCHED_RR


def threads_of(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []


def sched_of(tid: int) -> ThreadSched | None:
    try:
        return ThreadSched(tid, os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority,
                           frozenset(os.sched_getaffinity(tid)))
    except (ProcessLookupError, FileNotFoundError):
        return None


def descendants(pid: int) -> list[int]:
    import psutil
    try:
        return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def all_threads(pid: int) -> list[ThreadSched]:
    return [s for p in descendants(pid) for t in threads_of(p) if (s := sched_of(t)) is not None]


def cgroup_text(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text()


# --- the training workload ------------------------------------------------------------------------

class Workload:
    """A stand-in training process (Debian's python3, local disk: quick to start): threads that sleep in
    short steps; SIGUSR1 starts one more thread, SIGUSR2 forks a child with a thread of its own."""

    def __init__(self, threads: int = 3, user: str | None = None) -> None:
        cmd = ["/usr/bin/python3", str(WORKLOAD), str(threads)]
        if user:
            cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline()  # "ready" once its threads run
        assert line.strip() == "ready", f"workload did not start: {line!r}"
        self.pid = self.proc.pid

    def thread_count(self) -> int:
        return sum(len(threads_of(p)) for p in descendants(self.pid))

    def add_thread(self) -> None:
        before = self.thread_count()
        os.kill(self.pid, signal.SIGUSR1)
        wait_for(lambda: self.thread_count() > before, timeout=60, what="the workload's late thread")

    def add_child(self) -> int:
        before = set(descendants(self.pid))
        os.kill(self.pid, signal.SIGUSR2)
        new = wait_for(lambda: [p for p in descendants(self.pid) if p not in before and len(threads_of(p)) >= 2],
                       timeout=60, what="the workload's child with its thread")
        return new[0]

    def stop(self) -> None:
        for pid in reversed(descendants(self.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def jsonout(cmd: list[str], timeout: float = 300) -> Any:
    return json.loads(sh(cmd, timeout=timeout))


# --- inference -------------------------------------------------------------------------------------

def tiny_model(into: str = "/srv/models") -> str:
    """The tiny built-in model (built on the host by the lab driver) copied where an operator keeps models."""
    import shutil
    source = Path(os.environ["REAMER_LAB_MODELS"]) / "tiny.onnx"
    target = Path(into) / "tiny.onnx"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return str(target)


def deploy_online(name: str, model: str, layout: str = "1x1:b1") -> dict:
    api("POST", "/v1/inference-jobs", {"name": name, "model": model, "kind": "online", "slo_ms": 2000,
                                       "layout": layout})
    try:
        return wait_for(lambda: serving(name), timeout=300, interval=2, what=f"online job {name} serving")
    except pytest.fail.Exception:
        pytest.fail(f"online job {name} never served: {job_evidence(name)}")


def job_evidence(name: str) -> str:
    """The agent's view of a job and the tail of its log, for failure messages."""
    view = api("GET", f"/v1/inference-jobs/{name}")
    logs = sorted(Path("/run/reamer/jobs").glob(f"{name}@*/job.log"), key=lambda p: p.stat().st_mtime)
    log = logs[-1] if logs else Path(f"/run/reamer/jobs/{name}@<deploy id>/job.log")
    tail = log.read_text()[-3000:] if log.exists() else f"(no {log})"
    return f"{view}\n--- {log} ---\n{tail}"


def serving(name: str) -> dict | None:
    """The job's view once it runs and its front door answers one real inference request."""
    import httpx
    job = api("GET", f"/v1/inference-jobs/{name}")
    if job["state"] != "running" or not job.get("port") or not job.get("pid"):
        return None
    body = {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
    try:
        reply = httpx.post(f"http://127.0.0.1:{job['port']}/v2/models/{name}/infer", json=body, timeout=60)
    except httpx.HTTPError:
        return None
    return job if reply.status_code == 200 and reply.json()["outputs"] else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
