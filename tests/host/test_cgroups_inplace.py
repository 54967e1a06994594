"""Pinning in place on a fake cgroup v2 tree: the change executor records before it writes and undoes
exactly; where a job is placed (in place, systemd unit, scope, reamer's own cgroup); a failed attach
leaves nothing changed; a v2 kernel with RT group scheduling is refused with the reason and the fix.
(The real kernels, systemd and container engines are in tests/hosts/test_pin_in_place.py.)"""
from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from reamer.agent.training import IN_PLACE, OWN, SCOPE, ProcessGate, RtGroupSchedOnV2, TrainingPinner
from reamer.host import cgroups
from reamer.host.cgroups import CgroupV2Driver
from reamer.host.changes import CPUSET, SUBTREE, ChangeLog
from reamer.host.identity import process_facts
from reamer.host.errors import HostError
from reamer.host.systemd import UnitState, cpu_mask, mask_cpus, unit_of_cgroup
from tests.host.test_cgroups_v2 import populate

CID = "e" * 64


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "cg"
    base.mkdir()
    populate(base, "cpuset cpu io memory pids")
    (base / "cpuset.cpus.effective").write_text("0-7\n")

    def fake_mkdir(directory: Path) -> None:
        directory.mkdir()
        populate(directory, (directory.parent / "cgroup.subtree_control").read_text().replace("+", "").strip())

    monkeypatch.setattr(cgroups, "_make_dir", fake_mkdir)
    for level in ("kubepods", "kubepods/pod1", f"kubepods/pod1/{CID}", "system.slice",
                  f"system.slice/docker-{CID}.scope"):
        (base / level).mkdir()
        populate(base / level, "")
    return base


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A fake /proc: this test process lives in the container's cgroup; RT throttling on."""
    base = tmp_path / "proc"
    (base / str(os.getpid())).mkdir(parents=True)
    for name in ("status", "stat"):  # who this process is, as the process gate reads it
        (base / str(os.getpid()) / name).write_text(Path(f"/proc/{os.getpid()}/{name}").read_text())
    (base / "sys" / "kernel").mkdir(parents=True)
    (base / "sys/kernel/sched_rt_runtime_us").write_text("950000\n")
    (base / "sys/kernel/sched_rt_period_us").write_text("1000000\n")
    return base


def lives_in(proc: Path, path: str) -> None:
    (proc / str(os.getpid()) / "cgroup").write_text(f"0::/{path}\n")


def gate_for(placement, proc: Path) -> ProcessGate:
    """The process gate of an attach made by another agent process (this test process plays the training job)."""
    return ProcessGate(placement.owner, [process_facts(os.getpid(), str(proc))], agent_pid=-1, proc_root=str(proc))


def kernel_config(proc: Path, rt_group_sched: bool) -> None:
    with gzip.open(proc / "config.gz", "wt") as config:
        config.write("CONFIG_CGROUPS=y\n" + ("CONFIG_RT_GROUP_SCHED=y\n" if rt_group_sched else
                                             "# CONFIG_RT_GROUP_SCHED is not set\n"))


class FakeSystemd:
    """Stands in for PID 1 on D-Bus: remembers AllowedCPUs= per unit (and writes the cgroup, as systemd does)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.allowed: dict[str, list[int]] = {}
        self.calls: list[tuple] = []

    def unit_state(self, unit: str) -> UnitState | None:
        return UnitState(unit, "active", self.allowed.get(unit, []))

    def set_allowed_cpus(self, unit: str, cpus) -> None:
        self.calls.append(("set", unit, list(cpus)))
        self.allowed[unit] = list(cpus)
        if not cpus:
            return  # like systemd: no restriction means it leaves cpuset.cpus as it is (seen in the lab)
        (self.root / "system.slice" / unit / "cpuset.cpus").write_text(cgroups.format_cpulist(cpus) + "\n")
        (self.root / "system.slice" / unit / "cpuset.cpus.effective").write_text(
            (cgroups.format_cpulist(cpus) or "0-7") + "\n")


def test_cpu_mask_is_systemds_bitmask() -> None:
    assert cpu_mask([0, 2, 9]) == bytes([0b101, 0b10]) and cpu_mask([]) == b""
    assert mask_cpus(cpu_mask([1, 8, 15, 16])) == [1, 8, 15, 16]


@pytest.mark.parametrize(("path", "unit"), [
    (f"system.slice/docker-{CID}.scope", f"docker-{CID}.scope"),
    (f"machine.slice/libpod-{CID}.scope", f"libpod-{CID}.scope"),
    ("system.slice/trainer.service", "trainer.service"),
    (f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-{CID}.scope",
     f"cri-containerd-{CID}.scope"),
    (f"docker/{CID}", None), (f"kubepods/burstable/pod1/{CID}", None), (f"machine.slice/libpod-{CID}.scope/container", None),
])
def test_unit_of_cgroup(path: str, unit: str | None) -> None:
    assert unit_of_cgroup(path) == unit


def test_change_log_records_before_it_writes_and_undoes_exactly(root: Path) -> None:
    driver = CgroupV2Driver(root)
    path = f"kubepods/pod1/{CID}"
    (root / path / "cpuset.cpus").write_text("0-5\n")  # a runtime's --cpuset-cpus
    seen: list[tuple[list, str]] = []
    change_log = ChangeLog(driver, lambda docs: seen.append((docs, (root / path / "cpuset.cpus").read_text())))
    change_log.enable_cpuset_controller(path)
    change_log.set_cpuset(path, [2, 3])
    kinds = [(c.kind, c.target) for c in change_log.changes]
    assert kinds == [(SUBTREE, ""), (SUBTREE, "kubepods"), (SUBTREE, "kubepods/pod1"), (CPUSET, path)]
    assert seen[-1][1].strip() == "0-5", "the record of the cpuset write was saved before the write"
    assert seen[-1][0][-1]["before"] == "0-5" and seen[-1][0][-1]["after"] == "2-3"
    assert (root / path / "cpuset.cpus").read_text().strip() == "2-3"
    assert change_log.undo() == []
    assert (root / path / "cpuset.cpus").read_text().strip() == "0-5"
    assert "cpuset" not in cgroups.CgroupV2Driver(root).subtree_control("kubepods")
    assert seen[-1][0] == [], "the record is empty once everything is undone"


def test_placement_on_v2_without_systemd(root: Path, proc: Path) -> None:
    pinner = TrainingPinner(CgroupV2Driver(root, proc), "reamer", 900000, proc_root=str(proc), run_root=str(root))
    lives_in(proc, f"kubepods/pod1/{CID}/sub")
    placement = pinner.place("j", "container", [os.getpid()])
    assert (placement.mode, placement.cpuset_path, placement.unit) == (IN_PLACE, f"kubepods/pod1/{CID}", None)
    assert pinner.place("j", "pids", [os.getpid()]).mode == OWN


def test_placement_and_attach_through_systemd(root: Path, proc: Path) -> None:
    systemd = FakeSystemd(root)
    pinner = TrainingPinner(CgroupV2Driver(root, proc), "reamer", 900000, proc_root=str(proc), systemd=systemd)
    unit = f"docker-{CID}.scope"
    lives_in(proc, f"system.slice/{unit}")
    placement = pinner.place("j", "container", [os.getpid()])
    assert (placement.mode, placement.unit) == (IN_PLACE, unit)
    scope = pinner.place("p", "pids", [os.getpid()])
    assert (scope.mode, scope.cpuset_path) == (SCOPE, "reamer.slice/reamer-train-p.scope")
    change_log = pinner.new_log("j", lambda docs: None)
    with gate_for(placement, proc) as gate:
        pinner._pin("j", placement, [os.getpid()], [4, 5], change_log, gate)
    assert systemd.allowed[unit] == [4, 5], "systemd, not a file write, narrows a unit's cgroup"
    pinner.placements["j"] = placement
    pinner.detach("j")
    assert systemd.calls[-1] == ("set", unit, []), "detach gives the unit back the AllowedCPUs= it had"
    assert (root / "system.slice" / unit / "cpuset.cpus").read_text().strip() == "", "and the kernel its cpuset"


def test_failed_attach_leaves_nothing_changed(root: Path, proc: Path) -> None:
    pinner = TrainingPinner(CgroupV2Driver(root, proc), "reamer", 900000, proc_root=str(proc), run_root=str(root))
    path = f"kubepods/pod1/{CID}"
    lives_in(proc, path)
    kernel_config(proc, rt_group_sched=False)
    saved: list = []
    placement = pinner.place("j", "container", [os.getpid()])
    # the fake kernel leaves cpuset.cpus.effective empty: as if an ancestor's cpuset left the cpus out
    with pytest.raises(HostError) as info:
        pinner.attach("j", placement, [os.getpid()], [2, 3], 50, pinner.new_log("j", saved.append),
                      gate_for(placement, proc))
    assert "ancestor" in info.value.message and info.value.fix
    assert (root / path / "cpuset.cpus").read_text().strip() == ""
    assert all("cpuset" not in (root / level / "cgroup.subtree_control").read_text().replace("-cpuset", "")
               for level in ("", "kubepods", "kubepods/pod1"))
    assert saved[-1] == [] and "j" not in pinner.placements and "j" not in pinner.logs


def test_v2_kernel_with_rt_group_scheduling_is_refused_with_the_fix(root: Path, proc: Path) -> None:
    pinner = TrainingPinner(CgroupV2Driver(root, proc), "reamer", 900000, proc_root=str(proc), run_root=str(root))
    kernel_config(proc, rt_group_sched=False)
    pinner.check_rt_possible()
    kernel_config(proc, rt_group_sched=True)
    with pytest.raises(RtGroupSchedOnV2) as info:
        pinner.check_rt_possible()
    assert "CONFIG_RT_GROUP_SCHED" in info.value.message and "root cpu cgroup" in info.value.message
    assert "CONFIG_RT_GROUP_SCHED" in info.value.fix and "unified_cgroup_hierarchy=0" in info.value.fix


def test_empty_cpuset_refused_by_older_kernels_comes_back_as_the_parents_cpus(root: Path, monkeypatch) -> None:
    """Kernels before 6.2 refuse an empty cpuset.cpus on a cgroup with tasks (ENOSPC, seen in the lab's 6.1):
    undo then writes the parent's effective cpus, which is what the empty file meant."""
    driver = CgroupV2Driver(root)
    path = f"kubepods/pod1/{CID}"
    (root / "kubepods/pod1/cpuset.cpus.effective").write_text("0-7\n")
    change_log = ChangeLog(driver, lambda docs: None)
    change_log.enable_cpuset_controller(path)
    change_log.set_cpuset(path, [2, 3])
    real_write = cgroups.write_cpuset_raw

    def kernel_6_1(drv, where, text):
        if not text.strip():
            raise HostError(f"the kernel refused '\\n' for {where}/cpuset.cpus: No space left on device", "")
        real_write(drv, where, text)
    monkeypatch.setattr(cgroups, "write_cpuset_raw", kernel_6_1)
    assert change_log.undo() == []
    assert (root / path / "cpuset.cpus").read_text().strip() == "0-7"
