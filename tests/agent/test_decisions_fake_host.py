"""The agent's decisions on a fake host, without root: what attach, reconcile, detach, a restart and a kill -9
mid-attach change on the host (the executor's recorded calls), what the write-ahead journal holds, and that
replaying it leaves the host as it was. The fake host keeps the kernel's cpuset rules, so an unlevelled
cpuset write fails here as on a real kernel. (The same decisions on real kernels: tests/agent/test_training*.py
as root, and the host lab.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from reamer.agent.memory_guard import MIB, InferenceMemoryGuard
from reamer.agent.training import IN_PLACE, OWN, Placement, TrainingPinner
from reamer.host.changes import CPUSET, MKDIR, MOVE, SUBTREE
from reamer.host.executor import CpusetWrite, levelled_order
from reamer.host.fake import AgentKilled, FakeHost

CONTAINER = "kubepods/pod1/ctr"


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen]]:
    """Real processes to play the jobs (the agent finds jobs in the process table); the fake host holds
    their cgroups and scheduling."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def sleeper(sleepers: list[subprocess.Popen]) -> int:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    sleepers.append(proc)
    return proc.pid


def pinner_on(host: FakeHost) -> TrainingPinner:
    return TrainingPinner(host, "reamer", 900000, proc_root=host.proc_root, run_root=host.run_root)


def kinds(saved: list) -> list[tuple[str, str]]:
    return [(c["kind"], c["target"]) for c in saved[-1]]


def test_levelled_order_widens_parents_first_and_narrows_children_first() -> None:
    narrowing = levelled_order([CpusetWrite("a", "2-3"), CpusetWrite("a/b", "2-3")], {"a": "0-7", "a/b": "0-7"})
    assert narrowing == [CpusetWrite("a/b", "2-3"), CpusetWrite("a", "2-3")]
    moving = levelled_order([CpusetWrite("a", "4-5"), CpusetWrite("a/b", "4-5")], {"a": "0-3", "a/b": "0-1"})
    assert moving == [CpusetWrite("a", "0-5"), CpusetWrite("a/b", "0-1,4-5"),  # top-down: the union
                      CpusetWrite("a/b", "4-5"), CpusetWrite("a", "4-5")]  # bottom-up: the final values
    assert levelled_order([CpusetWrite("a", "0-3")], {"a": "0-3"}) == [], "a write that changes nothing is left out"


def test_attach_by_pids_journals_then_pins_and_detach_puts_everything_back(tmp_path: Path, sleepers) -> None:
    host = FakeHost(tmp_path)
    pid = sleeper(sleepers)
    tids = host.add_job_process(pid, "user.slice", threads=3)
    pinner = pinner_on(host)
    saved: list = []
    placement = pinner.place("a", "pids", [pid])
    assert (placement.mode, placement.cpuset_path) == (OWN, "reamer/train-a")
    state = pinner.attach("a", placement, [pid], [2, 3], 9, pinner.new_log("a", saved.append))

    assert host.changes("create_cgroup", "set_cpus", "add_process") == [
        ("create_cgroup", "reamer/train-a", ("cpuset",)), ("set_cpus", "reamer/train-a", "2-3"),
        ("add_process", "reamer/train-a", pid, ("cpuset",))]
    assert sorted(c[1] for c in host.changes("set_rr")) == tids and {c[2] for c in host.changes("set_rr")} == {9}
    assert (state.threads, state.threads_rr, state.fixed) == (3, 3, 3)
    assert kinds(saved) == [(MKDIR, "reamer/train-a"), (MOVE, "reamer/train-a")]
    assert saved[-1][1]["homes"] == {str(pid): "user.slice"}, "the journal knows where each process came from"
    assert host.cpus_of("reamer/train-a") == "2-3"

    host.calls.clear()
    pinner.detach("a")
    assert [c[0] for c in host.calls] == ["set_other"] * 3 + ["add_process", "remove_cgroup"], \
        "demoted before anything else changes, then moved home, then its cgroup removed"
    assert host.driver.cgroup_of(pid)["unified"] == "user.slice"
    assert not host.cgroup_dir("reamer/train-a").exists()
    assert all(host.policy_of(tid) == ("other", 0) for tid in tids)
    assert saved[-1] == [], "the journal is empty once everything is undone"


def test_in_place_attach_and_detach_leave_the_host_exactly_as_it_was(tmp_path: Path, sleepers) -> None:
    host = FakeHost(tmp_path)
    host.driver.create(CONTAINER, controllers=("cpu",))  # a runtime's container cgroup: no cpuset enabled yet
    pid = sleeper(sleepers)
    host.add_job_process(pid, CONTAINER, threads=2)
    before = host.snapshot()
    pinner = pinner_on(host)
    saved: list = []
    placement = pinner.place("c", "cgroup", [pid], CONTAINER)
    assert (placement.mode, placement.cpuset_path) == (IN_PLACE, CONTAINER)
    pinner.attach("c", placement, [pid], [4, 5], 20, pinner.new_log("c", saved.append))
    assert kinds(saved) == [(SUBTREE, ""), (SUBTREE, "kubepods"), (SUBTREE, "kubepods/pod1"), (CPUSET, CONTAINER)]
    assert not host.changes("add_process", "create_cgroup"), "pinned where it lives: no process changes cgroup"
    assert host.cpus_of(CONTAINER) == "4-5"

    pinner.detach("c")
    assert host.snapshot() == before
    assert [c for c in host.calls if c[0] == "enable_controller"][-1] == ("enable_controller", "", "cpuset", False), \
        "the undo runs last change first: the top's +cpuset goes last"


def test_reconcile_catches_new_threads_and_leaves_another_managers_cpuset_after_one_repair(tmp_path: Path,
                                                                                          sleepers) -> None:
    host = FakeHost(tmp_path)
    pid = sleeper(sleepers)
    host.add_job_process(pid, "")
    pinner = pinner_on(host)
    pinner.attach("a", pinner.place("a", "pids", [pid]), [pid], [2, 3], 9, pinner.new_log("a", lambda docs: None))
    host.calls.clear()
    assert pinner.reconcile("a", [2, 3], 9).fixed == 0 and host.calls == [], "a settled job: no change at all"

    tid = host.new_thread(pid)
    state = pinner.reconcile("a", [2, 3], 9)
    assert state.fixed == 1 and host.calls == [("set_rr", tid, 9)]

    host.write_cpuset("reamer/train-a", "2-5")  # someone else widens reamer's own cgroup
    host.calls.clear()
    assert pinner.reconcile("a", [2, 3], 9).conflict == ""
    assert host.calls == [("set_cpus", "reamer/train-a", "2-3")], "reamer's own cgroup is put back once"
    host.write_cpuset("reamer/train-a", "2-5")
    host.calls.clear()
    conflict = pinner.reconcile("a", [2, 3], 9).conflict
    assert "another manager" in conflict and host.calls == [], "a second change is reported, not fought"


@pytest.mark.parametrize("survives", [0, 1, 2, 3])
def test_kill_9_mid_attach_then_a_restarted_agent_undoes_from_the_journal(tmp_path: Path, sleepers,
                                                                         survives: int) -> None:
    """The agent dies after `survives` changes of an in-place attach (the journal saved the next one, the
    kernel never saw it); the agent that starts next replays the journal: the host is as it was."""
    host = FakeHost(tmp_path)
    host.driver.create(CONTAINER, controllers=("cpu",))
    pid = sleeper(sleepers)
    host.add_job_process(pid, CONTAINER)
    before = host.snapshot()
    store: dict[str, list] = {}
    pinner = pinner_on(host)
    placement = pinner.place("c", "cgroup", [pid], CONTAINER)
    host.kill_after(survives)
    with pytest.raises(AgentKilled):
        pinner.attach("c", placement, [pid], [4, 5], 20, pinner.new_log("c", lambda docs: store.update(c=docs)))
    assert len(store["c"]) == survives + 1, "every change made, and the one it died in, are in the journal"

    host.revive()
    restarted = pinner_on(host)  # a new agent process: only the store survived
    restarted.placements["c"] = Placement.from_doc(placement.to_doc())
    restarted.new_log("c", lambda docs: store.update(c=docs), store["c"])
    restarted.detach("c")
    assert host.snapshot() == before and store["c"] == []


def test_a_restarted_agent_reattaches_from_the_store_without_touching_what_is_in_place(tmp_path: Path,
                                                                                      sleepers) -> None:
    host = FakeHost(tmp_path)
    pid = sleeper(sleepers)
    host.add_job_process(pid, "")
    store: dict[str, list] = {}
    pinner = pinner_on(host)
    placement = pinner.place("a", "pids", [pid])
    pinner.attach("a", placement, [pid], [2, 3], 9, pinner.new_log("a", lambda docs: store.update(a=docs)))

    restarted = pinner_on(host)
    restarted.placements["a"] = Placement.from_doc(placement.to_doc())
    restarted.new_log("a", lambda docs: store.update(a=docs), store["a"])
    host.calls.clear()
    state = restarted.reconcile("a", [2, 3], 9)
    assert state.threads_rr == 1 and host.calls == [], "its threads are still RR, its cgroup still its own"
    restarted.detach("a")
    assert not host.cgroup_dir("reamer/train-a").exists() and host.driver.cgroup_of(pid)["unified"] == ""


def test_cgroup_v1_cpusets_are_written_levelled_both_ways(tmp_path: Path, sleepers) -> None:
    """A container cgroup with a child (runtimes nest): its cpus move from 0-3 to 4-5, the child's from 0-1.
    The fake kernel refuses a child outside its parent and a parent leaving out a child, as v1 does."""
    host = FakeHost(tmp_path, version=1)
    for controller in ("cpuset", "cpu", "memory"):
        host.driver.create("docker/ctr/sub", controllers=(controller,))
    host._write_cpuset_file("docker/ctr/sub", "0-1")
    host._write_cpuset_file("docker/ctr", "0-3")
    main, worker = sleeper(sleepers), sleeper(sleepers)
    host.add_job_process(main, "docker/ctr")
    host.add_job_process(worker, "docker/ctr/sub")
    before = host.snapshot()
    pinner = pinner_on(host)
    saved: list = []
    placement = pinner.place("c", "cgroup", [main, worker], "docker/ctr")
    assert (placement.mode, placement.cpuset_path) == (IN_PLACE, "docker/ctr")
    pinner.attach("c", placement, [main, worker], [4, 5], 20, pinner.new_log("c", saved.append))
    assert kinds(saved) == [(CPUSET, "docker/ctr/sub"), (CPUSET, "docker/ctr")]
    assert host.changes("write_cpuset") == [
        ("write_cpuset", "docker/ctr", "0-5"), ("write_cpuset", "docker/ctr/sub", "0-1,4-5"),
        ("write_cpuset", "docker/ctr/sub", "4-5"), ("write_cpuset", "docker/ctr", "4-5")]
    host.calls.clear()
    pinner.detach("c")
    assert host.changes("write_cpuset") == [
        ("write_cpuset", "docker/ctr", "0-5"), ("write_cpuset", "docker/ctr/sub", "0-1,4-5"),
        ("write_cpuset", "docker/ctr/sub", "0-1"), ("write_cpuset", "docker/ctr", "0-3")]
    assert host.snapshot() == before


def test_rt_budget_on_v1_is_journalled_and_given_back(tmp_path: Path, sleepers) -> None:
    host = FakeHost(tmp_path, version=1, rt_group_sched=True)
    pid = sleeper(sleepers)
    host.add_job_process(pid, "user.slice")  # RT outside the root cpu cgroup needs a budget
    pinner = TrainingPinner(host, "reamer", 100000, proc_root=host.proc_root, run_root=host.run_root,
                            user_rt_percent=0)
    saved: list = []
    placement = pinner.place("a", "pids", [pid])
    assert placement.cpu_path == "reamer/train-a" and placement.own_cpu
    pinner.attach("a", placement, [pid], [1], 9, pinner.new_log("a", saved.append))
    assert ("set_rt_runtime", "reamer", 100000) in host.calls and ("set_rt_runtime", "reamer/train-a", 100000) in host.calls
    assert host.calls.index(("set_rt_runtime", "reamer", 100000)) < host.calls.index(
        ("set_rt_runtime", "reamer/train-a", 100000)), "the parent's budget grows first"
    assert host.calls.index(("set_rt_runtime", "reamer/train-a", 100000)) < host.calls.index(
        ("add_process", "reamer/train-a", pid, ("cpu",))), "the budget is there before the process moves in"
    pinner.detach("a")
    assert host.driver.get_rt_runtime("reamer") == 0 and not host.cgroup_dir("reamer/train-a", "cpu").exists()
    assert saved[-1] == []


def test_memory_guard_limits_reports_and_removes_on_the_fake_host(tmp_path: Path, sleepers) -> None:
    host = FakeHost(tmp_path)
    pid = sleeper(sleepers)
    host.add_job_process(pid, "")
    events: list[tuple] = []
    guard = InferenceMemoryGuard(host, "reamer", 800, 512, lambda kind, *a, **k: events.append((kind, k)))
    assert guard.host is host and guard.available
    job = SimpleNamespace(name="m", state="running", pid=pid, memory_limit_mb=None)
    guard.apply([job])
    assert host.calls == [("set_oom_score_adj", pid, 800), ("create_cgroup", "reamer/infer-m", ("memory",)),
                          ("set_memory_limit", "reamer/infer-m", 512 * MIB), ("add_process", "reamer/infer-m", pid,
                                                                              ("memory",))]
    host.calls.clear()
    guard.apply([job])
    assert host.calls == [], "a settled job: no change"

    (host.cgroup_dir("reamer/infer-m") / "memory.events").write_text("oom 1\noom_kill 1\n")
    guard.apply([job])
    assert [kind for kind, _ in events] == ["inference_oom_killed"] and "killed by the OOM killer 1" in guard.oom_note("m")

    guard.forget("m")  # its process is still in the cgroup: killed, the cgroup removed at a later pass
    assert host.changes("empty_cgroup", "remove_cgroup") == [("empty_cgroup", "reamer/infer-m")]
    guard.apply([])
    assert host.changes("remove_cgroup") == [("remove_cgroup", "reamer/infer-m")]
    assert not host.cgroup_dir("reamer/infer-m").exists()


def test_a_slurm_step_is_narrowed_in_place_made_rr_and_given_back(tmp_path: Path, sleepers) -> None:
    import os

    from reamer.agent.slurm_jobs import SlurmObservation, demote, pin_steps
    from reamer.host.changes import ChangeLog
    from reamer.host.slurm import SlurmStep

    host = FakeHost(tmp_path)
    job, step = "system.slice/slurmstepd.scope/job_7", "system.slice/slurmstepd.scope/job_7/step_0"
    host.driver.create(step, controllers=("cpuset",))  # Slurm enables cpuset down to the step
    host.write_cpuset(job, "0-3")  # the job's allocation, Slurm's to write
    pid = sleeper(sleepers)
    host.add_job_process(pid, step)
    before, saved = host.snapshot(), []
    host.calls.clear()
    seen = SlurmObservation(7, [SlurmStep(7, "0", step, (pid,))], [0, 1, 2, 3], job_cgroup=job)
    doc = {"cpus": [2, 3], "priority": 9, "slurm_uid": os.getuid()}
    change_log = ChangeLog(host, saved.append)
    made, problems = pin_steps(doc, seen, change_log, host.proc_root)
    assert (made, problems) == (1, [])
    assert host.calls == [("write_cpuset", step, "2-3"), ("set_rr", pid, 9)], "the step, never the job's cgroup"
    assert pin_steps(doc, seen, change_log, host.proc_root) == (0, []), "a pinned step: nothing more"

    assert demote(doc, seen, host) == 1 and host.policy_of(pid) == ("other", 0)
    assert change_log.undo() == [] and host.snapshot() == before and saved[-1] == []
