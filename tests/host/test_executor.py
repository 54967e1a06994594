"""The host executor and its fake: the fake keeps the kernel's cpuset rules (so an unlevelled write fails in
tests as on a host), the executor's levelled writes pass them, the demo's cleanup and RT budget reading go
through host/, and a bare cgroup driver is still accepted wherever an executor is."""
from __future__ import annotations

from pathlib import Path

import pytest

from reamer.host.cgroups import CgroupV2Driver, rt_budget_in_use
from reamer.host.changes import ChangeLog
from reamer.host.errors import HostError
from reamer.host.executor import CpusetWrite, HostExecutor, executor_for
from reamer.host.fake import FakeHost


@pytest.fixture
def v1(tmp_path: Path) -> FakeHost:
    host = FakeHost(tmp_path, version=1, rt_group_sched=True)
    for controller in ("cpuset", "cpu", "memory"):
        host.driver.create("reamer-x/a/b", controllers=(controller,))
    return host


def test_the_fake_kernel_refuses_what_v1_refuses(v1: FakeHost) -> None:
    v1.write_cpuset("reamer-x/a/b", "0-1")
    v1.write_cpuset("reamer-x/a", "0-3")
    with pytest.raises(HostError, match="outside its parent"):
        v1.write_cpuset("reamer-x/a/b", "4-5")
    with pytest.raises(HostError, match="child b uses other cpus"):
        v1.write_cpuset("reamer-x/a", "2-3")


def test_levelled_writes_move_a_parent_and_its_child_where_single_writes_cannot(v1: FakeHost) -> None:
    v1.write_cpuset("reamer-x/a/b", "0-1")
    v1.write_cpuset("reamer-x/a", "0-3")
    v1.calls.clear()
    v1.write_cpusets([CpusetWrite("reamer-x/a/b", "4-5"), CpusetWrite("reamer-x/a", "4-6")])
    assert (v1.cpus_of("reamer-x/a"), v1.cpus_of("reamer-x/a/b")) == ("4-6", "4-5")
    assert [c[1] for c in v1.calls][:2] == ["reamer-x/a", "reamer-x/a/b"], "widened top-down first"
    v1.write_cpusets([CpusetWrite("reamer-x/a", "5"), CpusetWrite("reamer-x/a/b", "5")])
    assert [c[1] for c in v1.calls][-2:] == ["reamer-x/a/b", "reamer-x/a"], "narrowed bottom-up"


def test_remove_named_everywhere_removes_every_hierarchy_and_names_what_is_busy(v1: FakeHost, tmp_path: Path) -> None:
    assert v1.remove_named_everywhere("reamer-x") == []
    assert not any((v1.driver.root / c / "reamer-x").exists() for c in ("cpuset", "cpu", "memory"))
    v1.driver.create("reamer-y/busy", controllers=("cpu",))
    (v1.driver.root / "cpu/reamer-y/busy/cgroup.procs").write_text("4242\n")
    problems = v1.remove_named_everywhere("reamer-y")
    assert problems and "still has tasks" in problems[0] and (v1.driver.root / "cpu/reamer-y/busy").is_dir()


def test_rt_budget_in_use_reads_the_root_budget_and_its_childrens(v1: FakeHost, tmp_path: Path) -> None:
    v1.set_rt_runtime("reamer-x", 300000)
    assert rt_budget_in_use(v1.driver.root) == (950000, 300000)
    assert rt_budget_in_use(tmp_path / "nothing") is None, "no RT group scheduling: no budget to read"


def test_a_bare_driver_is_wrapped_and_an_executor_passes_through(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    assert executor_for(host) is host
    driver = CgroupV2Driver(tmp_path / "cgroup")
    wrapped = executor_for(driver)
    assert isinstance(wrapped, HostExecutor) and wrapped.driver is driver
    assert ChangeLog(driver, lambda docs: None).host.driver is driver
    with pytest.raises(TypeError):
        executor_for("/sys/fs/cgroup")
