"""cgroup v2 driver against a fake unified tree (this machine's v2 hierarchy has no controllers)."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest

from reamer.host import cgroups
from reamer.host.cgroups import CgroupV1Driver, CgroupV2Driver, detect_driver
from reamer.host.errors import HostError

KERNEL_FILES = {
    "cgroup.controllers": "",
    "cgroup.subtree_control": "",
    "cpuset.cpus": "",
    "cpuset.cpus.effective": "",
    "cpu.idle": "0",
    "cpu.max": "max 100000",
    "cgroup.freeze": "0",
    "cgroup.events": "populated 0\nfrozen 0",
    "cgroup.procs": "",
    "cgroup.threads": "",
}


def populate(directory: Path, controllers: str) -> None:
    """What the kernel does on mkdir: fill the directory with its control files."""
    for name, text in KERNEL_FILES.items():
        (directory / name).write_text(text + ("\n" if text else ""))
    (directory / "cgroup.controllers").write_text(controllers + "\n")


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    populate(tmp_path, "cpuset cpu io memory pids")
    (tmp_path / "cpuset.cpus.effective").write_text("0-7\n")

    def fake_mkdir(directory: Path) -> None:
        directory.mkdir()
        parent_enabled = (directory.parent / "cgroup.subtree_control").read_text().replace("+", "")
        populate(directory, parent_enabled.strip())

    monkeypatch.setattr(cgroups, "_make_dir", fake_mkdir)
    return tmp_path


@pytest.fixture
def driver(root: Path) -> CgroupV2Driver:
    found = detect_driver(root, proc_root=root / "proc")
    assert isinstance(found, CgroupV2Driver)
    return found


def test_detect_driver(tmp_path: Path, root: Path) -> None:
    assert detect_driver(root).version == 2
    v1_root = tmp_path / "v1"
    (v1_root / "cpu").mkdir(parents=True)
    assert isinstance(detect_driver(v1_root), CgroupV1Driver)
    with pytest.raises(HostError, match="no cgroup hierarchy"):
        detect_driver(tmp_path / "nothing")


def test_create_enables_controllers_on_every_level(driver: CgroupV2Driver, root: Path) -> None:
    driver.create("reamer/training")
    assert driver.exists("reamer/training")
    for level in (root, root / "reamer"):
        enabled = set((level / "cgroup.subtree_control").read_text().replace("+", "").split())
        assert enabled == {"cpu", "cpuset"}
    assert set(driver.controllers("reamer/training")) == {"cpu", "cpuset"}
    driver.create("reamer/offline")  # idempotent on the shared parent
    assert (root / "reamer/cgroup.subtree_control").read_text().split() == ["+cpu", "+cpuset"]


def test_create_with_unavailable_controller(root: Path) -> None:
    (root / "cgroup.controllers").write_text("io memory\n")
    with pytest.raises(HostError, match=r"controllers \['cpu', 'cpuset'\] are not available"):
        CgroupV2Driver(root).create("reamer")
    assert not (root / "reamer").exists()


def test_cpus_and_idle(driver: CgroupV2Driver, root: Path) -> None:
    driver.create("reamer/offline")
    assert driver.get_cpus("reamer/offline") == []  # fake tree: no effective cpus written yet
    (root / "reamer/offline/cpuset.cpus.effective").write_text("0-7\n")
    assert driver.get_cpus("reamer/offline") == list(range(8))  # empty cpuset.cpus falls back to effective
    driver.set_cpus("reamer/offline", [2, 3, 5])
    assert (root / "reamer/offline/cpuset.cpus").read_text() == "2-3,5"
    assert driver.get_cpus("reamer/offline") == [2, 3, 5]
    driver.set_idle("reamer/offline", True)
    assert (root / "reamer/offline/cpu.idle").read_text() == "1"
    driver.set_idle("reamer/offline", False)
    assert (root / "reamer/offline/cpu.idle").read_text() == "0"
    assert driver.get_cpus("") == list(range(8))


def test_rt_runtime_is_not_available_on_v2(driver: CgroupV2Driver) -> None:
    driver.create("reamer/training")
    with pytest.raises(HostError) as caught:
        driver.set_rt_runtime("reamer/training", 100_000)
    assert "cgroup v2 has no cpu.rt_runtime_us" in caught.value.message
    assert "root cpu cgroup" in caught.value.message
    assert "RT_GROUP_SCHED" in caught.value.fix
    assert driver.get_rt_runtime("reamer/training") is None
    assert driver.rt_group_sched is False


def test_membership(driver: CgroupV2Driver, root: Path) -> None:
    driver.create("reamer/training")
    driver.add_process("reamer/training", 4242)
    assert (root / "reamer/training/cgroup.procs").read_text() == "4242"
    driver.add_task("reamer/training", 4243)
    assert (root / "reamer/training/cgroup.threads").read_text() == "4243"
    (root / "reamer/training/cgroup.procs").write_text("10\n12\n")
    (root / "reamer/training/cgroup.threads").write_text("10\n11\n12\n")
    assert driver.processes("reamer/training") == [10, 12]
    assert driver.tasks("reamer/training") == [10, 11, 12]


def test_cgroup_of(driver: CgroupV2Driver, root: Path) -> None:
    (root / "proc/77").mkdir(parents=True)
    (root / "proc/77/cgroup").write_text("0::/reamer/training\n")
    assert driver.cgroup_of(77) == {
        "unified": "reamer/training", "cpu": "reamer/training", "cpuset": "reamer/training",
        "freezer": "reamer/training",
    }


@pytest.fixture
def fake_freezer(root: Path) -> Iterator[None]:
    """Plays the kernel: reports frozen in cgroup.events some time after cgroup.freeze is written."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.02):
            for freeze in root.rglob("cgroup.freeze"):
                events = freeze.parent / "cgroup.events"
                wanted = f"populated 1\nfrozen {freeze.read_text().strip() or '0'}\n"
                if events.read_text() != wanted:
                    events.write_text(wanted)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(timeout=10)


def test_freeze_waits_for_the_kernel(driver: CgroupV2Driver, root: Path, fake_freezer) -> None:
    driver.create("reamer/offline")
    assert not driver.is_frozen("reamer/offline")
    driver.freeze("reamer/offline", timeout=30)
    assert (root / "reamer/offline/cgroup.freeze").read_text() == "1"
    assert driver.is_frozen("reamer/offline")
    driver.thaw("reamer/offline")
    assert (root / "reamer/offline/cgroup.freeze").read_text() == "0"


def test_freeze_times_out_clearly(driver: CgroupV2Driver) -> None:
    driver.create("reamer/offline")  # nobody plays the kernel: never reports frozen
    with pytest.raises(HostError, match="did not report frozen"):
        driver.freeze("reamer/offline", timeout=0.1)


def test_quota(driver: CgroupV2Driver, root: Path) -> None:
    driver.create("pod")
    assert driver.get_cpu_quota("pod") is None
    (root / "pod/cpu.max").write_text("250000 100000\n")
    assert driver.get_cpu_quota("pod") == (250000, 100000)


def test_remove(driver: CgroupV2Driver, root: Path) -> None:
    driver.create("reamer/a/b")
    for entry in (root / "reamer").rglob("*"):
        if entry.is_file():
            entry.unlink()  # real cgroupfs dirs rmdir with their files in; a fake tree needs them gone
    with pytest.raises(HostError, match="child cgroups"):
        driver.remove("reamer")
    driver.remove("reamer", recursive=True)
    assert not driver.exists("reamer")
    with pytest.raises(HostError, match="root cgroup"):
        driver.remove("")
