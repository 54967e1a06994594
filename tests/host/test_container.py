"""Container resolution against a fake /proc (and fake cgroup v1 tree) for each runtime's naming."""
from __future__ import annotations

from pathlib import Path

import pytest

from reamer.host.cgroups import CgroupV1Driver, CgroupV2Driver
from reamer.host.container import ContainerInfo, container_id_in, cores_wanted, resolve_container
from reamer.host.errors import ReamerError

DOCKER = "a" * 12 + "1" * 52
CONTAINERD = "b" * 12 + "2" * 52
CRIO = "c" * 12 + "3" * 52
PODMAN = "d" * 12 + "4" * 52
TWIN = "a" * 12 + "5" * 52  # shares a 12-char prefix with DOCKER

PATHS = {
    DOCKER: f"/docker/{DOCKER}",
    CONTAINERD: f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-{CONTAINERD}.scope",
    CRIO: f"/kubepods.slice/kubepods-pod2.slice/crio-{CRIO}.scope",
    PODMAN: f"/machine.slice/libpod-{PODMAN}.scope",
}


def v1_lines(path: str) -> str:
    return f"12:cpu,cpuacct:{path}\n11:cpuset:{path}\n10:memory:{path}\n1:name=systemd:{path}\n0::/\n"


def make_proc(root: Path, processes: dict[int, str]) -> Path:
    proc = root / "proc"
    for pid, text in processes.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(text)
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "sys").mkdir(exist_ok=True)
    return proc


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    return make_proc(tmp_path, {
        1: v1_lines("/"),
        100: v1_lines(PATHS[DOCKER]),
        101: v1_lines(PATHS[DOCKER] + "/inner"),  # a sub-cgroup of the container still counts
        200: v1_lines(PATHS[CONTAINERD]),
        300: v1_lines(PATHS[CRIO]),
        301: v1_lines(f"/kubepods.slice/kubepods-pod2.slice/crio-conmon-{CRIO}.scope"),  # monitor, not the container
        400: "0::" + PATHS[PODMAN] + "\n",  # a v2 host
    })


@pytest.mark.parametrize(("cid", "pids"), [(DOCKER, [100, 101]), (CONTAINERD, [200]), (CRIO, [300]), (PODMAN, [400])])
def test_each_runtime(proc: Path, tmp_path: Path, cid: str, pids: list[int]) -> None:
    info = resolve_container(cid, proc_root=proc, cgroup_root=tmp_path / "no-cgroups")
    assert info == ContainerInfo(id=cid, cgroup_path=PATHS[cid].strip("/"), pids=pids, cpus_wanted=None)


def test_kubernetes_style_id_and_prefix(proc: Path, tmp_path: Path) -> None:
    assert resolve_container(f"containerd://{CONTAINERD}", proc_root=proc, cgroup_root=tmp_path).id == CONTAINERD
    assert resolve_container(CRIO[:12].upper(), proc_root=proc, cgroup_root=tmp_path).id == CRIO


def test_unknown_id_names_the_fix(proc: Path, tmp_path: Path) -> None:
    with pytest.raises(ReamerError) as caught:
        resolve_container("e" * 64, proc_root=proc, cgroup_root=tmp_path)
    assert "no process on this host belongs to container" in caught.value.message
    assert "docker ps --no-trunc" in caught.value.fix


def test_short_and_non_hex_ids(proc: Path, tmp_path: Path) -> None:
    with pytest.raises(ReamerError, match="too short"):
        resolve_container(DOCKER[:11], proc_root=proc, cgroup_root=tmp_path)
    with pytest.raises(ReamerError, match="not a container id"):
        resolve_container("my-training-container", proc_root=proc, cgroup_root=tmp_path)


def test_ambiguous_prefix(tmp_path: Path) -> None:
    proc = make_proc(tmp_path, {10: v1_lines(f"/docker/{DOCKER}"), 11: v1_lines(f"/docker/{TWIN}")})
    with pytest.raises(ReamerError, match="matches 2 containers") as caught:
        resolve_container(DOCKER[:12], proc_root=proc, cgroup_root=tmp_path)
    assert "more characters" in caught.value.fix
    assert resolve_container(DOCKER[:13], proc_root=proc, cgroup_root=tmp_path).pids == [10]


def test_container_id_in() -> None:
    assert container_id_in(f"/system.slice/docker-{DOCKER}.scope") == DOCKER
    assert container_id_in(f"/kubepods/burstable/pod1/{CONTAINERD}") == CONTAINERD
    assert container_id_in("/user.slice/session-1.scope") is None
    assert container_id_in(f"/crio-conmon-{CRIO}.scope") is None


def make_v1(root: Path, path: str, cpus: str, quota: int, host_cpus: str = "0-15") -> CgroupV1Driver:
    for controller in ("cpu", "cpuset"):
        (root / controller / path).mkdir(parents=True, exist_ok=True)
    (root / "cpuset/cpuset.cpus").write_text(host_cpus + "\n")
    (root / "cpuset" / path / "cpuset.cpus").write_text(cpus + "\n")
    (root / "cpu" / path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / path / "cpu.cfs_period_us").write_text("100000\n")
    return CgroupV1Driver(root)


def test_cores_wanted_from_cpuset(tmp_path: Path) -> None:
    driver = make_v1(tmp_path, "docker/x", "2-5", -1)
    assert cores_wanted(driver, "docker/x") == 4


def test_cores_wanted_from_quota_rounds_up(tmp_path: Path) -> None:
    driver = make_v1(tmp_path, "docker/x", "0-15", 250000)
    assert cores_wanted(driver, "docker/x") == 3
    driver = make_v1(tmp_path, "docker/y", "0-15", 50000)
    assert cores_wanted(driver, "docker/y") == 1


def test_cores_wanted_none_without_limits(tmp_path: Path) -> None:
    driver = make_v1(tmp_path, "docker/x", "0-15", -1)
    assert cores_wanted(driver, "docker/x") is None
    assert cores_wanted(CgroupV1Driver(tmp_path / "missing"), "docker/x") is None


def test_cores_wanted_v2_cpu_max(tmp_path: Path) -> None:
    (tmp_path / "pod").mkdir()
    (tmp_path / "cgroup.controllers").write_text("cpu cpuset\n")
    (tmp_path / "cpuset.cpus.effective").write_text("0-7\n")
    (tmp_path / "pod/cpuset.cpus").write_text("\n")
    (tmp_path / "pod/cpuset.cpus.effective").write_text("0-7\n")
    (tmp_path / "pod/cpu.max").write_text("150000 100000\n")
    assert cores_wanted(CgroupV2Driver(tmp_path), "pod") == 2


def test_resolve_reads_cores_from_the_cgroup(proc: Path, tmp_path: Path) -> None:
    cgroup_root = tmp_path / "cgroup"
    make_v1(cgroup_root, PATHS[DOCKER].strip("/"), "0-15", 200000)
    info = resolve_container(DOCKER, proc_root=proc, cgroup_root=cgroup_root)
    assert info.cgroup_path == f"docker/{DOCKER}"
    assert info.cpus_wanted == 2


def test_real_proc_unknown_container() -> None:
    with pytest.raises(ReamerError, match="no process on this host belongs"):
        resolve_container("f0" * 32)


# Every naming the runtimes use, on v1 (the cpu/cpuset lines) and v2 (the 0:: line): the container's own
# cgroup is what reamer pins in place, also when the runtime nests the processes one level deeper.
NAMINGS = {
    "docker cgroupfs": (f"/docker/{DOCKER}", f"docker/{DOCKER}"),
    "docker systemd": (f"/system.slice/docker-{DOCKER}.scope", f"system.slice/docker-{DOCKER}.scope"),
    "podman systemd (crun nests container/)": (f"/machine.slice/libpod-{PODMAN}.scope/container",
                                               f"machine.slice/libpod-{PODMAN}.scope"),
    "podman cgroupfs": (f"/libpod_parent/libpod-{PODMAN}", f"libpod_parent/libpod-{PODMAN}"),
    "containerd kubernetes cgroupfs": (f"/kubepods/burstable/pod0a-1b/{CONTAINERD}",
                                       f"kubepods/burstable/pod0a-1b/{CONTAINERD}"),
    "containerd kubernetes systemd": (
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0a_1b.slice/cri-containerd-{CONTAINERD}.scope",
        f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0a_1b.slice/cri-containerd-{CONTAINERD}.scope"),
    "cri-o cgroupfs": (f"/kubepods/besteffort/pod0a-1b/crio-{CRIO}", f"kubepods/besteffort/pod0a-1b/crio-{CRIO}"),
    "cri-o systemd": (f"/kubepods.slice/kubepods-pod2.slice/crio-{CRIO}.scope",
                      f"kubepods.slice/kubepods-pod2.slice/crio-{CRIO}.scope"),
}


@pytest.mark.parametrize("naming", sorted(NAMINGS))
@pytest.mark.parametrize("version", [1, 2])
def test_every_runtime_naming_on_v1_and_v2(tmp_path: Path, naming: str, version: int) -> None:
    from reamer.host.container import container_cgroup

    seen, own = NAMINGS[naming]
    cid = next(c for c in (DOCKER, CONTAINERD, CRIO, PODMAN) if c in seen)
    proc = make_proc(tmp_path, {1: v1_lines("/"), 500: v1_lines(seen) if version == 1 else f"0::{seen}\n"})
    info = resolve_container(cid[:12], proc_root=proc, cgroup_root=tmp_path / "no-cgroups")
    assert (info.id, info.cgroup_path, info.pids) == (cid, own, [500])
    assert container_cgroup(seen) == own
