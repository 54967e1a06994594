"""A fake host for tests: the host executor's interface over a temporary cgroup tree and a fake /proc, with
every change recorded and the scheduler, the OOM scores and systemd kept in memory instead of called.

It keeps the kernel's rules that reamer's decisions depend on, so a wrong decision fails here as it would
on a real host: a cgroup v1 cpuset must lie inside its parent's and cover its children's (an unlevelled
write is refused), effective cpus follow the parent's (v2), a cgroup with processes cannot be removed, a
process is in one cgroup per hierarchy. Processes are real ones the test started (the agent finds jobs
through the process table); their threads, cgroups and scheduling live here. No root is needed.

    host = FakeHost(tmp_path)                   # cgroup v2, cpus 0-7, no systemd
    host.add_process(sleeper.pid, "kubepods/pod1/ctr")
    pinner = TrainingPinner(host, "reamer", 900000, proc_root=host.proc_root, run_root=host.run_root)
    ...
    assert ("set_rr", tid, 9) in host.calls
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any, Iterable, Sequence

from reamer.host import cgroups
from reamer.host.cgroups import CgroupDriver, CgroupV1Driver, CgroupV2Driver
from reamer.host.cpulist import format_cpulist, parse_cpulist
from reamer.host.errors import HostError
from reamer.host.executor import HostExecutor
from reamer.host.sched import ThreadGone
from reamer.host.systemd import SLICE, UnitState

V2_FILES = {"cgroup.controllers": "", "cgroup.subtree_control": "", "cgroup.procs": "", "cgroup.threads": "",
            "cgroup.freeze": "0", "cgroup.events": "populated 0\nfrozen 0", "cpu.idle": "0", "cpu.max": "max 100000"}
V2_CONTROLLER_FILES = {"cpuset": {"cpuset.cpus": "", "cpuset.cpus.effective": "", "cpuset.mems": ""},
                       "memory": {"memory.max": "max", "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0"}}
V1_FILES = {"cpuset": {"cpuset.cpus": "", "cpuset.mems": ""},
            "cpu": {"cpu.shares": "1024"},
            "memory": {"memory.limit_in_bytes": "9223372036854771712",
                       "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0"}}
V1_IDS = {"cpuset": 3, "cpu": 2, "memory": 1}
FIRST_FAKE_TID = 4_000_000  # threads made by new_thread(): above any real pid_max of a test machine


def _put(file: Path, text: str) -> None:
    file.write_text(text + ("\n" if text else ""))


def _ids(file: Path) -> list[int]:
    return [int(v) for v in file.read_text().split()] if file.exists() else []


def _put_ids(file: Path, ids: Iterable[int]) -> None:
    _put(file, "\n".join(str(i) for i in sorted(set(ids))))


class AgentKilled(BaseException):
    """FakeHost.kill_after(): the agent died here (BaseException: nothing in the agent may catch it and go on)."""


class _FakeDirs:
    """The fake kernel's mkdir and rmdir, shared by both drivers."""

    host: "FakeHost"

    def make_dir(self, directory: Path) -> None:
        directory.mkdir()
        self.host._populate(directory)

    def remove_dir(self, directory: Path) -> None:
        if not directory.is_dir():
            return
        if _ids(directory / "cgroup.procs") or any(d.is_dir() for d in directory.iterdir()):
            raise HostError(f"cannot remove cgroup {directory}: it still has tasks or child cgroups",
                            "move its tasks to another cgroup and remove its children first")
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()


class FakeV2Driver(_FakeDirs, CgroupV2Driver):
    def __init__(self, root: Path, proc_root: Path, host: "FakeHost") -> None:
        CgroupV2Driver.__init__(self, root, proc_root)
        self.host = host

    def create(self, path: str, controllers: Sequence[str] = cgroups.DEFAULT_CONTROLLERS) -> None:
        super().create(path, controllers)
        for file in [self.root / "cgroup.subtree_control", *self.root.rglob("cgroup.subtree_control")]:
            _put(file, " ".join(sorted(set(file.read_text().replace("+", "").split()))))  # as the kernel shows it

    def add_process(self, path: str, pid: int, controllers: Sequence[str] = cgroups.DEFAULT_CONTROLLERS) -> None:
        self.host._move(pid, path, ("unified",))


class FakeV1Driver(_FakeDirs, CgroupV1Driver):
    def __init__(self, root: Path, proc_root: Path, host: "FakeHost") -> None:
        CgroupV1Driver.__init__(self, root, proc_root)
        self.host = host

    def add_process(self, path: str, pid: int, controllers: Sequence[str] = cgroups.DEFAULT_CONTROLLERS) -> None:
        self.host._move(pid, path, tuple(controllers))


class FakeSystemd:
    """PID 1 on D-Bus, in memory: AllowedCPUs= per unit (written to the unit's cgroup, as systemd does), scopes
    started for loose processes, processes attached back to a unit."""

    def __init__(self, host: "FakeHost", units: dict[str, str] | None = None) -> None:
        self.host = host
        self.units = dict(units or {})  # unit -> its cgroup path
        self.allowed: dict[str, list[int]] = {}

    def unit_state(self, unit: str) -> UnitState | None:
        if unit not in self.units:
            return None
        return UnitState(unit, "active", self.allowed.get(unit, []))

    def set_allowed_cpus(self, unit: str, cpus: Iterable[int]) -> None:
        cpus = sorted(set(cpus))
        self.allowed[unit] = cpus
        if cpus:  # like systemd: "no restriction" leaves cpuset.cpus as it is
            self.host._write_cpuset_file(self.units[unit], format_cpulist(cpus))

    def start_scope(self, unit: str, pids: list[int], cpus: Iterable[int], description: str) -> None:
        path = f"{SLICE}/{unit}"
        self.host.driver.create(path, controllers=("cpuset", "cpu"))
        self.units[unit] = path
        self.set_allowed_cpus(unit, cpus)
        for pid in pids:
            self.host._move(pid, path, ("unified",))

    def attach_processes(self, unit: str, pids: list[int], subcgroup: str = "") -> None:
        path = self.units[unit] + ("/" + subcgroup.strip("/") if subcgroup.strip("/") else "")
        for pid in pids:
            self.host._move(pid, path, ("unified",))


class FakeHost(HostExecutor):
    """The host executor over `base`/cgroup (the tree) and `base`/proc (its /proc); `calls` records every
    change, in order, as tuples: ("write_cpuset", path, text), ("set_rr", tid, priority), ..."""

    def __init__(self, base: Path, version: int = 2, cpus: str = "0-7", rt_group_sched: bool = False,
                 systemd_units: dict[str, str] | None = None) -> None:
        self.base = Path(base)
        self.version_ = version
        self.all_cpus = cpus
        self.rt_group_sched = rt_group_sched
        root, proc = self.base / "cgroup", self.base / "proc"
        self.run_root = str(self.base / "run")  # no run/systemd/system: "not booted with systemd"
        self.calls: list[tuple[Any, ...]] = []
        self.policies: dict[int, tuple[str, int]] = {}
        self.oom_scores: dict[int, int] = {}
        self.affinities: dict[int, list[int]] = {}
        self.nices: dict[int, int] = {}
        self._next_tid = FIRST_FAKE_TID
        self._changes_left: int | None = None  # kill_after(): changes the agent may still make
        self._make_proc(proc)
        root.mkdir(parents=True, exist_ok=True)
        driver: CgroupDriver
        if version == 2:
            driver = FakeV2Driver(root, proc, self)
        else:
            driver = FakeV1Driver(root, proc, self)
        self.driver = driver
        self._make_root(root)
        systemd = FakeSystemd(self, systemd_units) if systemd_units is not None else None
        super().__init__(driver, systemd, str(proc))  # type: ignore[arg-type]

    # --- the tree -----------------------------------------------------------------------------------

    def _make_proc(self, proc: Path) -> None:
        (proc / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
        _put(proc / "sys/kernel/sched_rt_runtime_us", "950000")
        _put(proc / "sys/kernel/sched_rt_period_us", "1000000")
        with gzip.open(proc / "config.gz", "wt") as config:
            config.write("CONFIG_CGROUPS=y\n# CONFIG_RT_GROUP_SCHED is not set\n" if self.version_ == 2 or
                         not self.rt_group_sched else "CONFIG_CGROUPS=y\nCONFIG_RT_GROUP_SCHED=y\n")

    def _make_root(self, root: Path) -> None:
        if self.version_ == 2:
            for name, text in V2_FILES.items():
                _put(root / name, text)
            _put(root / "cgroup.controllers", "cpuset cpu io memory pids")
            _put(root / "cpuset.cpus.effective", self.all_cpus)
            return
        for controller, files in V1_FILES.items():
            (root / controller).mkdir()
            for name, text in {**files, "tasks": "", "cgroup.procs": ""}.items():
                _put(root / controller / name, text)
        _put(root / "cpuset/cpuset.cpus", self.all_cpus)
        _put(root / "cpuset/cpuset.mems", "0")
        if self.rt_group_sched:
            _put(root / "cpu/cpu.rt_runtime_us", "950000")

    def _populate(self, directory: Path) -> None:
        """What the kernel does on mkdir: fill the new cgroup with its control files."""
        if self.version_ == 2:
            enabled = (directory.parent / "cgroup.subtree_control").read_text().replace("+", "").split()
            for name, text in V2_FILES.items():
                _put(directory / name, text)
            _put(directory / "cgroup.controllers", " ".join(enabled))
            for controller in enabled:
                for name, text in V2_CONTROLLER_FILES.get(controller, {}).items():
                    _put(directory / name, text)
            self._refresh_effective()
            return
        controller = directory.relative_to(self.driver.root).parts[0]
        for name, text in {**V1_FILES.get(controller, {}), "tasks": "", "cgroup.procs": ""}.items():
            _put(directory / name, text)
        if controller == "cpu" and self.rt_group_sched:
            _put(directory / "cpu.rt_runtime_us", "0")

    def cgroup_dir(self, path: str, controller: str = "cpuset") -> Path:
        rel = path.strip("/")
        return self.driver.root / rel if self.version_ == 2 else self.driver.root / controller / rel

    def _refresh_effective(self) -> None:
        """v2: cpuset.cpus.effective = its own cpus within the parent's effective ones (or the parent's)."""
        if self.version_ != 2:
            return
        root = self.driver.root
        for directory in sorted((d for d in root.rglob("*") if d.is_dir()), key=lambda d: len(d.parts)):
            file = directory / "cpuset.cpus.effective"
            if not file.exists():
                continue
            parent = directory.parent
            inherited = set(parse_cpulist((parent / "cpuset.cpus.effective").read_text())) \
                if (parent / "cpuset.cpus.effective").exists() else set(parse_cpulist(self.all_cpus))
            own = set(parse_cpulist((directory / "cpuset.cpus").read_text()))
            _put(file, format_cpulist(sorted(own & inherited if own else inherited)))

    def _write_cpuset_file(self, path: str, text: str) -> None:
        """cpuset.cpus = text, refused where the kernel refuses it (v1: outside the parent's cpus, or leaving out
        a child's; an empty one while it has tasks)."""
        directory = self.cgroup_dir(path)
        wanted = set(parse_cpulist(text))
        if self.version_ == 1:
            rel = path.strip("/")
            parent = directory.parent if rel else None
            if parent is not None and not wanted <= set(parse_cpulist((parent / "cpuset.cpus").read_text())):
                raise HostError(f"cannot set cpuset.cpus={text or '(empty)'} on cgroup {path!r}: the kernel refused "
                                "it (Invalid argument): outside its parent's cpus",
                                "use CPUs inside every ancestor's cpuset.cpus")
            for child in (d for d in directory.iterdir() if d.is_dir()):
                if not set(parse_cpulist((child / "cpuset.cpus").read_text())) <= wanted:
                    raise HostError(f"cannot set cpuset.cpus={text or '(empty)'} on cgroup {path!r}: the kernel "
                                    f"refused it (Device or resource busy): child {child.name} uses other cpus",
                                    "narrow the children first")
            if not wanted and _ids(directory / "tasks"):
                raise HostError(f"cannot set cpuset.cpus=(empty) on cgroup {path!r}: it has tasks", "")
        if not (directory / "cpuset.cpus").exists():
            raise HostError(f"cgroup file {directory / 'cpuset.cpus'} does not exist",
                            "create the cgroup (with that controller) first")
        _put(directory / "cpuset.cpus", text.strip())
        self._refresh_effective()

    # --- processes ----------------------------------------------------------------------------------

    def add_job_process(self, pid: int, path: str = "", threads: int = 1) -> list[int]:
        """A real process the test started, as the fake kernel sees it: in cgroup `path` (every hierarchy),
        with `threads` threads (the first is the process itself). Returns its thread ids."""
        if path.strip("/") and not self.driver.exists(path):  # the job's cgroup, made by whoever started it
            self.driver.create(path, controllers=() if self.version_ == 2 else tuple(V1_FILES))
        directory = Path(self.proc_root) / str(pid)
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("status", "stat", "comm"):
            (directory / name).write_text(Path(f"/proc/{pid}/{name}").read_text())
        (directory / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
        self._write_proc_cgroup(pid, {c: path.strip("/") for c in self._hierarchies()})
        self._join(pid, path.strip("/"), self._hierarchies(), [pid])
        return [pid] + [self.new_thread(pid) for _ in range(threads - 1)]

    def new_thread(self, pid: int) -> int:
        """A thread the job starts now: in its process's cgroups, SCHED_OTHER (a moved process's threads do not
        inherit RR)."""
        tid = self._next_tid
        self._next_tid += 1
        proc = Path(self.proc_root)
        (proc / str(pid) / "task" / str(tid)).mkdir(parents=True)
        (proc / str(tid)).mkdir()
        for name in ("status", "stat", "comm"):
            (proc / str(tid) / name).write_text((proc / str(pid) / name).read_text())
        where = self.driver.cgroup_of(pid)
        for controller in self._hierarchies():
            directory = self.cgroup_dir(where.get(controller, ""), controller)
            _put_ids(directory / self._threads_file(), [*_ids(directory / self._threads_file()), tid])
        return tid

    def exit_process(self, pid: int) -> None:
        """The process ended: it leaves its cgroups and the fake /proc (the test ends the real one itself)."""
        for tid in self._threads(pid):
            self._leave(tid, threads_only=True)
            self.policies.pop(tid, None)
        self._leave(pid, threads_only=False)
        proc = Path(self.proc_root)
        for tid in self._threads(pid):
            if tid != pid:
                _rmtree(proc / str(tid))
        _rmtree(proc / str(pid))

    def _hierarchies(self) -> tuple[str, ...]:
        return ("unified",) if self.version_ == 2 else tuple(V1_FILES)

    def _threads_file(self) -> str:
        return "cgroup.threads" if self.version_ == 2 else "tasks"

    def _threads(self, pid: int) -> list[int]:
        task = Path(self.proc_root) / str(pid) / "task"
        return sorted(int(e.name) for e in task.iterdir()) if task.is_dir() else []

    def _write_proc_cgroup(self, pid: int, where: dict[str, str]) -> None:
        if self.version_ == 2:
            text = f"0::/{where['unified']}"
        else:
            text = "\n".join(f"{V1_IDS[c]}:{'cpu,cpuacct' if c == 'cpu' else c}:/{where[c]}" for c in V1_FILES)
        _put(Path(self.proc_root) / str(pid) / "cgroup", text)

    def _leave(self, ident: int, threads_only: bool) -> None:
        for controller in self._hierarchies():
            top = self.driver.root if self.version_ == 2 else self.driver.root / controller
            for directory in [top, *(d for d in top.rglob("*") if d.is_dir())]:
                for name in (self._threads_file(),) if threads_only else (self._threads_file(), "cgroup.procs"):
                    ids = _ids(directory / name)
                    if ident in ids:
                        _put_ids(directory / name, [i for i in ids if i != ident])

    def _join(self, pid: int, path: str, controllers: Sequence[str], threads: list[int]) -> None:
        for controller in controllers:
            directory = self.cgroup_dir(path, controller)
            if not directory.is_dir():
                raise HostError(f"cgroup file {directory / 'cgroup.procs'} does not exist",
                                "create the cgroup (with that controller) first")
            _put_ids(directory / "cgroup.procs", [*_ids(directory / "cgroup.procs"), pid])
            _put_ids(directory / self._threads_file(), [*_ids(directory / self._threads_file()), *threads])

    def _move(self, pid: int, path: str, controllers: Sequence[str]) -> None:
        """Write `pid` to a cgroup.procs: the process and all its threads leave their cgroup for this one."""
        if not (Path(self.proc_root) / str(pid)).is_dir():
            raise ThreadGone(pid)
        path = path.strip("/")
        where = self.driver.cgroup_of(pid)
        hierarchies = ("unified",) if self.version_ == 2 else tuple(controllers)
        threads = self._threads(pid)
        for controller in hierarchies:
            directory = self.cgroup_dir(path, controller)
            if not directory.is_dir():
                raise HostError(f"cgroup file {directory / 'cgroup.procs'} does not exist",
                                "create the cgroup (with that controller) first")
            old = self.cgroup_dir(where.get(controller, ""), controller)
            for name, ids in (("cgroup.procs", [pid]), (self._threads_file(), threads)):
                _put_ids(old / name, [i for i in _ids(old / name) if i not in ids])
            self._join(pid, path, (controller,), threads)
            where[controller] = path
        self._write_proc_cgroup(pid, where)

    # --- the executor's changes, recorded -------------------------------------------------------------

    def kill_after(self, changes: int) -> None:
        """Simulate kill -9 of the agent: after `changes` more changes, every change raises AgentKilled (the
        agent runs no more code: no undo, no cleanup) until revive()."""
        self._changes_left = changes

    def revive(self) -> None:
        """The agent runs again (a new process: the kernel's state, this host, is as the dead one left it)."""
        self._changes_left = None

    def _record(self, call: tuple[Any, ...]) -> None:
        if self._changes_left is not None:
            if self._changes_left <= 0:
                raise AgentKilled(f"the agent was killed before {call}")
            self._changes_left -= 1
        self.calls.append(call)

    def create_cgroup(self, path: str, controllers: Sequence[str] = cgroups.DEFAULT_CONTROLLERS) -> None:
        self._record(("create_cgroup", path, tuple(controllers)))
        super().create_cgroup(path, controllers)
        self._refresh_effective()

    def remove_cgroup(self, path: str, *, recursive: bool = False) -> None:
        self._record(("remove_cgroup", path))
        super().remove_cgroup(path, recursive=recursive)

    def remove_controller_cgroup(self, controller: str, path: str) -> None:
        self._record(("remove_cgroup", path, controller))
        super().remove_controller_cgroup(controller, path)

    def add_process(self, path: str, pid: int, controllers: Sequence[str] = cgroups.DEFAULT_CONTROLLERS) -> None:
        self._record(("add_process", path, pid, tuple(controllers)))
        super().add_process(path, pid, controllers)

    def set_cpus(self, path: str, cpus: Iterable[int]) -> None:
        cpus = sorted(set(cpus))
        self._record(("set_cpus", path, format_cpulist(cpus)))
        if self.version_ == 1:
            directory = self.cgroup_dir(path)
            if not (directory / "cpuset.mems").read_text().strip():
                _put(directory / "cpuset.mems", (directory.parent / "cpuset.mems").read_text().strip())
        self._write_cpuset_file(path, format_cpulist(cpus))

    def write_cpuset(self, path: str, text: str) -> None:
        self._record(("write_cpuset", path, text))
        self._write_cpuset_file(path, text)

    def enable_controller(self, parent: str, controller: str, on: bool) -> None:
        self._record(("enable_controller", parent, controller, on))
        file = self.cgroup_dir(parent) / "cgroup.subtree_control"
        enabled = set(file.read_text().replace("+", "").split())
        if on:
            enabled.add(controller)
        else:
            enabled.discard(controller)
        _put(file, " ".join(sorted(enabled)))
        for child in (d for d in self.cgroup_dir(parent).iterdir() if d.is_dir()):  # its files come and go
            for name, text in V2_CONTROLLER_FILES.get(controller, {}).items():
                if on and not (child / name).exists():
                    _put(child / name, text)
                elif not on and (child / name).exists():
                    (child / name).unlink()
        self._refresh_effective()

    def set_rt_runtime(self, path: str, us: int) -> None:
        self._record(("set_rt_runtime", path, us))
        super().set_rt_runtime(path, us)

    def set_memory_limit(self, path: str, limit_bytes: int | None) -> None:
        self._record(("set_memory_limit", path, limit_bytes))
        super().set_memory_limit(path, limit_bytes)

    def set_idle(self, path: str, idle: bool) -> None:
        self._record(("set_idle", path, idle))
        super().set_idle(path, idle)

    def empty_cgroup(self, path: str, timeout: float) -> bool:
        """"Kills" what is in the memory cgroup: the processes leave the fake kernel (the test's real ones
        go on; end them yourself)."""
        self._record(("empty_cgroup", path))
        directory = self.cgroup_dir(path, "memory")
        if directory.is_dir():
            for pid in _ids(directory / "cgroup.procs"):
                self.exit_process(pid)
        return True

    def remove_named_everywhere(self, name: str) -> list[str]:
        self._record(("remove_named_everywhere", name))
        return super().remove_named_everywhere(name)

    def set_unit_cpus(self, unit: str, cpus: Iterable[int]) -> None:
        cpus = sorted(set(cpus))
        self._record(("set_unit_cpus", unit, format_cpulist(cpus)))
        super().set_unit_cpus(unit, cpus)

    def start_scope(self, unit: str, pids: list[int], cpus: Iterable[int], description: str) -> None:
        cpus = sorted(set(cpus))
        self._record(("start_scope", unit, tuple(pids), format_cpulist(cpus)))
        super().start_scope(unit, pids, cpus, description)

    def attach_to_unit(self, unit: str, pids: list[int], subcgroup: str = "") -> None:
        self._record(("attach_to_unit", unit, tuple(pids), subcgroup))
        super().attach_to_unit(unit, pids, subcgroup)

    # --- scheduling and OOM scores, in memory ---------------------------------------------------------

    def _alive(self, tid: int) -> None:
        if not (Path(self.proc_root) / str(tid)).is_dir():
            raise ThreadGone(tid)

    def policy_of(self, tid: int) -> tuple[str, int]:
        self._alive(tid)
        return self.policies.get(tid, ("other", 0))

    def set_rr(self, tid: int, priority: int) -> None:
        self._alive(tid)
        self._record(("set_rr", tid, priority))
        self.policies[tid] = ("rr", priority)

    def set_other(self, tid: int) -> None:
        self._alive(tid)
        self._record(("set_other", tid))
        self.policies[tid] = ("other", 0)

    def set_idle_policy(self, tid: int) -> None:
        self._alive(tid)
        self._record(("set_idle_policy", tid))
        self.policies[tid] = ("idle", 0)

    def set_nice(self, tid: int, nice: int) -> None:
        self._alive(tid)
        self._record(("set_nice", tid, nice))
        self.nices[tid] = nice

    def set_affinity(self, tid: int, cpus: Iterable[int]) -> None:
        self._alive(tid)
        self._record(("set_affinity", tid, format_cpulist(cpus)))
        self.affinities[tid] = sorted(set(cpus))

    def oom_score_adj(self, pid: int) -> int:
        self._alive(pid)
        return self.oom_scores.get(pid, 0)

    def set_oom_score_adj(self, pid: int, value: int) -> None:
        self._alive(pid)
        self._record(("set_oom_score_adj", pid, value))
        self.oom_scores[pid] = value

    # --- reading it back (for assertions) -------------------------------------------------------------

    def cpus_of(self, path: str) -> str:
        return (self.cgroup_dir(path) / "cpuset.cpus").read_text().strip()

    def snapshot(self) -> dict[str, str]:
        """Every control file of the tree and every process's cgroups: equal snapshots, equal hosts."""
        found = {}
        for file in sorted(p for p in self.base.rglob("*") if p.is_file() and p.suffix != ".gz"):
            found[str(file.relative_to(self.base))] = file.read_text()
        return found

    def changes(self, *kinds: str) -> list[tuple[Any, ...]]:
        """The recorded calls of these kinds (all without kinds)."""
        return [call for call in self.calls if not kinds or call[0] in kinds]


def _rmtree(directory: Path) -> None:
    if not directory.exists():
        return
    for entry in sorted(directory.rglob("*"), key=lambda p: -len(p.parts)):
        entry.rmdir() if entry.is_dir() else entry.unlink()
    directory.rmdir()
