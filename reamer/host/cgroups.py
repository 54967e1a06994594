"""cgroup v1 and v2 drivers behind one interface.

Paths are relative to the hierarchy root, like "reamer/train-a"; "" is the root itself.
"""
from __future__ import annotations

import errno
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Sequence

from reamer.host.cpulist import format_cpulist, parse_cpulist
from reamer.host.errors import HostError, PermissionProblem
from reamer.host.sched import ThreadGone

DEFAULT_CONTROLLERS: tuple[str, ...] = ("cpu", "cpuset")
FREEZE_TIMEOUT_S = 10.0


def _relative(path: str) -> str:
    parts = [part for part in str(path).strip("/").split("/") if part and part != "."]
    if any(part == ".." for part in parts):
        raise HostError(f"cgroup path {path!r} climbs out of the hierarchy with '..'", "use a path like 'reamer/train-a'")
    return "/".join(parts)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _ancestors(path: str) -> list[str]:
    """Non-root ancestors of `path`, top first: "a/b/c" -> ["a", "a/b"]."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _read(file: Path) -> str:
    try:
        return file.read_text().strip()
    except FileNotFoundError:
        raise HostError(f"cgroup file {file} does not exist", "create the cgroup (with that controller) first") from None
    except OSError as error:
        raise HostError(f"cannot read {file}: {error.strerror}", "check the cgroup still exists") from None


def _write(file: Path, value: str | int, *, tid: int | None = None) -> None:
    """Write one value; cgroup files need one write() per value, so no buffering."""
    try:
        fd = os.open(file, os.O_WRONLY | os.O_TRUNC)  # O_TRUNC: harmless on cgroupfs, exact on fake trees
    except FileNotFoundError:
        raise HostError(f"cgroup file {file} does not exist", "create the cgroup (with that controller) first") from None
    except PermissionError:
        raise PermissionProblem(f"not allowed to write {file}", "run reamer as root") from None
    try:
        os.write(fd, str(value).encode())
    except OSError as error:
        if error.errno == errno.ESRCH and tid is not None:
            raise ThreadGone(tid) from None
        if error.errno in (errno.EPERM, errno.EACCES):
            raise PermissionProblem(f"not allowed to write {value!r} to {file}", "run reamer as root") from None
        raise HostError(f"the kernel refused {value!r} for {file}: {error.strerror}", "") from error
    finally:
        os.close(fd)


def _read_ids(file: Path) -> list[int]:
    return sorted({int(line) for line in _read(file).split() if line.strip()})


def _parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/<pid>/cgroup -> controller -> path (relative, "" = root). The v2 line is keyed "unified"."""
    result: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        hierarchy_id, controllers, path = line.split(":", 2)
        relative = path.strip("/")
        if hierarchy_id == "0" and controllers == "":
            result["unified"] = relative
            continue
        for controller in controllers.split(","):
            if controller:
                result[controller] = relative
    return result


class CgroupDriver(ABC):
    """One cgroup hierarchy layout (v1: one tree per controller; v2: one unified tree)."""

    version: int

    def __init__(self, root: str | Path = "/sys/fs/cgroup", proc_root: str | Path = "/proc") -> None:
        self.root = Path(root)
        self.proc_root = Path(proc_root)

    @property
    @abstractmethod
    def rt_group_sched(self) -> bool:
        """True when RT tasks in a child cpu cgroup need cpu.rt_runtime_us > 0 (v1 with RT_GROUP_SCHED)."""

    @abstractmethod
    def create(self, path: str, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None: ...

    @abstractmethod
    def remove(self, path: str, *, recursive: bool = False) -> None:
        """rmdir the cgroup (and, with recursive=True, its empty descendants first); moves no tasks."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def set_cpus(self, path: str, cpus: Iterable[int]) -> None: ...

    @abstractmethod
    def get_cpus(self, path: str) -> list[int]: ...

    @abstractmethod
    def set_rt_runtime(self, path: str, us: int) -> None: ...

    @abstractmethod
    def get_rt_runtime(self, path: str) -> int | None:
        """cpu.rt_runtime_us, or None where the kernel has no such limit."""

    @abstractmethod
    def set_idle(self, path: str, idle: bool) -> None: ...

    @abstractmethod
    def get_cpu_quota(self, path: str) -> tuple[int, int] | None:
        """(quota_us, period_us) of the CFS bandwidth limit, or None when unlimited."""

    @abstractmethod
    def freeze(self, path: str, timeout: float = FREEZE_TIMEOUT_S) -> None:
        """Freeze every task of the cgroup; returns once the kernel reports it frozen."""

    @abstractmethod
    def thaw(self, path: str) -> None: ...

    @abstractmethod
    def is_frozen(self, path: str) -> bool: ...

    @abstractmethod
    def add_task(self, path: str, tid: int, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None: ...

    @abstractmethod
    def add_process(self, path: str, pid: int, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None: ...

    @abstractmethod
    def tasks(self, path: str, controller: str = "cpu") -> list[int]: ...

    @abstractmethod
    def processes(self, path: str, controller: str = "cpu") -> list[int]: ...

    def make_dir(self, directory: Path) -> None:
        """mkdir one cgroup directory (the kernel fills it with its control files; a fake tree fills it itself)."""
        _make_dir(directory)

    def remove_dir(self, directory: Path) -> None:
        """rmdir one cgroup directory (a gone one is fine)."""
        _rmdir(directory)

    def cgroup_of(self, pid: int) -> dict[str, str]:
        """controller -> cgroup path (relative, "" = root) of `pid`, from /proc/<pid>/cgroup."""
        try:
            text = (self.proc_root / str(pid) / "cgroup").read_text()
        except (FileNotFoundError, ProcessLookupError):
            raise ThreadGone(pid) from None
        return _parse_proc_cgroup(text)

    # --- memory (the memory controller must be created with the cgroup: controllers=("memory",)) ---

    def memory_dir(self, path: str) -> Path:
        raise HostError("this cgroup driver has no memory controller", "use cgroup v1 or v2 with memory enabled")

    def set_memory_limit(self, path: str, limit_bytes: int | None) -> None:
        """The cgroup's hard memory limit (v1 memory.limit_in_bytes, v2 memory.max); None = unlimited."""
        directory = self.memory_dir(path)
        value = -1 if limit_bytes is None else int(limit_bytes)
        if self.version == 1:
            # With swap accounting, memory+swap gets the same limit (a job over it must not swap instead);
            # the kernel wants memsw >= limit at every step, so the order depends on the direction.
            files = ["memory.limit_in_bytes"]
            if (directory / "memory.memsw.limit_in_bytes").exists():
                files.append("memory.memsw.limit_in_bytes")
                old = int(_read(directory / "memory.limit_in_bytes"))
                if value == -1 or value > old:
                    files.reverse()
            for name in files:
                _write(directory / name, value)
        else:
            _write(directory / "memory.max", "max" if limit_bytes is None else value)
            if (directory / "memory.swap.max").exists():
                _write(directory / "memory.swap.max", "max" if limit_bytes is None else 0)

    def oom_kills(self, path: str) -> int:
        """Processes of the cgroup the kernel's OOM killer has killed (its own limit or the whole host's);
        v1 memory.oom_control / v2 memory.events, field oom_kill (0 where the kernel does not count)."""
        directory = self.memory_dir(path)
        text = _read(directory / ("memory.oom_control" if self.version == 1 else "memory.events"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


class CgroupV1Driver(CgroupDriver):
    """cgroup v1: a separate tree per controller under <root>/<controller>."""

    version = 1

    def _dir(self, controller: str, path: str) -> Path:
        return self.root / controller / _relative(path)

    @property
    def rt_group_sched(self) -> bool:
        return (self.root / "cpu" / "cpu.rt_runtime_us").exists()

    def _require_controller(self, controller: str) -> None:
        if not (self.root / controller).is_dir():
            raise HostError(
                f"the cgroup v1 controller {controller!r} is not mounted under {self.root}",
                f"mount it: mkdir -p {self.root / controller} && mount -t cgroup -o {controller} {controller} "
                f"{self.root / controller}",
            )

    def create(self, path: str, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None:
        rel = _relative(path)
        if not rel:
            return
        for controller in controllers:
            self._require_controller(controller)
            for level in [*_ancestors(rel), rel]:
                directory = self._dir(controller, level)
                if directory.is_dir():
                    continue
                self.make_dir(directory)
                if controller == "cpuset":
                    # A new v1 cpuset starts empty and accepts no tasks; start from the parent's CPUs and memory.
                    parent = self._dir("cpuset", _parent(level))
                    for name in ("cpuset.cpus", "cpuset.mems"):
                        if not _read(directory / name):
                            _write(directory / name, _read(parent / name))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        rel = _relative(path)
        if not rel:
            raise HostError("refusing to remove the root cgroup", "name a child cgroup")
        hierarchies = {(self.root / name).resolve() for name in os.listdir(self.root)
                       if (self.root / name / "tasks").exists()}  # v1 trees only; co-mount links once
        for hierarchy in sorted(hierarchies):
            directory = hierarchy / rel
            if not directory.is_dir():
                continue
            if recursive:
                for child in sorted((d for d in directory.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
                    self.remove_dir(child)
            self.remove_dir(directory)

    def exists(self, path: str) -> bool:
        rel = _relative(path)
        return any(self._dir(controller, rel).is_dir() for controller in DEFAULT_CONTROLLERS + ("freezer",))

    def set_cpus(self, path: str, cpus: Iterable[int]) -> None:
        directory = self._dir("cpuset", path)
        wanted = sorted(set(cpus))
        if not wanted:
            raise HostError(f"cannot give cgroup {path!r} an empty cpuset", "give at least one CPU")
        if not _read(directory / "cpuset.mems"):
            _write(directory / "cpuset.mems", _read(self._dir("cpuset", _parent(_relative(path))) / "cpuset.mems"))
        try:
            _write(directory / "cpuset.cpus", format_cpulist(wanted))
        except HostError as error:
            raise HostError(
                f"cannot set cpuset.cpus={format_cpulist(wanted)} on cgroup {path!r}: {error.message}",
                "use CPUs inside the parent cgroup's cpuset.cpus, and shrink child cpusets before their parent",
            ) from None

    def get_cpus(self, path: str) -> list[int]:
        return parse_cpulist(_read(self._dir("cpuset", path) / "cpuset.cpus"))

    # --- real-time budget (CONFIG_RT_GROUP_SCHED) ---

    def get_rt_runtime(self, path: str) -> int | None:
        file = self._dir("cpu", path) / "cpu.rt_runtime_us"
        if not self.rt_group_sched:
            return None
        return int(_read(file))

    def children(self, controller: str, path: str) -> list[str]:
        """Child cgroups of `path` in one controller's tree."""
        directory = self._dir(controller, path)
        prefix = f"{path}/" if path else ""
        return sorted(prefix + entry.name for entry in directory.iterdir() if entry.is_dir())

    def set_rt_runtime(self, path: str, us: int) -> None:
        """Set cpu.rt_runtime_us of `path`, keeping the kernel's rule that children's budgets fit in their
        parent's: parents are raised first when growing; children are cleared first when setting 0."""
        rel = _relative(path)
        if not rel:
            raise HostError(
                "refusing to change the root cgroup's cpu.rt_runtime_us (the machine-wide RT budget)",
                "name a child cgroup",
            )
        if us < 0:
            raise HostError(f"cpu.rt_runtime_us must be >= 0, got {us}", "give a budget in microseconds per period")
        if not self.rt_group_sched:
            return  # no RT group scheduling: RT tasks run in any cgroup, there is no budget to hand out
        current = self.get_rt_runtime(rel) or 0
        if us > current:
            for ancestor, needed in self.ancestor_budgets(rel, us):
                self.write_rt_exact(ancestor, needed)
        elif us == 0:
            for child in self.children("cpu", rel):
                if (self.get_rt_runtime(child) or 0) > 0:
                    self.set_rt_runtime(child, 0)
        self.write_rt_exact(rel, us)

    def ancestor_budgets(self, path: str, us: int) -> list[tuple[str, int]]:
        """Ancestors (top first) whose budget must grow so that `path` can have `us`."""
        raises: list[tuple[str, int]] = []
        child, child_need = path, us
        for ancestor in reversed(_ancestors(path)):
            siblings = sum(self.get_rt_runtime(other) or 0 for other in self.children("cpu", ancestor) if other != child)
            have = self.get_rt_runtime(ancestor) or 0
            need = siblings + child_need
            if need > have:
                raises.append((ancestor, need))
            child, child_need = ancestor, max(have, need)
        return list(reversed(raises))

    def write_rt_exact(self, path: str, us: int) -> None:
        """cpu.rt_runtime_us = us on this cgroup alone (no levelling: the caller orders the writes)."""
        file = self._dir("cpu", path) / "cpu.rt_runtime_us"
        try:
            _write(file, us)
        except HostError as error:
            cause = error.__cause__
            code = cause.errno if isinstance(cause, OSError) else None
            if code == errno.EBUSY:
                raise HostError(
                    f"cannot set cpu.rt_runtime_us={us} on cgroup {path!r}: it still holds real-time threads",
                    "demote its threads to SCHED_OTHER (or move them out) before removing its RT budget",
                ) from None
            if code == errno.EINVAL:
                raise HostError(
                    f"cannot set cpu.rt_runtime_us={us} on cgroup {path!r}: the budget does not fit — a child's "
                    "budget must fit in its parent's remaining budget, a parent cannot drop below its children's sum, "
                    "and all top-level cgroups share the machine-wide sched_rt_runtime_us",
                    "use a smaller value, or lower other cgroups' cpu.rt_runtime_us first "
                    "(see /proc/sys/kernel/sched_rt_runtime_us)",
                ) from None
            raise

    def set_idle(self, path: str, idle: bool) -> None:
        directory = self._dir("cpu", path)
        if (directory / "cpu.idle").exists():
            _write(directory / "cpu.idle", 1 if idle else 0)
        else:  # older kernels: the lowest weight is the closest v1 has to "idle"
            _write(directory / "cpu.shares", 2 if idle else 1024)

    def get_cpu_quota(self, path: str) -> tuple[int, int] | None:
        directory = self._dir("cpu", path)
        quota = int(_read(directory / "cpu.cfs_quota_us"))
        period = int(_read(directory / "cpu.cfs_period_us"))
        return None if quota <= 0 else (quota, period)

    # --- freezer ---

    def _freezer_state(self, path: str) -> Path:
        file = self._dir("freezer", path) / "freezer.state"
        if not file.exists():
            raise HostError(
                f"cgroup {path!r} has no freezer (no {file})",
                "create it with controllers including 'freezer' (the root cgroup cannot be frozen)",
            )
        return file

    def freeze(self, path: str, timeout: float = FREEZE_TIMEOUT_S) -> None:
        file = self._freezer_state(path)
        _write(file, "FROZEN")
        deadline = time.monotonic() + timeout
        while _read(file) != "FROZEN":
            if time.monotonic() > deadline:
                raise HostError(
                    f"cgroup {path!r} did not freeze within {timeout:.0f} s (state {_read(file)})",
                    "a task may be stuck in the kernel (D state); retry, or thaw it",
                )
            time.sleep(0.01)

    def thaw(self, path: str) -> None:
        _write(self._freezer_state(path), "THAWED")

    def is_frozen(self, path: str) -> bool:
        return _read(self._freezer_state(path)) == "FROZEN"

    # --- membership ---

    def _join(self, path: str, ident: int, controllers: Sequence[str], file_name: str) -> None:
        for controller in controllers:
            file = self._dir(controller, path) / file_name
            try:
                _write(file, ident, tid=ident)
            except ThreadGone:
                raise
            except HostError as error:
                cause = error.__cause__
                code = cause.errno if isinstance(cause, OSError) else None
                if controller == "cpu" and code == errno.EINVAL:
                    raise HostError(
                        f"cannot move {ident} into cpu cgroup {path!r}: it is real-time and that cgroup has no "
                        "RT budget (cpu.rt_runtime_us)",
                        f"set_rt_runtime({path!r}, ...) before moving real-time threads in",
                    ) from None
                if controller == "cpuset" and code == errno.ENOSPC:
                    raise HostError(
                        f"cannot move {ident} into cpuset cgroup {path!r}: its cpuset.cpus or cpuset.mems is empty",
                        "set its CPUs (set_cpus) first",
                    ) from None
                raise

    def add_task(self, path: str, tid: int, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None:
        self._join(path, tid, controllers, "tasks")

    def add_process(self, path: str, pid: int, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None:
        self._join(path, pid, controllers, "cgroup.procs")

    def tasks(self, path: str, controller: str = "cpu") -> list[int]:
        return _read_ids(self._dir(controller, path) / "tasks")

    def processes(self, path: str, controller: str = "cpu") -> list[int]:
        return _read_ids(self._dir(controller, path) / "cgroup.procs")

    def memory_dir(self, path: str) -> Path:
        return self._dir("memory", path)


def _make_dir(directory: Path) -> None:
    """mkdir one cgroup; the kernel fills it with its control files (tests replace this for fake trees)."""
    try:
        directory.mkdir()
    except PermissionError:
        raise PermissionProblem(f"not allowed to create cgroup {directory}", "run reamer as root") from None


def _rmdir(directory: Path) -> None:
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as error:
        if error.errno == errno.EBUSY or error.errno == errno.ENOTEMPTY:
            raise HostError(
                f"cannot remove cgroup {directory}: it still has tasks or child cgroups",
                "move its tasks to another cgroup and remove its children first",
            ) from None
        if error.errno in (errno.EPERM, errno.EACCES):
            raise PermissionProblem(f"not allowed to remove cgroup {directory}", "run reamer as root") from None
        raise HostError(f"cannot remove cgroup {directory}: {error.strerror}", "") from None


class CgroupV2Driver(CgroupDriver):
    """cgroup v2: one unified tree; controllers are enabled for children via cgroup.subtree_control."""

    version = 2

    def _dir(self, path: str) -> Path:
        return self.root / _relative(path)

    @property
    def rt_group_sched(self) -> bool:
        return False

    def controllers(self, path: str = "") -> list[str]:
        return _read(self._dir(path) / "cgroup.controllers").split()

    def subtree_control(self, path: str) -> set[str]:
        """The controllers `path` enables for its children (cgroup.subtree_control)."""
        return {item.lstrip("+") for item in _read(self._dir(path) / "cgroup.subtree_control").split()}


    def create(self, path: str, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None:
        rel = _relative(path)
        if not rel:
            return
        wanted = [c for c in controllers if c != "freezer"]  # v2 freezing is built in (cgroup.freeze)
        available = set(self.controllers(""))
        missing = [c for c in wanted if c not in available]
        if missing:
            raise HostError(
                f"cgroup v2 controllers {missing} are not available at {self.root}",
                "enable them in the kernel / boot config (and make sure no v1 hierarchy holds them)",
            )
        for level in [*_ancestors(rel), rel]:
            parent = _parent(level)
            to_enable = [c for c in wanted if c not in self.subtree_control(parent)]
            if to_enable:
                _write(self._dir(parent) / "cgroup.subtree_control", " ".join(f"+{c}" for c in to_enable))
            directory = self._dir(level)
            if not directory.is_dir():
                self.make_dir(directory)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        rel = _relative(path)
        if not rel:
            raise HostError("refusing to remove the root cgroup", "name a child cgroup")
        directory = self._dir(rel)
        if recursive and directory.is_dir():
            for child in sorted((d for d in directory.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
                self.remove_dir(child)
        self.remove_dir(directory)

    def exists(self, path: str) -> bool:
        return self._dir(path).is_dir()

    def set_cpus(self, path: str, cpus: Iterable[int]) -> None:
        wanted = sorted(set(cpus))
        if not wanted:
            raise HostError(f"cannot give cgroup {path!r} an empty cpuset", "give at least one CPU")
        # v2: an empty cpuset.mems means "inherit the parent's", so there is nothing to copy.
        _write(self._dir(path) / "cpuset.cpus", format_cpulist(wanted))

    def get_cpus(self, path: str) -> list[int]:
        directory = self._dir(path)
        text = _read(directory / "cpuset.cpus") if (directory / "cpuset.cpus").exists() else ""
        if not text and (directory / "cpuset.cpus.effective").exists():
            text = _read(directory / "cpuset.cpus.effective")
        return parse_cpulist(text)

    def set_rt_runtime(self, path: str, us: int) -> None:
        raise HostError(
            "cgroup v2 has no cpu.rt_runtime_us: real-time budgets per cgroup do not exist there, and with "
            "RT_GROUP_SCHED a SCHED_RR task must stay in the root cpu cgroup",
            "keep real-time training threads in the root cpu cgroup (bind their CPUs with affinity or a cpuset-only "
            "cgroup), or run a kernel without CONFIG_RT_GROUP_SCHED, where RT tasks may live in any cgroup",
        )

    def get_rt_runtime(self, path: str) -> int | None:
        return None

    def set_idle(self, path: str, idle: bool) -> None:
        _write(self._dir(path) / "cpu.idle", 1 if idle else 0)

    def get_cpu_quota(self, path: str) -> tuple[int, int] | None:
        quota, _, period = _read(self._dir(path) / "cpu.max").partition(" ")
        return None if quota == "max" else (int(quota), int(period or 100000))

    def freeze(self, path: str, timeout: float = FREEZE_TIMEOUT_S) -> None:
        _write(self._dir(path) / "cgroup.freeze", 1)
        deadline = time.monotonic() + timeout
        while not self.is_frozen(path):
            if time.monotonic() > deadline:
                raise HostError(
                    f"cgroup {path!r} did not report frozen within {timeout:.0f} s",
                    "a task may be stuck in the kernel (D state); retry, or thaw it",
                )
            time.sleep(0.01)

    def thaw(self, path: str) -> None:
        _write(self._dir(path) / "cgroup.freeze", 0)

    def is_frozen(self, path: str) -> bool:
        for line in _read(self._dir(path) / "cgroup.events").splitlines():
            key, _, value = line.partition(" ")
            if key == "frozen":
                return value.strip() == "1"
        return False

    def add_task(self, path: str, tid: int, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None:
        try:
            _write(self._dir(path) / "cgroup.threads", tid, tid=tid)
        except HostError as error:
            cause = error.__cause__
            if isinstance(cause, OSError) and cause.errno == errno.EOPNOTSUPP:
                raise HostError(
                    f"cannot move thread {tid} alone into cgroup {path!r}: it is not a threaded cgroup",
                    "move the whole process (add_process), or make the cgroup threaded (cgroup.type)",
                ) from None
            raise

    def add_process(self, path: str, pid: int, controllers: Sequence[str] = DEFAULT_CONTROLLERS) -> None:
        _write(self._dir(path) / "cgroup.procs", pid, tid=pid)

    def tasks(self, path: str, controller: str = "cpu") -> list[int]:
        return _read_ids(self._dir(path) / "cgroup.threads")

    def processes(self, path: str, controller: str = "cpu") -> list[int]:
        return _read_ids(self._dir(path) / "cgroup.procs")

    def memory_dir(self, path: str) -> Path:
        return self._dir(path)

    def cgroup_of(self, pid: int) -> dict[str, str]:
        mapping = super().cgroup_of(pid)
        unified = mapping.get("unified", "")
        # One tree: every controller (and the freezer) lives at the same path.
        return {"unified": unified, "cpu": unified, "cpuset": unified, "freezer": unified}


def detect_driver(root: str | Path = "/sys/fs/cgroup", proc_root: str | Path = "/proc") -> CgroupDriver:
    """v1 when per-controller trees (cpu, cpuset) are mounted under `root` (also "hybrid" hosts), else v2."""
    base = Path(root)
    if (base / "cpu").is_dir() or (base / "cpuset").is_dir():
        return CgroupV1Driver(base, proc_root)
    if (base / "cgroup.controllers").exists():
        return CgroupV2Driver(base, proc_root)
    raise HostError(
        f"no cgroup hierarchy found at {base}",
        "mount cgroups (cgroup2 at /sys/fs/cgroup, or the v1 cpu and cpuset controllers) and retry",
    )


# --- exact reads and writes for the change executor (reamer/host/changes.py) ---------------------------

def cpuset_dir(driver: CgroupDriver, path: str) -> Path:
    """The directory holding `path`'s cpuset files (v1: the cpuset tree; v2: the unified tree)."""
    rel = _relative(path)
    return driver.root / "cpuset" / rel if driver.version == 1 else driver.root / rel


def read_cpuset_raw(driver: CgroupDriver, path: str) -> str:
    """cpuset.cpus exactly as it is ("" on v2 means: the parent's)."""
    file = cpuset_dir(driver, path) / "cpuset.cpus"
    return _read(file) if file.exists() else ""


def read_cpuset_effective(driver: CgroupDriver, path: str) -> list[int]:
    directory = cpuset_dir(driver, path)
    name = "cpuset.effective_cpus" if driver.version == 1 else "cpuset.cpus.effective"
    file = directory / name if (directory / name).exists() else directory / "cpuset.cpus"
    return parse_cpulist(_read(file))


def write_cpuset_raw(driver: CgroupDriver, path: str, text: str) -> None:
    """Write cpuset.cpus verbatim; "" is written as a newline (v2: back to the parent's CPUs)."""
    file = cpuset_dir(driver, path) / "cpuset.cpus"
    try:
        _write(file, text or "\n")
    except HostError as error:
        raise HostError(f"cannot set cpuset.cpus={text or '(empty)'} on cgroup {path!r}: {error.message}",
                        "use CPUs inside every ancestor's cpuset.cpus (a kubelet or runtime may have narrowed one)"
                        ) from None


def cpuset_descendants(driver: CgroupDriver, path: str) -> list[str]:
    """Child cgroups below `path` in the cpuset tree, deepest first."""
    base = cpuset_dir(driver, path)
    rel = _relative(path)
    found = [d for d in base.rglob("*") if d.is_dir()] if base.is_dir() else []
    found.sort(key=lambda d: -len(d.parts))
    return [f"{rel}/{d.relative_to(base).as_posix()}".strip("/") for d in found]


def subtree_tasks(driver: CgroupDriver, path: str, controller: str = "cpuset") -> list[int]:
    """Every thread in `path` and its descendants (a container's runtime may nest sub-cgroups)."""
    base = cpuset_dir(driver, path) if controller == "cpuset" or driver.version == 2 else driver.root / controller / _relative(path)
    name = "tasks" if driver.version == 1 else "cgroup.threads"
    found: set[int] = set()
    if not base.is_dir():
        return []
    for directory in [base, *(d for d in base.rglob("*") if d.is_dir())]:
        try:
            found.update(_read_ids(directory / name))
        except HostError:
            continue  # removed meanwhile
    return sorted(found)


def subtree_processes(driver: CgroupDriver, path: str, controller: str = "cpuset") -> list[int]:
    base = cpuset_dir(driver, path) if controller == "cpuset" or driver.version == 2 else driver.root / controller / _relative(path)
    found: set[int] = set()
    if not base.is_dir():
        return []
    for directory in [base, *(d for d in base.rglob("*") if d.is_dir())]:
        try:
            found.update(_read_ids(directory / "cgroup.procs"))
        except HostError:
            continue
    return sorted(found)


def enable_controller(driver: CgroupV2Driver, parent: str, controller: str, on: bool) -> None:
    _write(driver.root / _relative(parent) / "cgroup.subtree_control", f"{'+' if on else '-'}{controller}")


def controller_enabled(driver: CgroupV2Driver, parent: str, controller: str) -> bool:
    return controller in driver.subtree_control(_relative(parent))


def rt_holders(driver: CgroupDriver, path: str = "") -> list[tuple[str, int]]:
    """Cgroups with a real-time budget along `path` and at the top level: (path, cpu.rt_runtime_us),
    for telling who holds the machine's budget when reamer cannot get its share."""
    if not driver.rt_group_sched or not isinstance(driver, CgroupV1Driver):
        return []
    holders: list[tuple[str, int]] = []
    for level in ["", *_ancestors(_relative(path))]:
        for child in driver.children("cpu", level):
            budget = driver.get_rt_runtime(child) or 0
            if budget > 0 and not _relative(path).startswith(child + "/") and child != _relative(path):
                holders.append((child, budget))
    return holders


def rt_children_sum(driver: CgroupV1Driver, path: str) -> int:
    return sum(driver.get_rt_runtime(child) or 0 for child in driver.children("cpu", _relative(path)))


def write_rt_runtime(driver: CgroupV1Driver, path: str, us: int) -> None:
    """Exactly cpu.rt_runtime_us = us on one cgroup (no levelling: the executor orders the writes)."""
    driver.write_rt_exact(_relative(path), us)


def cgroup_dirs_named(root: str | Path, name: str) -> list[Path]:
    """The top-level cgroup `name` in every mounted hierarchy under `root` (v1: one per controller;
    v2 and hybrid: the unified one), those that exist."""
    base = Path(root)
    found: list[Path] = []
    candidates = [base / name]
    if base.is_dir():
        candidates += [child / name for child in base.iterdir() if child.is_dir() and not child.is_symlink()]
    for path in candidates:
        if path.is_dir() and path not in found:
            found.append(path)
    return found


def rt_budget_in_use(root: str | Path = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(the root cpu cgroup's cpu.rt_runtime_us, the sum its top-level children hold) on cgroup v1 with RT
    group scheduling; None where there is no such budget (cgroup v2, or no RT group scheduling)."""
    cpu = Path(root) / "cpu"
    try:
        root_budget = int((cpu / "cpu.rt_runtime_us").read_text())
    except (OSError, ValueError):
        return None
    used = 0
    for child in cpu.iterdir():
        try:
            used += int((child / "cpu.rt_runtime_us").read_text())
        except (OSError, ValueError):
            continue
    return root_budget, used
