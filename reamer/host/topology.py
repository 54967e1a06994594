"""CPU topology from sysfs: online CPUs, SMT siblings, packages, NUMA nodes, L3 groups, ISA flags."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from reamer.host.cpulist import parse_cpulist
from reamer.host.errors import HostError


@dataclass(frozen=True)
class Cpu:
    id: int
    core_id: int
    package_id: int
    numa_node: int
    l3_id: int


@dataclass(frozen=True)
class Topology:
    cpus: tuple[Cpu, ...]
    model_name: str
    isa_flags: tuple[str, ...]

    def cpu_ids(self) -> list[int]:
        return sorted(cpu.id for cpu in self.cpus)

    def cpu(self, cpu_id: int) -> Cpu:
        for cpu in self.cpus:
            if cpu.id == cpu_id:
                return cpu
        raise KeyError(f"CPU {cpu_id} is not an online CPU of this machine (online: {self.cpu_ids()})")

    def physical_cores(self) -> list[tuple[int, ...]]:
        """Each physical core as the tuple of its SMT sibling CPU ids, in allocation order:
        by NUMA node, then L3 group, then package, then core id."""
        by_core: dict[tuple[int, int], list[Cpu]] = {}
        for cpu in self.cpus:
            by_core.setdefault((cpu.package_id, cpu.core_id), []).append(cpu)

        def order(members: list[Cpu]) -> tuple[int, int, int, int, int]:
            first = min(members, key=lambda c: c.id)
            return (first.numa_node, first.l3_id, first.package_id, first.core_id, first.id)

        groups = sorted(by_core.values(), key=order)
        return [tuple(sorted(c.id for c in members)) for members in groups]

    def siblings(self, cpu: int) -> tuple[int, ...]:
        """The SMT siblings of `cpu`, including `cpu` itself."""
        this = self.cpu(cpu)
        return tuple(sorted(c.id for c in self.cpus if (c.package_id, c.core_id) == (this.package_id, this.core_id)))

    def numa_nodes(self) -> dict[int, list[int]]:
        return _group_by(self.cpus, lambda c: c.numa_node)

    def l3_groups(self) -> dict[int, list[int]]:
        return _group_by(self.cpus, lambda c: c.l3_id)

    def packages(self) -> dict[int, list[int]]:
        return _group_by(self.cpus, lambda c: c.package_id)

    def has_isa(self, flag: str) -> bool:
        return flag.lower() in self.isa_flags


def _group_by(cpus: tuple[Cpu, ...], key) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for cpu in sorted(cpus, key=lambda c: c.id):
        groups.setdefault(key(cpu), []).append(cpu.id)
    return dict(sorted(groups.items()))


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    """Model name and ISA flags, cached for the process. /proc/cpuinfo first: py-cpuinfo takes about two
    seconds (it starts subprocesses), which every agent start and CLI call would pay."""
    fields = _proc_cpuinfo_fields()
    if fields.get("model name") and fields.get("flags"):
        return fields["model name"], tuple(sorted({flag.lower() for flag in fields["flags"].split()}))
    try:
        import cpuinfo

        info = cpuinfo.get_cpu_info()
    except Exception:  # a broken cpuinfo must not stop topology discovery
        return "unknown", ()
    model = str(info.get("brand_raw") or info.get("arch_string_raw") or "unknown")
    flags = tuple(sorted({str(flag).lower() for flag in info.get("flags", [])}))
    return model, flags


def _proc_cpuinfo_fields(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor block of /proc/cpuinfo as key -> value (empty when unreadable)."""
    fields: dict[str, str] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return fields
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path, default: int) -> int:
    text = _read(path)
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _numa_node_of(sys_root: Path, cpu_dir: Path, cpu_id: int) -> int:
    # cpuN/nodeM links exist when the kernel has NUMA; otherwise look at node*/cpulist, else node 0.
    for entry in sorted(cpu_dir.glob("node[0-9]*")):
        return int(entry.name[4:])
    for node_dir in sorted((sys_root / "devices/system/node").glob("node[0-9]*")):
        cpulist = _read(node_dir / "cpulist")
        if cpulist is not None and cpu_id in parse_cpulist(cpulist):
            return int(node_dir.name[4:])
    return 0


def _l3_id_of(cpu_dir: Path, package_id: int) -> int:
    for index in sorted((cpu_dir / "cache").glob("index[0-9]*")):
        if _read(index / "level") != "3":
            continue
        cache_id = _read(index / "id")
        if cache_id is not None and cache_id.lstrip("-").isdigit():
            return int(cache_id)
        shared = _read(index / "shared_cpu_list")
        if shared:
            return min(parse_cpulist(shared))
    # No L3 described (some VMs): treat each package as one last-level-cache group.
    return package_id


def read_topology(
    sys_root: str | Path = "/sys",
    *,
    isa_flags: tuple[str, ...] | list[str] | None = None,
    model_name: str | None = None,
) -> Topology:
    """Read the online CPUs from `sys_root`/devices/system/cpu. ISA flags and the model name come from
    py-cpuinfo (cached) unless passed in, which tests do to stay fast and deterministic."""
    root = Path(sys_root)
    cpu_root = root / "devices/system/cpu"
    online_text = _read(cpu_root / "online")
    if online_text is None:
        raise HostError(
            f"cannot read the online CPU list at {cpu_root / 'online'}",
            "mount sysfs at /sys (or pass the right sys_root)",
        )
    cpus: list[Cpu] = []
    for cpu_id in parse_cpulist(online_text):
        cpu_dir = cpu_root / f"cpu{cpu_id}"
        package_id = _read_int(cpu_dir / "topology/physical_package_id", 0)
        cpus.append(
            Cpu(
                id=cpu_id,
                core_id=_read_int(cpu_dir / "topology/core_id", cpu_id),
                package_id=package_id,
                numa_node=_numa_node_of(root, cpu_dir, cpu_id),
                l3_id=_l3_id_of(cpu_dir, package_id),
            )
        )
    if isa_flags is None or model_name is None:
        detected_model, detected_flags = _cpuinfo()
        isa_flags = detected_flags if isa_flags is None else isa_flags
        model_name = detected_model if model_name is None else model_name
    return Topology(
        cpus=tuple(cpus),
        model_name=model_name,
        isa_flags=tuple(sorted({flag.lower() for flag in isa_flags})),
    )
