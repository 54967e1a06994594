"""The access policy, as a table: (caller, request facts) -> allowed, or the rule that refuses it."""
from __future__ import annotations

import pytest

from reamer.agent.policy import (Caller, Forbidden, SecurityRules, check_cgroup, check_job_owner, check_priority,
                                 check_processes, normalize_cgroup)
from reamer.host.identity import ProcessFacts

ROOT = Caller(uid=0, gid=0, pid=100)
ALICE = Caller(uid=1001, gid=1001, pid=200)
RULES = SecurityRules(allowed_cgroup_prefixes=("user.slice/user-{uid}.slice", "/batch/"),
                      protected_cgroups=("/", "init.scope", "system.slice", "user.slice", "./kube//"),
                      max_rt_priority=60)
AGENT_PID = 4242


def outcome(check, *args) -> str:
    try:
        check(*args)
    except Forbidden as exc:
        assert exc.message.startswith(f"refused by rule {exc.rule}") and exc.fix
        return exc.rule
    return "ok"


def proc(pid: int, uid: int | None, kernel: bool = False) -> ProcessFacts:
    return ProcessFacts(pid, uid, kernel)


@pytest.mark.parametrize("path, normal", [
    ("/", ""), ("", ""), ("./.", ""), ("a/..", ""), ("../..", ""), ("/a/b/", "a/b"), ("a//b/./c", "a/b/c"),
    ("user.slice/../system.slice", "system.slice"), ("init.scope/", "init.scope"), ("/a/../../b", "b"),
])
def test_cgroup_paths_are_normalized(path, normal):
    assert normalize_cgroup(path) == normal


PROCESS_TABLE = [
    # caller, processes found (descendants included), expected
    (ALICE, [proc(500, 1001), proc(501, 1001)], "ok"),
    (ALICE, [proc(500, 1001), proc(501, 0)], "process_owner"),  # a root-owned descendant
    (ALICE, [proc(500, 1002)], "process_owner"),
    (ALICE, [proc(500, 1001), proc(502, None)], "ok"),  # gone meanwhile: nothing to touch
    (ALICE, [proc(1, 0)], "pid_1"),
    (ROOT, [proc(1, 0)], "pid_1"),
    (ROOT, [proc(3, 0, kernel=True)], "kernel_thread"),
    (ALICE, [proc(3, 1001, kernel=True)], "kernel_thread"),
    (ROOT, [proc(AGENT_PID, 0)], "agent_process"),
    (ROOT, [proc(500, 1001), proc(501, 0)], "ok"),  # root may pin anyone's processes
]


@pytest.mark.parametrize("caller, processes, expected", PROCESS_TABLE)
def test_processes(caller, processes, expected):
    assert outcome(check_processes, caller, processes, AGENT_PID, RULES) == expected


CGROUP_TABLE = [
    (ROOT, "/", "protected_cgroup"),
    (ROOT, "./.", "protected_cgroup"),
    (ROOT, "a/../..", "protected_cgroup"),
    (ROOT, "init.scope", "protected_cgroup"),
    (ROOT, "/init.scope/", "protected_cgroup"),
    (ROOT, "system.slice", "protected_cgroup"),
    (ROOT, "kube", "protected_cgroup"),  # the config's entry is normalized too
    (ROOT, "system.slice/docker-abc.scope", "ok"),  # a container's own cgroup
    (ALICE, "user.slice/user-1001.slice/job.scope", "ok"),
    (ALICE, "user.slice/user-1001.slice", "ok"),
    (ALICE, "user.slice/user-1001.slice/../user-1002.slice", "cgroup_prefix"),
    (ALICE, "user.slice/user-10011.slice", "cgroup_prefix"),  # a prefix is a path, not a string prefix
    (ALICE, "user.slice/user-1002.slice/x", "cgroup_prefix"),
    (ALICE, "batch/train", "ok"),
    (ALICE, "batchx", "cgroup_prefix"),
    (ALICE, "system.slice/docker-abc.scope", "cgroup_prefix"),
    (ALICE, "user.slice", "protected_cgroup"),
    (ALICE, "/", "protected_cgroup"),
]


@pytest.mark.parametrize("caller, path, expected", CGROUP_TABLE)
def test_cgroups(caller, path, expected):
    assert outcome(check_cgroup, caller, path, RULES) == expected


def test_an_allowed_cgroup_comes_back_normalized():
    assert check_cgroup(ALICE, "/batch//train/./", RULES) == "batch/train"


@pytest.mark.parametrize("caller, priority, expected", [
    (ALICE, 60, "ok"), (ALICE, 61, "max_rt_priority"), (ROOT, 61, "max_rt_priority"), (ROOT, 1, "ok"),
])
def test_rt_priority_cap_holds_for_root_too(caller, priority, expected):
    assert outcome(check_priority, caller, priority, RULES) == expected


@pytest.mark.parametrize("caller, owner, expected", [
    (ALICE, 1001, "ok"), (ALICE, 0, "job_owner"), (ALICE, 1002, "job_owner"), (ROOT, 1001, "ok"), (ROOT, 0, "ok"),
])
def test_jobs_change_only_by_their_owner_or_root(caller, owner, expected):
    assert outcome(check_job_owner, caller, "training", "job", owner) == expected


def test_no_allowed_prefix_means_pids_only():
    rules = SecurityRules(allowed_cgroup_prefixes=(), protected_cgroups=("/",), max_rt_priority=90)
    assert outcome(check_cgroup, ALICE, "user.slice/user-1001.slice", rules) == "cgroup_prefix"
    assert outcome(check_cgroup, ROOT, "anything/at/all", rules) == "ok"
