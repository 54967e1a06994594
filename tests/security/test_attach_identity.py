"""One process identity from check to use, and the RT budget by policy: a real unprivileged user against a
real agent over its socket.

- A pid the user named is freed while the agent waits for inference to leave the cores and handed to a root
  process (ns_last_pid): the root process is never pinned nor made SCHED_RR, and the attach fails naming it.
- The user's own setuid program (a setuid-root copy of `sleep`) is refused; one that a job the user attached
  starts later is never left SCHED_RR (demoted, with an event).
- A user's attach never shrinks the RT budget of root's job (cgroup v1 RT group scheduling).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from tests.agent.conftest import TEST_RT_RUNTIME_US, all_rr, cleanup_cgroups, needs_rt_host, none_rt, wait_event
from tests.conftest import wait_for
from tests.security.conftest import USER_PYTHON, cgroup_exists, needs_root_for_users
from tests.security.pid_reuse import can_reuse_pids, spawn_at_pid

pytestmark = [needs_root_for_users, needs_rt_host, pytest.mark.root]
CG = Path("/sys/fs/cgroup")

# Runs as the user: "spawn PATH" starts PATH 300 (a child in the job) and prints its pid.
SPAWNER = r"""
import subprocess, sys
print("ready", flush=True)
children = []
for line in sys.stdin:
    cmd, _, path = line.strip().partition(" ")
    if cmd == "spawn":
        children.append(subprocess.Popen([path, "300"]))
        print(children[-1].pid, flush=True)
"""


def refused(status: int, body: dict, rule: str) -> str:
    assert status == 403, body
    assert body["error"]["code"] == "forbidden" and body["error"]["data"]["rule"] == rule, body
    assert body["error"]["fix"] and rule in body["error"]["message"]
    return body["error"]["message"]


def uids_of(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(v) for v in line.split()[1:]]
    return []


@pytest.fixture(scope="module")
def setuid_sleep() -> Iterator[str]:
    """A setuid-root copy of `sleep` in a directory root owns (the user may run it, not change it)."""
    directory = Path(tempfile.mkdtemp(prefix="rmr-suid-", dir="/tmp"))
    try:
        os.chmod(directory, 0o755)
        path = directory / "sleep"
        shutil.copy(shutil.which("sleep") or "/bin/sleep", path)
        os.chown(path, 0, 0)
        os.chmod(path, 0o4755)
        yield str(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_setuid(user, path: str) -> subprocess.Popen:
    proc = user.popen([path, "300"])
    wait_for(lambda: uids_of(proc.pid)[:1] == [user.uid], timeout=30, what="the setuid program to start")
    if uids_of(proc.pid)[1] != 0:
        pytest.skip("setuid bits are ignored here (nosuid mount?): the setuid program runs as the user")
    return proc


# ----------------------------------------------------------------------------------- setuid programs


def test_the_users_own_setuid_program_is_refused(as_user, user, secure_daemon, setuid_sleep):
    suid = run_setuid(user, setuid_sleep)
    message = refused(*as_user.call("POST", "/v1/training-jobs", {"name": "passwd", "pids": [suid.pid]}),
                      "process_owner")
    assert "setuid" in message and "effective 0" in message, message
    assert none_rt(suid.pid) and not cgroup_exists(secure_daemon, "passwd")
    # Its parent is the user's: a tree with the setuid program below it is refused too.
    parent = user.popen([USER_PYTHON, "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready"
    parent.stdin.write(f"spawn {setuid_sleep}\n")
    parent.stdin.flush()
    child = int(parent.stdout.readline())
    wait_for(lambda: uids_of(child)[1:2] == [0], timeout=30, what="the setuid child to run")
    message = refused(*as_user.call("POST", "/v1/training-jobs", {"name": "tree", "pids": [parent.pid]}),
                      "process_owner")
    assert str(child) in message
    assert none_rt(parent.pid) and none_rt(child) and secure_daemon.client.list_training_jobs() == []


def test_a_setuid_program_started_later_in_a_users_job_is_never_left_real_time(as_user, user, secure_daemon,
                                                                               setuid_sleep):
    run_setuid(user, setuid_sleep).kill()  # skips where setuid bits are ignored
    parent = user.popen([USER_PYTHON, "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready"
    status, job = as_user.call("POST", "/v1/training-jobs", {"name": "later", "pids": [parent.pid]})
    assert status == 201, job
    assert all_rr(parent.pid)
    parent.stdin.write(f"spawn {setuid_sleep}\n")
    parent.stdin.flush()
    child = int(parent.stdout.readline())  # forked by an RR thread: it inherits SCHED_RR, then runs setuid
    wait_for(lambda: uids_of(child)[1:2] == [0], timeout=30, what="the setuid child to run")
    event = wait_event(secure_daemon, "training_thread_refused", timeout=30, job="later")
    assert str(child) in event.message and "setuid" in event.message
    wait_for(lambda: none_rt(child), timeout=30, what="the setuid child to be demoted")
    # Later passes leave it so: once one has made the user's own (demoted) thread RR again, it saw the child too.
    os.sched_setscheduler(parent.pid, os.SCHED_OTHER, os.sched_param(0))
    wait_for(lambda: all_rr(parent.pid), timeout=30, what="a reconcile pass")
    assert none_rt(child) and all_rr(parent.pid)
    assert len([e for e in secure_daemon.events("training_thread_refused") if e.job == "later"]) == 1, \
        "one event per refused thread, not one per pass"


# ----------------------------------------------------------------------------------- pid reuse


needs_pid_reuse = pytest.mark.skipif(not can_reuse_pids(), reason="needs a writable /proc/sys/kernel/ns_last_pid")
needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="needs 2 CPUs: an online job on both, training takes one")


@pytest.fixture
def tiny_model(tmp_path) -> str:
    from reamer.serve import models

    return models.build_model("tiny", tmp_path / "tiny.onnx").path


def job_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def signal_tree(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


class StalledInference:
    """An online job on every idle cpu, stopped (SIGSTOP): it cannot leave the cores, so an attach that takes
    one waits for it (up to 5 s) between the policy check and the pinning, as behind a slow job."""

    def __init__(self, daemon, model: str) -> None:
        self.daemon = daemon
        web = daemon.client.deploy_inference({"name": "web", "model": model, "kind": "online", "slo_ms": 500,
                                              "layout": f"{len(daemon.client.node().idle_cpus)}x1:b1"})

        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{web.port}/v2/health/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=120, what="the online job to be ready")
        self.procs = job_tree(daemon.client.get_inference_job("web").pid)
        signal_tree(self.procs, signal.SIGSTOP)

    def attach_during_wait(self, as_user, body: dict, meanwhile) -> tuple[int, dict]:
        """The user's attach; `meanwhile()` runs once it passed its check and while the agent waits."""
        answer: dict = {}
        attach = threading.Thread(target=lambda: answer.update(result=as_user.call("POST", "/v1/training-jobs", body)))
        attach.start()
        try:
            # The check is over once the job holds cores: the agent now waits for inference without its lock.
            wait_for(lambda: self.daemon.client.node().training_cpus or not attach.is_alive(), timeout=60,
                     what="the attach to pass its check")
            assert attach.is_alive(), f"the attach did not wait: {answer}"
            meanwhile()
        finally:
            attach.join(timeout=120)
        assert not attach.is_alive()
        return answer["result"]

    def close(self) -> None:
        signal_tree(self.procs, signal.SIGCONT)
        self.daemon.client.remove_inference("web")


@pytest.fixture
def stalled(secure_daemon, tiny_model) -> Iterator[StalledInference]:
    made = StalledInference(secure_daemon, tiny_model)
    try:
        yield made
    finally:
        made.close()


@needs_pid_reuse
@needs_two_cpus
def test_a_pid_reused_while_the_agent_waits_for_inference_is_never_pinned(as_user, user, secure_daemon, stalled):
    daemon = secure_daemon
    victim = user.sleeper()
    pid = victim.pid
    taken: list[subprocess.Popen] = []

    def reuse_the_pid() -> None:
        victim.kill()
        victim.wait(timeout=30)
        usurper = spawn_at_pid(pid, ["sleep", "300"])
        if usurper is not None:
            taken.append(usurper)
            taken.append(os.sched_getaffinity(usurper.pid))

    try:
        result = stalled.attach_during_wait(as_user, {"name": "race", "pids": [pid], "cores": 1}, reuse_the_pid)
        if not taken:
            pytest.skip(f"other processes on this machine kept taking pid {pid}")
        usurper, affinity = taken
        assert uids_of(usurper.pid)[0] == 0
        message = refused(*result, "process_identity")
        assert str(pid) in message and "another process" in message, message
        assert none_rt(usurper.pid), "root's process that took the pid was made real-time"
        assert os.sched_getaffinity(usurper.pid) == affinity, "root's process that took the pid was pinned"
        assert not cgroup_exists(daemon, "race") and daemon.client.list_training_jobs() == []
        assert daemon.client.node().training_cpus == []
    finally:
        if taken:
            taken[0].kill()
            taken[0].wait(timeout=30)


@needs_two_cpus
def test_a_setuid_child_born_while_the_agent_waits_is_refused_before_it_is_touched(as_user, user, secure_daemon,
                                                                                   stalled, setuid_sleep):
    run_setuid(user, setuid_sleep).kill()  # skips where setuid bits are ignored
    parent = user.popen([USER_PYTHON, "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready"
    born: list[int] = []

    def spawn_setuid_child() -> None:
        parent.stdin.write(f"spawn {setuid_sleep}\n")
        parent.stdin.flush()
        born.append(int(parent.stdout.readline()))
        wait_for(lambda: uids_of(born[0])[1:2] == [0], timeout=30, what="the setuid child to run")

    result = stalled.attach_during_wait(as_user, {"name": "born", "pids": [parent.pid], "cores": 1},
                                        spawn_setuid_child)
    message = refused(*result, "process_owner")
    assert str(born[0]) in message and "setuid" in message, message
    assert none_rt(parent.pid) and none_rt(born[0])
    assert not cgroup_exists(secure_daemon, "born") and secure_daemon.client.list_training_jobs() == []


# ----------------------------------------------------------------------------------- RT budget


def cpu_cgroup(path: str, pid: int) -> None:
    """Move `pid` into cpu cgroup `path` (made if missing): its threads then need an RT budget there."""
    (CG / "cpu" / path).mkdir(parents=True, exist_ok=True)
    (CG / "cpu" / path / "cgroup.procs").write_text(str(pid))


def rt_of(daemon, job: str) -> int:
    return int((CG / "cpu" / daemon.cgroup_name / f"train-{job}" / "cpu.rt_runtime_us").read_text())


def test_a_users_attach_never_shrinks_roots_rt_budget(as_user, user, secure_daemon, trainer_factory):
    from click.testing import CliRunner

    from reamer.cli.main import cli

    daemon = secure_daemon
    home = f"{daemon.cgroup_name}-home"
    privileged = TEST_RT_RUNTIME_US - TEST_RT_RUNTIME_US * 25 // 100
    users = TEST_RT_RUNTIME_US * 25 // 100
    try:
        roots = trainer_factory(threads=1)
        cpu_cgroup(f"{home}/root", roots.pid)
        daemon.client.attach_training({"name": "roots", "pids": [roots.pid], "cores": 1})
        assert all_rr(roots.pid) and rt_of(daemon, "roots") == privileged, "root's job: the privileged pool"
        before = rt_of(daemon, "roots")
        mine = user.sleeper()
        cpu_cgroup(f"{home}/user", mine.pid)
        status, job = as_user.call("POST", "/v1/training-jobs", {"name": "mine", "pids": [mine.pid], "cores": 1})
        assert status == 201, job
        assert all_rr(mine.pid) and rt_of(daemon, "mine") == users, "the user's job: the users' pool"
        assert rt_of(daemon, "roots") == before, "a user's attach shrank root's RT budget"
        # Everyone sees the rule and who holds what.
        status, node = as_user.call("GET", "/v1/node")
        budget = node["rt_budget"]
        assert budget["enabled"] and budget["privileged_pool_us"] == privileged and budget["user_pool_us"] == users
        assert {j["job"]: (j["pool"], j["owner_uid"], j["budget_us"], j["held_us"]) for j in budget["jobs"]} == {
            "roots": ("privileged", 0, privileged, privileged), "mine": ("users", user.uid, users, users)}
        shown = CliRunner().invoke(cli, ["--socket", daemon.socket, "status"])
        assert shown.exit_code == 0, shown.output
        assert f"root/admins {privileged} us" in shown.output and f"users {users} us (25%)" in shown.output
        assert f"roots (uid 0, privileged) {privileged} us" in shown.output
        assert f"mine (uid {user.uid}, users) {users} us" in shown.output
        # The user's detach gives root nothing and takes nothing from it either.
        assert as_user.call("DELETE", "/v1/training-jobs/mine")[0] == 200
        assert rt_of(daemon, "roots") == before
    finally:
        for job in daemon.client.list_training_jobs():
            daemon.client.detach_training(job.name)
        cleanup_cgroups(home)


def test_an_admins_job_draws_from_the_privileged_pool(user, trainer_factory):
    """With security.admin_group set to the user's group the same user is an admin: its job shares root's
    pool (so root's budget may shrink for it, as for another root job), not the users' pool."""
    from tests.agent.conftest import _new_daemon
    from tests.security.conftest import UserClient

    daemon = _new_daemon(socket_group=user.group, security={"admin_group": user.group})
    os.chmod(daemon.base, 0o711)
    home = f"{daemon.cgroup_name}-home"
    client = None
    try:
        daemon.start()
        client = UserClient(user, daemon.socket)
        roots = trainer_factory(threads=1)
        cpu_cgroup(f"{home}/root", roots.pid)
        daemon.client.attach_training({"name": "roots", "pids": [roots.pid], "cores": 1})
        privileged = TEST_RT_RUNTIME_US - TEST_RT_RUNTIME_US * 25 // 100
        assert rt_of(daemon, "roots") == privileged
        admins = user.sleeper()
        cpu_cgroup(f"{home}/admin", admins.pid)
        status, job = client.call("POST", "/v1/training-jobs", {"name": "admins", "pids": [admins.pid], "cores": 1})
        assert status == 201, job
        assert rt_of(daemon, "admins") == rt_of(daemon, "roots") == privileged // 2
        pools = {j.job: j.pool for j in daemon.client.node().rt_budget.jobs}
        assert pools == {"roots": "privileged", "admins": "privileged"}
        assert client.call("DELETE", "/v1/training-jobs/admins")[0] == 200
        assert rt_of(daemon, "roots") == privileged, "root's job gets the whole pool back"
    finally:
        if client is not None:
            client.close()
        try:
            for job in daemon.client.list_training_jobs():
                daemon.client.detach_training(job.name)
        except Exception:  # noqa: BLE001 - the daemon may not have started
            pass
        daemon.cleanup()
        cleanup_cgroups(home)
