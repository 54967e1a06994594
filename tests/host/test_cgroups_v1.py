"""Real cgroup v1 on this machine (root), with real SCHED_RR under RT group scheduling."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from reamer.host import sched
from reamer.host.cgroups import CgroupV1Driver, detect_driver
from reamer.host.errors import HostError, PermissionProblem
from tests.conftest import needs_root, wait_for

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "cpuset", "freezer")

pytestmark = [
    needs_root,
    pytest.mark.skipif(not (ROOT / "cpu" / "tasks").exists(), reason="no cgroup v1 cpu hierarchy on this host"),
]


class Cleanup:
    """Tracks processes and a top-level cgroup; undoes everything even when a test fails."""

    def __init__(self, driver: CgroupV1Driver, name: str) -> None:
        self.driver = driver
        self.name = name
        self.procs: list[subprocess.Popen] = []

    def sleeper(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            for controller in CONTROLLERS:
                try:
                    self.driver.add_process("", proc.pid, (controller,))
                except HostError:
                    pass
            if proc.poll() is None:
                try:
                    sched.set_other(proc.pid)
                except HostError:
                    pass
                proc.kill()
            proc.wait(timeout=30)
        for controller in CONTROLLERS:
            top = ROOT / controller / self.name
            if not top.exists():
                continue
            for directory in sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)) + [top]:
                for task in (directory / "tasks").read_text().split():
                    (ROOT / controller / "tasks").write_text(task)
            if controller == "cpu":
                self.driver.set_rt_runtime(self.name, 0)  # clears children first
            self.driver.remove(self.name, recursive=True)


@pytest.fixture
def v1(cgroup_name: str) -> Iterator[tuple[CgroupV1Driver, Cleanup]]:
    driver = detect_driver(ROOT)
    assert isinstance(driver, CgroupV1Driver)
    cleanup = Cleanup(driver, cgroup_name)
    try:
        yield driver, cleanup
    finally:
        cleanup.close()
    assert not driver.exists(cgroup_name)


def test_create_nested_copies_cpuset_from_parent(v1, cgroup_name: str) -> None:
    driver, _ = v1
    path = f"{cgroup_name}/training"
    assert not driver.exists(path)
    driver.create(path, CONTROLLERS)
    assert driver.exists(path)
    root_cpus = driver.get_cpus("")
    assert driver.get_cpus(path) == root_cpus
    mems = (ROOT / "cpuset" / path / "cpuset.mems").read_text().strip()
    assert mems == (ROOT / "cpuset" / "cpuset.mems").read_text().strip()
    driver.set_cpus(path, [root_cpus[-1]])
    assert driver.get_cpus(path) == [root_cpus[-1]]
    assert (ROOT / "cpuset" / path / "cpuset.cpus").read_text().strip() == str(root_cpus[-1])


def test_set_cpus_outside_parent_is_a_clear_error(v1, cgroup_name: str) -> None:
    driver, _ = v1
    driver.create(cgroup_name, ("cpuset",))
    driver.set_cpus(cgroup_name, [0])
    driver.create(f"{cgroup_name}/a", ("cpuset",))
    assert driver.get_cpus(f"{cgroup_name}/a") == [0]
    with pytest.raises(HostError, match="inside the parent"):
        driver.set_cpus(f"{cgroup_name}/a", [0, 999])
    assert driver.get_cpus(f"{cgroup_name}/a") == [0]


def test_shrinking_a_parent_under_its_child_fails_clearly(v1, cgroup_name: str) -> None:
    driver, _ = v1
    if len(driver.get_cpus("")) < 2:
        pytest.skip("needs 2 CPUs")
    first, last = driver.get_cpus("")[0], driver.get_cpus("")[-1]
    driver.create(f"{cgroup_name}/a", ("cpuset",))
    driver.set_cpus(f"{cgroup_name}/a", [last])
    with pytest.raises(HostError, match="shrink child cpusets before their parent"):
        driver.set_cpus(cgroup_name, [first])


def test_rr_needs_rt_runtime_in_child_cgroup(v1, cgroup_name: str) -> None:
    driver, cleanup = v1
    parent, child = cgroup_name, f"{cgroup_name}/training"
    driver.create(child, ("cpu", "cpuset"))
    proc = cleanup.sleeper()
    driver.add_process(child, proc.pid, ("cpu", "cpuset"))
    assert driver.cgroup_of(proc.pid)["cpu"] == child
    assert proc.pid in driver.processes(child)
    assert set(sched.threads_of(proc.pid)) <= set(driver.tasks(child))
    assert driver.get_rt_runtime(child) == 0

    with pytest.raises(PermissionProblem, match="cpu.rt_runtime_us"):
        sched.set_rr(proc.pid, 5)
    assert sched.policy_of(proc.pid)[0] == "other"

    # giving the child a budget raises the parent's first
    driver.set_rt_runtime(child, 50_000)
    assert driver.get_rt_runtime(parent) >= 50_000
    assert driver.get_rt_runtime(child) == 50_000
    sched.set_rr(proc.pid, 5)
    assert sched.policy_of(proc.pid) == ("rr", 5)

    # the budget cannot go while a real-time thread is inside
    with pytest.raises(HostError, match="real-time threads"):
        driver.set_rt_runtime(parent, 0)
    sched.set_other(proc.pid)
    assert sched.policy_of(proc.pid) == ("other", 0)
    driver.set_rt_runtime(parent, 0)  # clears the child first
    assert driver.get_rt_runtime(child) == 0
    assert driver.get_rt_runtime(parent) == 0


def test_second_child_budget_grows_the_parent(v1, cgroup_name: str) -> None:
    driver, _ = v1
    a, b = f"{cgroup_name}/a", f"{cgroup_name}/b"
    driver.create(a, ("cpu",))
    driver.create(b, ("cpu",))
    driver.set_rt_runtime(a, 50_000)
    driver.set_rt_runtime(b, 40_000)
    assert driver.get_rt_runtime(cgroup_name) >= 90_000
    assert (driver.get_rt_runtime(a), driver.get_rt_runtime(b)) == (50_000, 40_000)


def test_budget_over_the_period_is_refused_clearly(v1, cgroup_name: str) -> None:
    driver, _ = v1
    driver.create(cgroup_name, ("cpu",))
    with pytest.raises(HostError, match="does not fit"):
        driver.set_rt_runtime(cgroup_name, 5_000_000)
    assert driver.get_rt_runtime(cgroup_name) == 0


def test_moving_an_rt_thread_into_a_cgroup_without_budget_is_explained(v1, cgroup_name: str) -> None:
    driver, cleanup = v1
    driver.create(cgroup_name, ("cpu",))
    proc = cleanup.sleeper()
    sched.set_rr(proc.pid, 3)  # in the root cpu cgroup RT is allowed
    with pytest.raises(HostError, match="no RT budget"):
        driver.add_task(cgroup_name, proc.pid, ("cpu",))
    assert driver.cgroup_of(proc.pid)["cpu"] == ""
    sched.set_other(proc.pid)


def test_freeze_and_thaw(v1, cgroup_name: str) -> None:
    driver, cleanup = v1
    driver.create(cgroup_name, CONTROLLERS)
    proc = cleanup.sleeper()
    driver.add_process(cgroup_name, proc.pid, ("freezer",))
    driver.freeze(cgroup_name)
    assert driver.is_frozen(cgroup_name)
    assert Path(f"/proc/{proc.pid}/wchan").read_text() == "__refrigerator"
    driver.thaw(cgroup_name)
    assert not driver.is_frozen(cgroup_name)
    wait_for(lambda: Path(f"/proc/{proc.pid}/wchan").read_text() != "__refrigerator", what="task to thaw")


def test_freeze_needs_the_freezer_controller(v1, cgroup_name: str) -> None:
    driver, _ = v1
    driver.create(cgroup_name, ("cpu",))
    with pytest.raises(HostError, match="freezer"):
        driver.freeze(cgroup_name)


def test_remove_busy_cgroup_fails_clearly(v1, cgroup_name: str) -> None:
    driver, cleanup = v1
    driver.create(cgroup_name, ("cpu",))
    proc = cleanup.sleeper()
    driver.add_task(cgroup_name, proc.pid, ("cpu",))
    with pytest.raises(HostError, match="still has tasks"):
        driver.remove(cgroup_name)
    driver.add_process("", proc.pid, ("cpu",))
    driver.remove(cgroup_name)
    assert not driver.exists(cgroup_name)


def test_set_idle_uses_cpu_idle(v1, cgroup_name: str) -> None:
    driver, _ = v1
    driver.create(cgroup_name, ("cpu",))
    directory = ROOT / "cpu" / cgroup_name
    driver.set_idle(cgroup_name, True)
    if (directory / "cpu.idle").exists():
        assert (directory / "cpu.idle").read_text().strip() == "1"
    else:
        assert (directory / "cpu.shares").read_text().strip() == "2"
    driver.set_idle(cgroup_name, False)
    if (directory / "cpu.idle").exists():
        assert (directory / "cpu.idle").read_text().strip() == "0"


def test_cpu_quota(v1, cgroup_name: str) -> None:
    driver, _ = v1
    driver.create(cgroup_name, ("cpu",))
    assert driver.get_cpu_quota(cgroup_name) is None
    (ROOT / "cpu" / cgroup_name / "cpu.cfs_quota_us").write_text("150000")
    assert driver.get_cpu_quota(cgroup_name) == (150000, 100000)


def test_path_escape_is_rejected(v1) -> None:
    driver, _ = v1
    with pytest.raises(HostError, match=r"'\.\.'"):
        driver.create("../etc", ("cpu",))
