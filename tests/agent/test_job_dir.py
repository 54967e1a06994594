"""A deploy's own directory (reamer.agent.job_dir) and the memory cgroup that goes with a removed job."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from reamer.agent import job_dir as job_files
from reamer.agent.inference import InferenceRecord
from reamer.host.errors import ReamerError
from tests.conftest import IS_ROOT, unique_name, wait_for

NOBODY = 65534


def me() -> job_files.JobUser:
    return job_files.JobUser(os.geteuid(), os.getegid(), switch=False)


def test_each_deploy_has_its_own_directory_name() -> None:
    jobs = Path("/run/x/jobs")
    a, b = job_files.new_deploy_id(), job_files.new_deploy_id()
    assert a != b and len(a) == 16
    assert job_files.deploy_dir(jobs, "web.v1", a) == jobs / f"web.v1@{a}"  # '@' is no job name's character
    assert job_files.io_dir(jobs, "web", a) == jobs / f"web@{a}" / "io"
    assert job_files.deploy_dir(jobs, "web", "") == jobs / "web"  # a record of an older agent
    assert job_files.io_dir(jobs, "web", "") == jobs / "web"


def test_prepare_makes_the_layout_and_reuses_only_its_own(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    base, made = job_files.prepare(jobs, "web", "abc", me())
    assert made and base == jobs / "web@abc"
    assert stat.S_IMODE(jobs.stat().st_mode) == 0o711
    assert stat.S_IMODE(base.stat().st_mode) == 0o755
    assert (base / "io").is_dir() and stat.S_ISREG((base / "job.log").lstat().st_mode)
    (base / "job.log").write_text("kept\n")
    again, made = job_files.prepare(jobs, "web", "abc", me())
    assert again == base and not made and (base / "job.log").read_text() == "kept\n"

    os.chmod(base, 0o777)  # not the agent's private directory any more: never reused
    with pytest.raises(ReamerError):
        job_files.prepare(jobs, "web", "abc", me())
    (jobs / "other@def").symlink_to(tmp_path)
    with pytest.raises(ReamerError):
        job_files.prepare(jobs, "other", "def", me())


def test_a_listable_jobs_root_is_tightened(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir(mode=0o777)
    os.chmod(jobs, 0o777)
    job_files.ensure_jobs_root(jobs)
    assert stat.S_IMODE(jobs.stat().st_mode) == 0o711


@pytest.mark.skipif(not IS_ROOT, reason="needs root to hand io/ and job.log to another user")
def test_prepare_hands_io_and_the_log_to_the_jobs_user(tmp_path: Path) -> None:
    base, _ = job_files.prepare(tmp_path / "jobs", "web", "abc", job_files.JobUser(NOBODY, NOBODY, switch=True))
    assert base.stat().st_uid == 0
    assert (base / "io").stat().st_uid == NOBODY and (base / "job.log").stat().st_uid == NOBODY


def test_open_log_replaces_a_link_or_fifo_never_writes_through(tmp_path: Path) -> None:
    base, _ = job_files.prepare(tmp_path / "jobs", "web", "abc", me())
    target = tmp_path / "root-only"
    target.write_text("secret\n")
    for plant in (lambda p: p.symlink_to(target), lambda p: os.mkfifo(p), lambda p: p.mkdir()):
        (base / "job.log").unlink() if not (base / "job.log").is_dir() else (base / "job.log").rmdir()
        plant(base / "job.log")
        fd = job_files.open_log(base, me())
        os.write(fd, b"line\n")
        os.close(fd)
        assert stat.S_ISREG((base / "job.log").lstat().st_mode)
        assert (base / "job.log").read_text() == "line\n"
    assert target.read_text() == "secret\n"


def test_remove_takes_the_whole_deploy_directory(tmp_path: Path) -> None:
    base, _ = job_files.prepare(tmp_path / "jobs", "web", "abc", me())
    (base / "io" / "status.json").write_text("{}")
    assert job_files.remove(tmp_path / "jobs", "web", "abc") == ""
    assert not base.exists() and (tmp_path / "jobs").is_dir()


def test_the_environment_is_an_allowlist() -> None:
    agent_env = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC", "OMP_WAIT_POLICY": "passive",
                 "AWS_SECRET_ACCESS_KEY": "s3cr3t", "PYTHONPATH": "/tmp/evil", "LD_PRELOAD": "/tmp/evil.so",
                 "NOTIFY_SOCKET": "/run/systemd/notify", "HOME": "/root", "SUDO_USER": "admin",
                 "http_proxy": "http://user:pw@proxy"}
    env = job_files.job_environment(job_files.JobUser(0, 0, switch=False), agent_env)
    assert set(env) == {"PATH", "LANG", "LC_ALL", "TZ", "OMP_WAIT_POLICY", "HOME", "USER", "LOGNAME"}
    assert env["HOME"] == "/root" and env["USER"] == "root"
    assert job_files.job_environment(job_files.JobUser(0, 0, switch=False), {})["PATH"] == job_files.DEFAULT_PATH


def test_the_environment_names_the_jobs_user_not_the_agents() -> None:
    import pwd

    nobody = pwd.getpwuid(NOBODY)
    env = job_files.job_environment(job_files.JobUser(NOBODY, NOBODY, switch=True), {"HOME": "/root"})
    assert env["HOME"] == nobody.pw_dir and env["USER"] == nobody.pw_name


def test_records_without_a_deploy_id_still_load() -> None:
    old = {"name": "web", "model": "/m.onnx", "kind": "online", "backend": "onnxruntime"}
    assert InferenceRecord.from_doc(old).deploy_id == ""
    assert InferenceRecord.from_doc({**old, "deploy_id": "abc"}).deploy_id == "abc"
    fresh = [InferenceRecord(name="web", model="/m.onnx", kind="online", backend="onnxruntime") for _ in range(2)]
    assert fresh[0].deploy_id and fresh[0].deploy_id != fresh[1].deploy_id  # each deploy its own


# --- the memory cgroup of a removed job ----------------------------------------------------------

needs_memory_cgroup = pytest.mark.skipif(
    not IS_ROOT or not (Path("/sys/fs/cgroup/memory").is_dir() or "memory" in (
        Path("/sys/fs/cgroup/cgroup.controllers").read_text() if Path("/sys/fs/cgroup/cgroup.controllers").exists()
        else "")), reason="needs root and the memory cgroup controller")

# A job with a worker in another session (as a daemonized helper would be): killpg of the job misses it.
DETACHED = r"""
import os, sys, time
child = os.fork()
if child == 0:
    os.setsid()
    while True: time.sleep(0.05)
print(child, flush=True)
while True: time.sleep(0.05)
"""


@pytest.fixture
def guard():
    from reamer.agent.memory_guard import InferenceMemoryGuard
    from reamer.host.cgroups import detect_driver
    from tests.agent.conftest import cleanup_cgroups

    name = unique_name("reamer-rm")
    made = InferenceMemoryGuard(detect_driver(), name, 800, None, lambda *a, **k: None)
    yield made
    cleanup_cgroups(name)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@needs_memory_cgroup
def test_empty_kills_what_is_left_and_forget_removes_the_cgroup(guard) -> None:
    proc = subprocess.Popen([sys.executable, "-c", DETACHED], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        rec = InferenceRecord(name="web", model="/m.onnx", kind="online", backend="onnxruntime", state="running",
                              pid=proc.pid)
        guard.apply([rec])
        memory = guard.driver.memory_dir(guard.cgroup_path("web"))
        assert sorted(guard.driver.processes(guard.cgroup_path("web"), "memory")) == sorted([proc.pid, child])
        proc.kill()  # the job's main process goes; its detached worker stays
        proc.wait()
        assert guard.empty("web", timeout=20)
        wait_for(lambda: _gone(child), timeout=20, what="the detached worker to be killed")
        guard.forget("web")
        assert not memory.exists()
    finally:
        proc.kill()
        proc.wait()


@needs_memory_cgroup
def test_a_cgroup_that_cannot_go_yet_is_removed_at_a_later_pass(guard) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        rec = InferenceRecord(name="web", model="/m.onnx", kind="online", backend="onnxruntime", state="running",
                              pid=sleeper.pid)
        guard.apply([rec])
        memory = guard.driver.memory_dir(guard.cgroup_path("web"))
        guard.forget("web")  # still a process in it: not removed now (it is killed on the way)
        wait_for(lambda: sleeper.poll() is not None, timeout=20, what="the process left in the cgroup to die")

        def removed():
            guard.apply([])  # every reconcile pass retries
            return not memory.exists()

        wait_for(removed, timeout=20, what="a later pass to remove the cgroup")
    finally:
        sleeper.kill()
        sleeper.wait()
