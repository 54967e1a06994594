"""Training's memory comes first: inference processes get oom_score_adj and a memory cgroup with a
limit, and an OOM kill is reported. Real cgroups, a real process, the kernel's real OOM killer (inside
a small memory cgroup only: nothing else on the host is at risk)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reamer.agent.inference import InferenceRecord
from reamer.agent.memory_guard import InferenceMemoryGuard
from reamer.host.cgroups import detect_driver
from reamer.host.oom import oom_score_adj
from tests.agent.conftest import cgroup_path, cleanup_cgroups, daemon_factory, kill_tree  # noqa: F401
from tests.conftest import IS_ROOT, unique_name, wait_for


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True

pytestmark = [pytest.mark.root, pytest.mark.skipif(
    not IS_ROOT or not (Path("/sys/fs/cgroup/memory").is_dir() or "memory" in
                        (Path("/sys/fs/cgroup/cgroup.controllers").read_text() if
                         Path("/sys/fs/cgroup/cgroup.controllers").exists() else "")),
    reason="needs root and the memory cgroup controller")]

# Forks a child (a worker), then on "go" allocates and touches 1 GiB in 16 MiB steps.
HOG = r"""
import os, sys, time
child = os.fork()
if child == 0:
    while True: time.sleep(0.05)
print(child, flush=True)
sys.stdin.readline()
blocks = []
for _ in range(64):
    blocks.append(bytearray(16 << 20))
    for i in range(0, len(blocks[-1]), 4096):
        blocks[-1][i] = 1
print("survived", flush=True)
time.sleep(30)
"""


@pytest.fixture
def guard_and_events():
    name = unique_name("reamer-mem")
    events: list[tuple[str, str, dict]] = []
    guard = InferenceMemoryGuard(detect_driver(), name, 800, None,
                                 lambda kind, message, job=None, data=None: events.append((kind, message, data)))
    yield guard, events
    cleanup_cgroups(name)
    assert not (Path("/sys/fs/cgroup/memory") / name).exists()


def test_job_processes_are_preferred_victims_limited_and_an_oom_kill_is_reported(guard_and_events):
    guard, events = guard_and_events
    assert guard.available, guard.message
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(hog.stdout.readline())
        rec = InferenceRecord(name="hog", model="/m.onnx", kind="offline", backend="onnxruntime", state="running",
                              pid=hog.pid, memory_limit_mb=128)
        guard.apply([rec])
        for pid in (hog.pid, child):  # the job and its worker
            assert oom_score_adj(pid) == 800
            assert cgroup_path(pid, "memory").strip("/") == guard.cgroup_path("hog")
        limit_file = Path("/sys/fs/cgroup/memory") / guard.cgroup_path("hog") / "memory.limit_in_bytes"
        if limit_file.exists():
            assert int(limit_file.read_text()) == 128 << 20
        assert events == [] and guard.oom_note("hog") == ""

        hog.stdin.write("go\n")
        hog.stdin.flush()
        assert hog.wait(timeout=120) == -9  # SIGKILL from the OOM killer, not "survived"
        guard.apply([rec])
        kinds = [e[0] for e in events]
        assert kinds == ["inference_oom_killed"], events
        assert "OOM killer" in events[0][1] and "128 MiB" in events[0][1] and events[0][2]["killed"] >= 1
        assert "killed by the OOM killer" in guard.oom_note("hog")
    finally:
        kill_tree(hog.pid)
        hog.wait(timeout=30)
        kill_tree(child)  # orphaned when the OOM killer took its parent
        wait_for(lambda: not Path(f"/proc/{child}").exists() or _is_zombie(child), what="the worker to exit")
    procs = Path("/sys/fs/cgroup/memory") / guard.cgroup_path("hog") / "cgroup.procs"
    wait_for(lambda: not procs.exists() or not procs.read_text().split(), what=f"{procs} to empty")
    guard.forget("hog")
    assert not (Path("/sys/fs/cgroup/memory") / guard.cgroup_path("hog")).exists()


def test_without_a_limit_the_cgroup_is_unlimited(guard_and_events):
    guard, _ = guard_and_events
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rec = InferenceRecord(name="calm", model="/m.onnx", kind="online", backend="onnxruntime", state="running",
                              pid=sleeper.pid)
        guard.apply([rec])
        assert oom_score_adj(sleeper.pid) == 800
        limit_file = Path("/sys/fs/cgroup/memory") / guard.cgroup_path("calm") / "memory.limit_in_bytes"
        if limit_file.exists():
            assert int(limit_file.read_text()) > 1 << 60
    finally:
        sleeper.kill()
        sleeper.wait()
    guard.forget("calm")


def test_an_agent_reports_a_job_the_oom_killer_took(daemon_factory, tmp_path):
    """A real agent, a real job whose memory limit is far too small: the kernel kills it, the agent says so."""
    from reamer.serve import models

    model = models.build_model("tiny", tmp_path / "tiny.onnx").path
    daemon = daemon_factory(inference={"restart_limit": 1, "oom_score_adj": 900})
    job = daemon.client.deploy_inference({"name": "starved", "model": str(model), "kind": "online", "slo_ms": 500,
                                          "layout": "1x1:b1", "memory_limit_mb": 24})
    assert job.memory_limit_mb == 24
    event = wait_for(lambda: next((e for e in daemon.client.events(since=0).events
                                   if e.kind == "inference_oom_killed"), None), timeout=120,
                     what="the agent to report the OOM kill")
    assert event.job == "starved" and "24 MiB" in event.message
    shown = wait_for(lambda: (lambda j: j if j.oom_kills else None)(daemon.client.get_inference_job("starved")),
                     timeout=60, what="infer show to count the kill")
    assert "killed by the OOM killer" in shown.message
    daemon.client.remove_inference("starved")
