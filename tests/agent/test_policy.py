"""The access policy, as a table: (caller, request facts) -> allowed, or the rule that refuses it."""
from __future__ import annotations

import pytest

from reamer.agent.policy import (BudgetHolder, Caller, Forbidden, RtPools, SecurityRules, check_cgroup,
                                 check_job_owner, check_priority, check_processes, check_rt_budget,
                                 check_same_process, normalize_cgroup, process_refusal, rt_budgets)
from reamer.host.identity import ProcessFacts

ROOT = Caller(uid=0, gid=0, pid=100)
ALICE = Caller(uid=1001, gid=1001, pid=200)
ADMIN = Caller(uid=1003, gid=1003, pid=300, admin=True)
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


def proc(pid: int, uid: int | None, kernel: bool = False, euid: int | None = None, suid: int | None = None,
         fsuid: int | None = None, start: int | None = None, tgid: int | None = None) -> ProcessFacts:
    def same(u):
        return uid if u is None else u
    return ProcessFacts(pid, uid, kernel, euid=same(euid), suid=same(suid), fsuid=same(fsuid), start_time=start,
                        tgid=tgid)


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
    # setuid programs keep the caller's real uid: effective, saved or filesystem uid give them away
    (ALICE, [proc(500, 1001, euid=0)], "process_owner"),  # `passwd` run by alice
    (ALICE, [proc(500, 1001, euid=1001, suid=0)], "process_owner"),  # dropped privileges, can regain them
    (ALICE, [proc(500, 1001, fsuid=0)], "process_owner"),
    (ALICE, [proc(500, 1001, euid=1002, suid=1002)], "process_owner"),  # setuid to another user
    (ROOT, [proc(500, 1001, euid=0)], "ok"),  # root may pin setuid programs
    (ADMIN, [proc(500, 1001)], "process_owner"),  # an admin's jobs are its own processes too
    (ADMIN, [proc(500, 1003)], "ok"),
    (ALICE, [proc(700, 1001, tgid=AGENT_PID)], "agent_process"),  # a thread of the agent
    (ALICE, [ProcessFacts(500, 1001)], "ok"),  # only the real uid known (facts gathered elsewhere)
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


def test_a_setuid_refusal_says_so():
    refusal = process_refusal(ALICE, proc(500, 1001, euid=0, suid=0), AGENT_PID)
    assert refusal is not None and refusal.rule == "process_owner"
    assert "setuid" in refusal.message and "effective 0" in refusal.message and refusal.fix
    assert process_refusal(ALICE, proc(500, None), AGENT_PID) is None, "a gone process is nothing to touch"


@pytest.mark.parametrize("checked, now, expected", [
    (proc(500, 1001, start=10), proc(500, 1001, start=10), "ok"),
    (proc(500, 1001, start=10), proc(500, 0, start=99), "process_identity"),  # its pid went to root's process
    (proc(500, 1001, start=10), proc(500, 1001, start=99), "process_identity"),  # even to the same user's
    (proc(500, 1001, start=10), proc(500, None), "ok"),  # gone: nothing is touched
])
def test_a_named_process_is_the_one_checked(checked, now, expected):
    assert outcome(check_same_process, checked, now) == expected


POOLS = RtPools(cap_us=800000, user_percent=25)  # privileged 600000, users 200000


def holders(*spec):
    return [BudgetHolder(job, uid, uid == 0 or admin) for job, uid, admin in spec]


@pytest.mark.parametrize("spec, expected", [
    ([("r", 0, False)], {"r": 600000}),
    ([("r", 0, False), ("a", 1001, False)], {"r": 600000, "a": 200000}),  # a user's attach: root unchanged
    ([("r", 0, False), ("a", 1001, False), ("a2", 1001, False)], {"r": 600000, "a": 100000, "a2": 100000}),
    ([("r", 0, False), ("a", 1001, False), ("b", 1002, False), ("b2", 1002, False)],
     {"r": 600000, "a": 100000, "b": 50000, "b2": 50000}),  # split per user first: b's jobs cannot crowd out a
    ([("r", 0, False), ("adm", 1003, True)], {"r": 300000, "adm": 300000}),  # admins share root's pool
    ([("a", 1001, False)], {"a": 200000}),
])
def test_rt_budgets_by_pool(spec, expected):
    assert rt_budgets(POOLS, holders(*spec)) == expected


def test_users_never_shrink_a_privileged_budget():
    privileged = holders(("r", 0, False), ("adm", 1003, True))
    before = rt_budgets(POOLS, privileged)
    users = holders(*[(f"u{i}", 1000 + i % 3, False) for i in range(20)])
    after = rt_budgets(POOLS, privileged + users)
    assert {k: after[k] for k in before} == before
    assert sum(after.values()) <= POOLS.cap_us


@pytest.mark.parametrize("pools, holder, others, expected", [
    (POOLS, ("a", 1001, False), [], "ok"),
    (RtPools(800000, 0), ("a", 1001, False), [], "rt_pool"),  # no users' pool on this node
    (RtPools(800000, 0), ("r", 0, False), [], "ok"),
    (RtPools(800000, 100), ("r", 0, False), [], "rt_pool"),
    (RtPools(10000, 50), ("a", 1001, False), [("a1", 1001, False), ("a2", 1001, False), ("a3", 1001, False),
                                              ("a4", 1001, False), ("a5", 1001, False)], "rt_pool"),  # < 1000 us
])
def test_rt_pool_refuses_a_job_it_cannot_give_a_budget(pools, holder, others, expected):
    assert outcome(check_rt_budget, pools, holders(holder)[0], holders(*others)) == expected
