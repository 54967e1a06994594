"""What Slurm has on this node: a job's steps, their cgroups and task processes, and node updates.

Paths are never built from Slurm's naming (newer Slurm names job directories by an opaque id): the
processes come from `scontrol listpids` (slurmstepd lists what it tracks), and each one's cgroup from
/proc/PID/cgroup. slurmstepd itself and its helper threads are never task processes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from reamer.host.errors import HostError

SCONTROL_TIMEOUT_S = 5.0
SLURM_DAEMONS = frozenset({"slurmstepd", "slurmd", "slurmctld", "slurmscriptd", "acctg_prof", "acctg"})
EXTERN_STEP = "extern"


@dataclass(frozen=True)
class SlurmStep:
    """One step of a Slurm job on this node: its id ("0", "batch", ...), the cgroup its tasks live in
    (the common parent of their cgroups, relative to the hierarchy root) and its task pids."""

    job_id: int
    step: str
    cgroup: str
    pids: tuple[int, ...] = field(default_factory=tuple)


def scontrol_binary() -> str | None:
    return shutil.which("scontrol", path=os.environ.get("PATH", "") + ":/usr/bin:/usr/local/bin")


def listpids(job_id: int, proc_root: str = "/proc") -> dict[str, list[int]] | None:
    """{step: [pids]} of the job's processes slurmstepd tracks on this node, or None when the job has no
    processes here (not started yet, or ended). Raises HostError when scontrol cannot be run."""
    binary = scontrol_binary()
    if binary is None:
        raise HostError("scontrol is not installed on this node", "install slurm-client (apt-get install slurm-client)")
    try:
        done = subprocess.run([binary, "listpids", str(int(job_id))], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise HostError(f"scontrol listpids {job_id} did not answer within {SCONTROL_TIMEOUT_S:g}s",
                        "check slurmd on this node") from None
    if done.returncode != 0:
        return None
    steps: dict[str, list[int]] = {}
    for line in done.stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 3 or not parts[0].lstrip("-").isdigit():
            continue
        pid, step = int(parts[0]), parts[2]
        if pid > 0 and not _is_slurm_daemon(pid, proc_root):
            steps.setdefault(step, []).append(pid)
    return steps or None


def job_steps(job_id: int, controller: str, proc_root: str = "/proc") -> list[SlurmStep] | None:
    """The job's steps on this node with their task cgroups in `controller`'s hierarchy ("" for cgroup v2),
    or None when it has no processes here."""
    tracked = listpids(job_id, proc_root)
    if tracked is None:
        return None
    steps = []
    for step, pids in sorted(tracked.items()):
        paths = [p for p in (cgroup_of(pid, controller, proc_root) for pid in pids) if p is not None]
        if paths:
            steps.append(SlurmStep(job_id, step, common_parent(paths), tuple(sorted(pids))))
    return steps


def task_processes(pids: list[int], proc_root: str = "/proc") -> list[int]:
    """`pids` and their descendants, less Slurm's own daemons (slurmstepd and its helpers)."""
    import psutil

    found: set[int] = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        found.update(p.pid for p in family if not _is_slurm_daemon(p.pid, proc_root))
    return sorted(found)


def cgroup_of(pid: int, controller: str, proc_root: str = "/proc") -> str | None:
    """PID's cgroup in `controller`'s v1 hierarchy, or its v2 cgroup for controller "" (leading "/" dropped)."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller and controller in controllers.split(",")) or (not controller and controllers == ""):
            return path.lstrip("/")
    return None


def update_node(node: str, gres: str | None = None, features: list[str] | None = None) -> None:
    """`scontrol update nodename=NODE [gres=...] [availablefeatures=... activefeatures=...]` (root, munge)."""
    binary = scontrol_binary()
    if binary is None:
        raise HostError("scontrol is not installed on this node", "install slurm-client (apt-get install slurm-client)")
    args = [binary, "update", f"nodename={node}"]
    if gres is not None:
        args.append(f"gres={gres}")
    if features is not None:
        joined = ",".join(features)
        args += [f"availablefeatures={joined}", f"activefeatures={joined}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    if done.returncode != 0:
        raise HostError(f"scontrol update nodename={node} failed: {(done.stderr or done.stdout).strip()}",
                        "run the reporter as root on a node whose slurmctld is up, with the gres in slurm.conf")


def _is_slurm_daemon(pid: int, proc_root: str) -> bool:
    try:
        comm = (Path(proc_root) / str(pid) / "comm").read_text().strip()
    except OSError:
        return True  # gone: nothing to touch
    return comm in SLURM_DAEMONS


def common_parent(paths: list[str]) -> str:
    """The deepest cgroup holding every one of `paths` (itself, for one path)."""
    return "/".join(os.path.commonprefix([p.split("/") for p in paths]))
