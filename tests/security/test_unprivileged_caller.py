"""An unprivileged member of the socket group against a real agent: what it may and may not do.

The user and its group are created for the test (useradd/groupadd) and removed afterwards; its
requests come from a process running with its uid, so the agent knows it through SO_PEERCRED.
"""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from reamer.host.identity import process_facts

from tests.agent.conftest import all_rr, needs_rt_host, none_rt
from tests.conftest import wait_for
from tests.security.conftest import USER_PYTHON, UserClient, cgroup_exists, needs_root_for_users

pytestmark = [needs_root_for_users, pytest.mark.root]


def refused(status: int, body: dict, rule: str) -> str:
    assert status == 403, body
    assert body["error"]["code"] == "forbidden" and body["error"]["data"]["rule"] == rule, body
    assert body["error"]["fix"] and rule in body["error"]["message"]
    return body["error"]["message"]


def test_a_group_member_reads_the_node_and_sees_its_uid_nowhere_elevated(as_user, secure_daemon):
    status, node = as_user.call("GET", "/v1/node")
    assert status == 200 and node["agent_pid"] == secure_daemon.proc.pid
    status, jobs = as_user.call("GET", "/v1/training-jobs")
    assert status == 200 and jobs == {"jobs": []}


def test_someone_outside_the_group_cannot_connect(user, secure_daemon):
    # Same user, but without the socket group: the kernel refuses the connect (mode 0660).
    probe = ("import socket,sys\ns=socket.socket(socket.AF_UNIX)\n"
             "try:\n s.connect(sys.argv[1]); print('connected')\nexcept PermissionError: print('denied')")
    out = subprocess.run([USER_PYTHON, "-c", probe, secure_daemon.socket], user=user.uid, group=65534,
                         extra_groups=[], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "denied", out.stderr


@needs_rt_host
def test_the_user_pins_its_own_process_and_detaches_it(as_user, user, secure_daemon):
    mine = user.sleeper()
    status, job = as_user.call("POST", "/v1/training-jobs", {"name": "mine", "pids": [mine.pid], "priority": 10})
    assert status == 201, job
    assert job["owner_uid"] == user.uid and job["pids"] == [mine.pid]
    assert all_rr(mine.pid, 10)
    status, job = as_user.call("DELETE", "/v1/training-jobs/mine")
    assert status == 200, job
    assert none_rt(mine.pid)


@needs_rt_host
def test_processes_the_user_does_not_own_are_refused_and_nothing_is_left(as_user, user, secure_daemon,
                                                                         trainer_factory):
    roots = trainer_factory()
    refused(*as_user.call("POST", "/v1/training-jobs", {"name": "steal", "pids": [roots.pid]}), "process_owner")
    refused(*as_user.call("POST", "/v1/training-jobs", {"name": "init", "pids": [1]}), "pid_1")
    refused(*as_user.call("POST", "/v1/training-jobs", {"name": "agent", "pids": [secure_daemon.proc.pid]}),
            "agent_process")
    kernel = next((p for p in (int(d) for d in os.listdir("/proc") if d.isdigit()) if p > 1
                   and process_facts(p).kernel_thread), None)
    if kernel is not None:  # a pid namespace may hide them
        refused(*as_user.call("POST", "/v1/training-jobs", {"name": "kthread", "pids": [kernel]}), "kernel_thread")
    # A process the user owns whose child is root's: descendants count.
    parent, root_child = user.mixed_tree()
    message = refused(*as_user.call("POST", "/v1/training-jobs", {"name": "tree", "pids": [parent.pid]}),
                      "process_owner")
    assert str(root_child) in message
    # Mixed list: one own process and one of root's.
    mine = user.sleeper()
    refused(*as_user.call("POST", "/v1/training-jobs", {"name": "mixed", "pids": [mine.pid, roots.pid]}),
            "process_owner")
    for name in ("steal", "init", "agent", "kthread", "tree", "mixed"):
        assert not cgroup_exists(secure_daemon, name)
    assert secure_daemon.client.list_training_jobs() == []
    assert none_rt(roots.pid) and none_rt(mine.pid) and none_rt(parent.pid)
    assert secure_daemon.client.node().training_cpus == []


@pytest.mark.parametrize("cgroup, rule", [
    ("/", "protected_cgroup"), ("./.", "protected_cgroup"), ("a/../..", "protected_cgroup"),
    ("init.scope", "protected_cgroup"), ("system.slice/", "protected_cgroup"),
    ("system.slice/ssh.service", "cgroup_prefix"), ("user.slice/user-0.slice", "cgroup_prefix"),
])
def test_cgroups_outside_the_users_prefixes_are_refused(as_user, secure_daemon, cgroup, rule):
    refused(*as_user.call("POST", "/v1/training-jobs", {"name": "cg", "cgroup": cgroup}), rule)
    assert secure_daemon.client.list_training_jobs() == []


def test_root_too_is_refused_protected_cgroups_and_priorities_over_the_cap(secure_daemon):
    with httpx.Client(transport=httpx.HTTPTransport(uds=secure_daemon.socket), base_url="http://r", timeout=60) as http:
        for cgroup in ("/", "./.", "init.scope", "system.slice"):
            response = http.post("/v1/training-jobs", json={"name": "x", "cgroup": cgroup})
            refused(response.status_code, response.json(), "protected_cgroup")
        response = http.post("/v1/training-jobs", json={"name": "x", "pids": [os.getpid()], "priority": 31})
        refused(response.status_code, response.json(), "max_rt_priority")


def test_priority_over_the_cap_is_refused_for_the_user(as_user, user):
    mine = user.sleeper()
    refused(*as_user.call("POST", "/v1/training-jobs", {"name": "hot", "pids": [mine.pid], "priority": 99}),
            "max_rt_priority")
    assert none_rt(mine.pid)


@needs_rt_host
def test_the_user_cannot_detach_or_demote_roots_job(as_user, secure_daemon, trainer_factory, user):
    roots = trainer_factory()
    secure_daemon.client.attach_training({"name": "roots", "pids": [roots.pid]})
    assert all_rr(roots.pid)
    refused(*as_user.call("DELETE", "/v1/training-jobs/roots"), "job_owner")
    mine = user.sleeper()
    assert as_user.call("POST", "/v1/training-jobs", {"name": "mine", "pids": [mine.pid]})[0] == 201
    status, result = as_user.call("POST", "/v1/demote-all")
    assert status == 200 and result["jobs"] == ["mine"]
    assert none_rt(mine.pid) and all_rr(roots.pid)  # only the caller's own job was demoted
    status, listing = as_user.call("GET", "/v1/training-jobs")  # everyone's jobs are visible
    assert {j["name"]: j["owner_uid"] for j in listing["jobs"]} == {"roots": 0, "mine": user.uid}


def test_gpu_jobs_take_only_the_callers_pids_and_validate_first(as_user, user, secure_daemon, trainer_factory):
    roots = trainer_factory()
    refused(*as_user.call("POST", "/v1/gpu-jobs", {"name": "g", "gpu": 0, "sm_percent": 50, "pids": [roots.pid]}),
            "process_owner")
    for pids in ([-1], [0], [2**40]):
        status, body = as_user.call("POST", "/v1/gpu-jobs", {"name": "g", "gpu": 0, "sm_percent": 50, "pids": pids})
        assert status == 422 and body["error"]["code"] == "invalid_request", body
    mine = user.sleeper()
    status, body = as_user.call("POST", "/v1/gpu-jobs", {"name": "g", "gpu": 0, "sm_percent": 50, "pids": [mine.pid]})
    assert status != 403 and status < 500, body  # no GPU here: refused for that reason, not for the pids
    status, body = as_user.call("GET", "/v1/gpus")
    assert status == 200


def test_bodies_are_size_limited(as_user):
    status, body = as_user.call("POST", "/v1/training-jobs", content='{"name": "' + "a" * 400_000 + '"}')
    assert status == 413 and body["error"]["code"] == "body_too_large", body


def test_a_huge_layout_is_refused_at_once(as_user, tmp_path):
    status, body = as_user.call("POST", "/v1/inference-jobs", {"name": "big", "model": "/nonexistent.onnx",
                                                               "kind": "online", "slo_ms": 10,
                                                               "layout": "99999999x1:b1"})
    assert status == 400 and "cores" in body["error"]["message"], body


def test_long_polls_cannot_starve_demote_all(secure_daemon, user):
    """Fifty long-polls (more than the server's worker threads) are open; demote-all still answers."""
    last = secure_daemon.client.events(since=0).last_id
    clients = [UserClient(user, secure_daemon.socket) for _ in range(2)]
    done: list[int] = []
    started = threading.Barrier(51)

    def poll() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(uds=secure_daemon.socket), base_url="http://r",
                          timeout=120) as http:
            started.wait()
            done.append(http.get("/v1/events", params={"since": 2**62, "wait": 20}).status_code)

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(50)]
    for thread in threads:
        thread.start()
    try:
        started.wait()
        status, result = clients[0].call("POST", "/v1/demote-all")
        assert status == 200, result
        status, node = clients[1].call("GET", "/v1/node")
        assert status == 200
        assert len(done) < 50  # the long-polls were still open while these answered
    finally:
        for client in clients:
            client.close()
        for thread in threads:
            thread.join(timeout=60)
    assert sorted(set(done)) == [200]
    assert secure_daemon.client.events(since=last).events  # demoted_all was recorded


@needs_rt_host
def test_a_foreign_process_that_joins_a_users_job_is_not_made_real_time(as_user, user, secure_daemon,
                                                                        trainer_factory):
    """Like a setuid program the user's training starts: it lands in the job's cgroup but is not the user's."""
    mine = user.sleeper()
    assert as_user.call("POST", "/v1/training-jobs", {"name": "suid", "pids": [mine.pid]})[0] == 201
    assert all_rr(mine.pid)
    roots = trainer_factory(threads=1)
    procs = Path("/sys/fs/cgroup/cpuset") / secure_daemon.cgroup_name / "train-suid" / "cgroup.procs"
    procs.write_text(str(roots.pid))
    # Demote the user's thread: once a pass has made it RR again, that pass has seen root's process too.
    os.sched_setscheduler(mine.pid, os.SCHED_OTHER, os.sched_param(0))
    wait_for(lambda: all_rr(mine.pid), timeout=30, what="a reconcile pass")
    assert none_rt(roots.pid)
    (Path("/sys/fs/cgroup/cpuset") / "cgroup.procs").write_text(str(roots.pid))


def test_deeply_nested_and_non_finite_bodies_are_4xx(as_user):
    for body in ("[" * 200_000, '{"name": "x", "pids": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 '{"name": "n", "model": "/m.onnx", "kind": "online", "slo_ms": NaN}',
                 '{"name": "n", "model": "/m.onnx", "kind": "online", "slo_ms": Infinity}'):
        status, answer = as_user.call("POST", "/v1/inference-jobs", content=body)
        assert 400 <= status < 500, (status, answer)
        assert answer["error"]["message"] and "Traceback" not in str(answer)
    status, answer = as_user.call("GET", "/v1/events", params={"wait": "nan"})
    assert status == 422, answer
