"""The write-ahead journal of reamer's changes that must be undone: a job's cpusets, its RT budget, the
cgroups and scopes made for it. The changes themselves are made by the host executor
(reamer/host/executor.py); this journal decides their order and remembers how to undo them.

Each change is appended to a list and saved (through `save`, into the job's record in the agent's store)
BEFORE it is made, with what was there before it. Undo walks the list backwards and puts back what each
change found, so a failed attach, a detach, and an agent restarted after a crash mid-attach all end with
the host exactly as it was. Undoing a change that never happened (saved, then the crash) is harmless:
every undo writes the old value, and moves only what is still where reamer put it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from reamer.host import cgroups
from reamer.host.cgroups import CgroupDriver, CgroupV1Driver, CgroupV2Driver
from reamer.host.errors import HostError
from reamer.host.executor import CpusetWrite, HostExecutor, executor_for
from reamer.host.sched import ThreadGone
from reamer.host.systemd import Systemd, unit_of_cgroup

log = logging.getLogger("reamer.changes")

CPUSET = "cpuset"  # cpuset.cpus of a cgroup: before/after are the file's text
UNIT_CPUS = "unit-cpus"  # AllowedCPUs= of a systemd unit: before/after are cpu lists
SUBTREE = "subtree"  # +cpuset in a v2 cgroup.subtree_control
MKDIR = "mkdir"  # a cgroup reamer created (its own)
MOVE = "move"  # processes moved into a cgroup reamer created (v1 trees, hosts without systemd)
SCOPE = "scope"  # loose processes moved into a transient scope of their own (systemd)
RT = "rt"  # cpu.rt_runtime_us of the job's cpu cgroup
RT_ANCESTOR = "rt-ancestor"  # cpu.rt_runtime_us raised on an ancestor; before = its value before reamer


@dataclass
class Change:
    kind: str
    target: str  # cgroup path (relative to the hierarchy root) or systemd unit
    controller: str = ""  # the v1 hierarchy a cgroup path is in
    before: Any = None
    after: Any = None
    homes: dict[str, str] = field(default_factory=dict)  # MOVE/SCOPE: pid -> the cgroup it came from
    before_text: str | None = None  # UNIT_CPUS: the cgroup's cpuset.cpus as it was

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "Change":
        return cls(**doc)


class ChangeLog:
    """The changes made for one job, in order."""

    def __init__(self, host: HostExecutor | CgroupDriver, save: Callable[[list[dict[str, Any]]], None],
                 systemd: Systemd | None = None, changes: list[dict[str, Any]] | None = None,
                 ancestor_original: Callable[[str], int | None] = lambda path: None) -> None:
        self.host = executor_for(host, systemd)
        self.driver: CgroupDriver = self.host.driver
        # What an ancestor's cpu.rt_runtime_us was before reamer raised it for ANY job (the shared ledger).
        self.ancestor_original = ancestor_original
        self.save = save
        self.systemd = self.host.systemd
        self.changes = [Change.from_doc(doc) for doc in changes or []]

    def docs(self) -> list[dict[str, Any]]:
        return [change.to_doc() for change in self.changes]

    def _record(self, change: Change) -> Change:
        self.changes.append(change)
        self.save(self.docs())
        return change

    def _need_systemd(self) -> Systemd:
        return self.host.need_systemd()

    # --- changes ---

    def set_cpuset(self, path: str, cpus: list[int]) -> None:
        """cpuset.cpus of a cgroup someone else made (in place); on v1 its children are narrowed to it too.
        Every write is journalled first, then all are made levelled (children narrowed before the parent,
        a parent widened before its children)."""
        text = cgroups.format_cpulist(cpus)
        writes = []
        if self.driver.version == 1:
            for child in cgroups.cpuset_descendants(self.driver, path):
                old = cgroups.read_cpuset_raw(self.driver, child)
                narrowed = sorted(set(cgroups.parse_cpulist(old)) & set(cpus)) or cpus
                if cgroups.parse_cpulist(old) != narrowed:
                    self._record(Change(CPUSET, child, CPUSET, old, cgroups.format_cpulist(narrowed)))
                    writes.append(CpusetWrite(child, cgroups.format_cpulist(narrowed)))
        change = self._record(Change(CPUSET, path, CPUSET, cgroups.read_cpuset_raw(self.driver, path), text))
        if not writes:
            self.host.write_cpuset(path, change.after)
            return
        self.host.write_cpusets([*writes, CpusetWrite(path, change.after)])

    def enable_cpuset_controller(self, path: str) -> None:
        """v2: make cpuset.cpus exist on `path`: +cpuset in every ancestor's subtree_control (top first)."""
        assert isinstance(self.driver, CgroupV2Driver)
        parts = cgroups._relative(path).split("/")
        for depth in range(len(parts)):
            parent = "/".join(parts[:depth])
            if not cgroups.controller_enabled(self.driver, parent, "cpuset"):
                self._record(Change(SUBTREE, parent, "", "", "cpuset"))
                self.host.enable_controller(parent, "cpuset", True)

    def set_unit_cpus(self, unit: str, cgroup_path: str, cpus: list[int]) -> None:
        state = self.host.unit_state(unit)
        if state is None:
            raise HostError(f"systemd has no unit {unit} for cgroup {cgroup_path!r}",
                            "check the job is still running (systemctl status)")
        change = self._record(Change(UNIT_CPUS, unit, cgroup_path, state.allowed_cpus, sorted(cpus),
                                     before_text=cgroups.read_cpuset_raw(self.driver, cgroup_path)))
        self.host.set_unit_cpus(unit, change.after)

    def make_cgroup(self, path: str, controller: str) -> None:
        if self.driver.exists(path) and (self.driver.version == 2 or (self.driver.root / controller / path).is_dir()):
            return
        self._record(Change(MKDIR, path, controller))
        self.host.create_cgroup(path, controllers=(controller,))

    def move(self, path: str, controller: str, pids: list[int]) -> None:
        homes = {}
        for pid in pids:
            try:
                homes[str(pid)] = self.driver.cgroup_of(pid).get(controller, "")
            except ThreadGone:
                continue
        self._record(Change(MOVE, path, controller, homes=homes))
        for pid in homes:
            try:
                self.host.add_process(path, int(pid), controllers=(controller,))
            except ThreadGone:
                continue

    def start_scope(self, unit: str, scope_path: str, pids: list[int], cpus: list[int], description: str) -> None:
        self._need_systemd()
        homes = {}
        for pid in pids:
            try:
                homes[str(pid)] = self.driver.cgroup_of(pid).get("unified", "")
            except ThreadGone:
                continue
        self._record(Change(SCOPE, unit, scope_path, homes=homes, after=sorted(cpus)))
        self.host.start_scope(unit, [int(p) for p in homes], cpus, description)

    def set_rt(self, path: str, us: int, original: int | None = None) -> None:
        """cpu.rt_runtime_us of the job's cpu cgroup, raising ancestors first where the budget does not fit.
        `original`: what the cgroup had before reamer first touched it (when another job already did)."""
        assert isinstance(self.driver, CgroupV1Driver)
        current = self.driver.get_rt_runtime(path) or 0
        if us > current:
            for ancestor, needed in self.driver.ancestor_budgets(cgroups._relative(path), us):
                before = self.ancestor_original(ancestor)
                self._record(Change(RT_ANCESTOR, ancestor, "cpu",
                                    self.driver.get_rt_runtime(ancestor) or 0 if before is None else before, needed))
                self.host.set_rt_runtime(ancestor, needed)
        if not any(c.kind == RT and c.target == path for c in self.changes):
            self._record(Change(RT, path, "cpu", current if original is None else original, us))
        else:
            for change in self.changes:
                if change.kind == RT and change.target == path:
                    change.after = us
            self.save(self.docs())
        self.host.set_rt_runtime(path, us)
        if us < current:
            self.shrink_ancestors(path)

    def shrink_ancestors(self, path: str) -> None:
        """Give back what reamer raised on the ancestors of `path` that its children no longer need."""
        assert isinstance(self.driver, CgroupV1Driver)
        raised = {c.target: c.before for c in self.changes if c.kind == RT_ANCESTOR}
        for ancestor in reversed(cgroups._ancestors(cgroups._relative(path))):
            if ancestor not in raised:
                continue
            original = self.ancestor_original(ancestor)
            floor = max(raised[ancestor] if original is None else original, cgroups.rt_children_sum(self.driver, ancestor))
            if (self.driver.get_rt_runtime(ancestor) or 0) > floor:
                self.host.set_rt_runtime(ancestor, floor)

    # --- undo ---

    def undo(self) -> list[str]:
        """Undo every change, last first; returns the problems (undo goes on past each one)."""
        problems: list[str] = []
        for change in reversed(list(self.changes)):
            if change not in self.changes:
                continue  # undone with the run of cpuset writes it belongs to
            try:
                if change.kind == CPUSET and self._undo_cpuset_run(change):
                    continue
                self._undo(change)
            except ThreadGone:
                pass
            except HostError as error:
                problems.append(f"{change.kind} {change.target}: {error.message}")
                log.warning("undo of %s %s failed: %s", change.kind, change.target, error)
            self.changes.remove(change)
            self.save(self.docs())
        return problems

    def _undo_cpuset_run(self, last: Change) -> bool:
        """Undo `last` with the cpuset writes journalled right before it (one set_cpuset on v1: a cgroup and its
        children) as one levelled write; False when `last` stands alone (the single-write undo handles it)."""
        if self.driver.version != 1:  # v2 writes one cgroup per change (and an empty one needs _restore_cpuset)
            return False
        end = self.changes.index(last)
        start = end
        while start > 0 and self.changes[start - 1].kind == CPUSET:
            start -= 1
        run = self.changes[start:end + 1]
        if len(run) < 2:
            return False
        self.host.write_cpusets([CpusetWrite(c.target, c.before) for c in reversed(run) if self.driver.exists(c.target)])
        for change in run:
            self.changes.remove(change)
        self.save(self.docs())
        return True

    def _undo(self, change: Change) -> None:
        if change.kind == CPUSET:
            if self.driver.exists(change.target):
                self._restore_cpuset(change.target, change.before)
        elif change.kind == UNIT_CPUS:
            if self.host.unit_state(change.target) is not None:
                self.host.set_unit_cpus(change.target, change.before or [])
            self._settle_unit_cpuset(change)
        elif change.kind == SUBTREE:
            try:
                self.host.enable_controller(change.target, "cpuset", False)
            except HostError as error:  # a child uses it now (another manager): leaving it on harms nobody
                log.info("left +cpuset on %s: %s", change.target, error.message)
        elif change.kind == MKDIR:
            if self.driver.version == 1:
                self.host.remove_controller_cgroup(change.controller, change.target)
            elif self.driver.exists(change.target):
                self.host.remove_cgroup(change.target)
        elif change.kind == MOVE:
            self._move_back(change)
        elif change.kind == SCOPE:
            self._scope_back(change)
        elif change.kind == RT:
            if self.driver.exists(change.target):
                self.host.set_rt_runtime(change.target, int(change.before or 0))
        elif change.kind == RT_ANCESTOR:
            original = self.ancestor_original(change.target)
            floor = max(int(change.before or 0) if original is None else original,
                        cgroups.rt_children_sum(self.driver, change.target))  # type: ignore[arg-type]
            if (self.driver.get_rt_runtime(change.target) or 0) > floor:
                self.host.set_rt_runtime(change.target, floor)

    def _settle_unit_cpuset(self, change: Change, timeout: float = 5.0) -> None:
        """systemd does not write cpuset.cpus back when AllowedCPUs= goes back to empty (no restriction):
        put the file back as it was, so the kernel's view is the one systemd had before, too."""
        path, wanted = change.controller, change.before_text
        if wanted is None or not self.driver.exists(path):
            return
        expected = cgroups.parse_cpulist(wanted)
        deadline = time.monotonic() + timeout
        while cgroups.parse_cpulist(cgroups.read_cpuset_raw(self.driver, path)) != expected:
            if not change.before or time.monotonic() > deadline:  # systemd will not write it: reamer does
                self._restore_cpuset(path, wanted)
                return
            time.sleep(0.05)

    def _restore_cpuset(self, path: str, text: str) -> None:
        """cpuset.cpus back to `text`. Kernels before 6.2 refuse an empty cpuset.cpus on a cgroup with tasks
        (ENOSPC), also on v2 where empty means "the parent's": then the parent's effective cpus are written,
        which is what the empty file gave the job (systemd meets the same refusal and leaves the file)."""
        try:
            self.host.write_cpuset(path, text)
        except HostError:
            if text.strip() or self.driver.version != 2:
                raise
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            inherited = cgroups.read_cpuset_effective(self.driver, parent)
            log.info("cgroup %s: the kernel refuses an empty cpuset.cpus while it has tasks; wrote its parent's "
                     "cpus %s, what the empty file meant", path, cgroups.format_cpulist(inherited))
            self.host.write_cpuset(path, cgroups.format_cpulist(inherited))

    def _home(self, pid: int, homes: dict[str, str]) -> str:
        import psutil
        if str(pid) in homes:
            return homes[str(pid)]
        try:
            for parent in psutil.Process(pid).parents():
                if str(parent.pid) in homes:
                    return homes[str(parent.pid)]
        except psutil.Error:
            pass
        return next(iter(homes.values()), "")

    def _move_back(self, change: Change) -> None:
        if self.driver.version == 1 and not (self.driver.root / change.controller / change.target).is_dir():
            return
        if self.driver.version == 2 and not self.driver.exists(change.target):
            return
        for pid in self.driver.processes(change.target, change.controller):
            home = self._home(pid, change.homes)
            try:
                self.host.add_process(home, pid, controllers=(change.controller,))
            except ThreadGone:
                continue
            except HostError as error:  # its old cgroup is gone: the root always takes it
                log.warning("cannot move %d back to %r (%s); moving it to the root cgroup", pid, home, error.message)
                self.host.add_process("", pid, controllers=(change.controller,))

    def _scope_back(self, change: Change) -> None:
        self._need_systemd()
        scope_path = change.controller
        if not self.driver.exists(scope_path):
            return
        for pid in cgroups.subtree_processes(self.driver, scope_path):
            home = self._home(pid, change.homes)
            unit_path, unit = _owning_unit(home)
            try:
                if unit is not None:
                    self.host.attach_to_unit(unit, [pid], "/" + home[len(unit_path):].strip("/") if home != unit_path else "")
                else:
                    self.host.add_process(home, pid)
            except ThreadGone:
                continue
            except HostError as error:
                if not _alive(pid):
                    continue
                log.warning("cannot move %d back to %r through systemd (%s); writing cgroup.procs", pid, home,
                            error.message)
                self.host.add_process(home, pid)


def _owning_unit(path: str) -> tuple[str, str | None]:
    """(cgroup path of the unit, unit) for the deepest unit cgroup at or above `path`."""
    parts = path.strip("/").split("/")
    for depth in range(len(parts), 0, -1):
        unit = unit_of_cgroup("/".join(parts[:depth]))
        if unit is not None and not unit.endswith(".slice"):
            return "/".join(parts[:depth]), unit
    return "", None


def _alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
