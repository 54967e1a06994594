"""Find a container's processes and cgroup from its id (docker, containerd/Kubernetes, CRI-O, podman)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from reamer.host.cgroups import CgroupDriver, _parse_proc_cgroup, detect_driver
from reamer.errors import ErrorKind
from reamer.host.errors import HostError, ReamerError

MIN_ID_PREFIX = 12
# A path segment naming a container: docker "<id>" (cgroupfs) or "docker-<id>.scope" (systemd),
# containerd "cri-containerd-<id>.scope", CRI-O "crio-<id>[.scope]", podman "libpod-<id>[.scope]".
# CRI-O's "crio-conmon-<id>" is the monitor process, not the container.
_SEGMENT = re.compile(r"^(?:docker-|cri-containerd-|crio-|libpod-)?(?P<id>[0-9a-f]{64})(?:\.scope)?$")
_RUNTIME_PREFIX = re.compile(r"^(?:docker|containerd|cri-o|crio|podman)://")


class ContainerNotFound(ReamerError):
    kind = ErrorKind.CONTAINER_NOT_FOUND


@dataclass
class ContainerInfo:
    id: str
    cgroup_path: str  # relative to the cpu hierarchy root (v1) or the unified root (v2)
    pids: list[int] = field(default_factory=list)
    cpus_wanted: int | None = None


def _container_segment(cgroup_path: str) -> tuple[str, str] | None:
    """(container id, cgroup path up to and including the segment naming it), or None."""
    segments = cgroup_path.strip("/").split("/")
    for index in range(len(segments) - 1, -1, -1):
        match = _SEGMENT.match(segments[index])
        if match:
            return match.group("id"), "/".join(segments[: index + 1])
    return None


def container_cgroup(cgroup_path: str) -> str | None:
    """The container's own cgroup in a process's cgroup path (runtimes may nest sub-cgroups under it)."""
    found = _container_segment(cgroup_path)
    return found[1] if found else None


def container_id_in(cgroup_path: str) -> str | None:
    """The full container id named by a cgroup path, or None."""
    found = _container_segment(cgroup_path)
    return found[0] if found else None


def _pick_path(mapping: dict[str, str]) -> str | None:
    for key in ("cpu", "cpuset", "unified"):
        if key in mapping and container_id_in(mapping[key]):
            return mapping[key]
    return next((path for path in mapping.values() if container_id_in(path)), None)


def _scan(proc_root: Path) -> dict[str, list[tuple[int, str]]]:
    """container id -> [(pid, cgroup path)] for every process on the host inside a container."""
    found: dict[str, list[tuple[int, str]]] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            mapping = _parse_proc_cgroup((entry / "cgroup").read_text())
        except (OSError, ValueError):
            continue  # exited meanwhile, or unreadable
        path = _pick_path(mapping)
        named = _container_segment(path) if path is not None else None
        if named is not None:
            # Processes in sub-cgroups of the container count as the container's; keep its own cgroup.
            found.setdefault(named[0], []).append((int(entry.name), named[1]))
    return found


def cores_wanted(driver: CgroupDriver, path: str) -> int | None:
    """Cores a container asked for: the size of its cpuset when narrower than the host's, else its CPU
    quota rounded up (quota/period), else None (no limit)."""
    try:
        cpus = driver.get_cpus(path)
        host_cpus = driver.get_cpus("")
        if cpus and host_cpus and len(cpus) < len(host_cpus):
            return len(cpus)
    except HostError:
        pass
    try:
        quota = driver.get_cpu_quota(path)
    except (HostError, ValueError):
        return None
    if quota is None:
        return None
    quota_us, period_us = quota
    return max(1, math.ceil(quota_us / period_us))


def resolve_container(
    container_id: str,
    proc_root: str | Path = "/proc",
    cgroup_root: str | Path = "/sys/fs/cgroup",
    driver: CgroupDriver | None = None,
) -> ContainerInfo:
    """Processes, cgroup and wanted cores of the running container `container_id` (full id, or a
    unique prefix of at least 12 characters; "containerd://<id>" as Kubernetes reports it works too)."""
    wanted = _RUNTIME_PREFIX.sub("", container_id.strip().lower())
    if not re.fullmatch(r"[0-9a-f]+", wanted or "-"):
        raise ContainerNotFound(
            f"{container_id!r} is not a container id (ids are hexadecimal)",
            "pass the id from `docker ps --no-trunc` (or `crictl ps`, `podman ps --no-trunc`), not the name",
        )
    if len(wanted) < MIN_ID_PREFIX:
        raise ContainerNotFound(
            f"container id {container_id!r} is too short to be unambiguous",
            f"give at least {MIN_ID_PREFIX} characters of the id (see `docker ps --no-trunc`)",
        )
    running = _scan(Path(proc_root))
    matches = sorted(cid for cid in running if cid.startswith(wanted))
    if not matches:
        raise ContainerNotFound(
            f"no process on this host belongs to container {container_id!r}",
            "check `docker ps --no-trunc` (or `crictl ps`, `podman ps --no-trunc`) for the full id; the container "
            "must be running on this node",
        )
    if len(matches) > 1:
        raise ContainerNotFound(
            f"container id prefix {container_id!r} matches {len(matches)} containers: "
            + ", ".join(m[:16] for m in matches),
            "give more characters of the id",
        )
    full_id = matches[0]
    members = sorted(running[full_id])
    cgroup_path = members[0][1]
    if driver is None:
        try:
            driver = detect_driver(cgroup_root, proc_root)
        except HostError:
            driver = None
    return ContainerInfo(
        id=full_id,
        cgroup_path=cgroup_path,
        pids=[pid for pid, _ in members],
        cpus_wanted=cores_wanted(driver, cgroup_path) if driver is not None else None,
    )
