"""A private single-node Slurm for the tests: its own munge key and socket, free ports, state and logs in a
temporary directory, the project's Prolog/Epilog, and daemons in their own process group.

Debian's slurmctld/slurmd/slurm-client/munge packages (.ci/run installs them). Nothing of the host's own
Slurm configuration is read: every client gets SLURM_CONF pointing at the private slurm.conf.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRIB = REPO / "contrib" / "slurm"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_line() -> str:
    """This host as slurmd sees it (`slurmd -C`), first line only."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True, timeout=30).stdout
    return out.splitlines()[0]


@dataclass
class SlurmCluster:
    """One controller and one node on this host. `env` is what every Slurm client command needs."""

    base: Path
    agent_socket: str | None = None  # exported to the Prolog/Epilog as REAMER_SOCKET
    gres_count: int = 0  # reamer_spare GRES the node is configured with (0: no GRES)
    conf_dir: Path | None = None  # where slurm.conf goes (None: the temporary directory; a lab VM: /etc/slurm)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def create(cls, agent_socket: str | None = None, gres_count: int = 0, conf_dir: Path | None = None
               ) -> "SlurmCluster":
        base = Path(tempfile.mkdtemp(prefix="rmr-slurm-", dir="/tmp"))
        os.chmod(base, 0o755)
        return cls(base=base, agent_socket=agent_socket, gres_count=gres_count, conf_dir=conf_dir)

    @property
    def conf(self) -> Path:
        return (self.conf_dir or self.base) / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket"

    @property
    def node_name(self) -> str:
        return node_line().split()[0].split("=", 1)[1]

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        return env

    def write_config(self) -> None:
        for sub in ("munge", "munge-key", "state", "spool", "log"):
            (self.base / sub).mkdir(exist_ok=True)
        for sub, mode in (("munge", 0o755), ("munge-key", 0o700)):  # munged wants its socket's directory open to all
            os.chown(self.base / sub, _uid("munge"), _gid("munge"))
            os.chmod(self.base / sub, mode)
        key = self.base / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, _uid("munge"), _gid("munge"))
        os.chmod(key, 0o400)
        # slurmd gives Prolog/Epilog an environment of its own making: wrappers point the project's scripts
        # at this test's agent (an operator's node needs none: the scripts find the default socket)
        for script in ("reamer-prolog", "reamer-epilog"):
            wrapper = self.base / script
            socket_env = f"REAMER_SOCKET={self.agent_socket} " if self.agent_socket else ""
            wrapper.write_text(f"#!/bin/sh\n{socket_env}exec {CONTRIB / script}\n")
            wrapper.chmod(0o755)
        node = node_line()
        gres = f" Gres=reamer_spare:{self.gres_count}" if self.gres_count else ""
        self.conf.write_text("\n".join([
            "ClusterName=reamertest",
            f"SlurmctldHost={self.node_name}(127.0.0.1)",  # no name resolution needed
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.base / 'state'}",
            f"SlurmdSpoolDir={self.base / 'spool'}",
            f"SlurmctldPidFile={self.base / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.base / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.base / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.base / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/cgroup",
            "TaskPlugin=task/cgroup,task/affinity",
            "PrologFlags=Alloc,Contain",
            f"Prolog={self.base / 'reamer-prolog'}",
            f"Epilog={self.base / 'reamer-epilog'}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "GresTypes=reamer_spare" if self.gres_count else "",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "KillWait=5",
            f"{node} NodeAddr=127.0.0.1 State=UNKNOWN Feature=reamer{gres}",  # the host name may not resolve
            f"PartitionName=test Nodes={self.node_name} Default=YES MaxTime=10 State=UP",
            "",
        ]))
        # Without systemd as PID 1, slurmd makes its cgroup v2 tree itself; under systemd it asks for
        # slurmstepd.scope over D-Bus, as on a production node.
        ignore_systemd = "IgnoreSystemd=yes\n" if _comm(1) != "systemd" else ""
        self.conf.parent.mkdir(parents=True, exist_ok=True)
        (self.conf.parent / "cgroup.conf").write_text(f"CgroupPlugin=autodetect\nConstrainCores=yes\n{ignore_systemd}")
        if self.gres_count:
            (self.conf.parent / "gres.conf").write_text(f"NodeName={self.node_name} Name=reamer_spare Count={self.gres_count}\n")

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        self.write_config()
        log = open(self.base / "log" / "daemons.out", "ab")
        munged = subprocess.Popen(
            ["munged", "-F", f"--key-file={self.base / 'munge-key' / 'munge.key'}", f"--socket={self.munge_socket}",
             f"--pid-file={self.base / 'munge' / 'munged.pid'}", f"--log-file={self.base / 'munge-key' / 'munged.log'}",
             f"--seed-file={self.base / 'munge-key' / 'munged.seed'}"],
            user="munge", group="munge", stdout=log, stderr=log, start_new_session=True)
        self.procs.append(munged)
        _wait(lambda: self.munge_socket.exists(), timeout, "munged's socket", self)
        for daemon in ("slurmctld", "slurmd"):
            self.procs.append(subprocess.Popen([daemon, "-D", "-f", str(self.conf)], env=self.env, stdout=log,
                                               stderr=log, start_new_session=True))
        _wait(lambda: self.node_state() in ("idle", "mixed", "allocated"), timeout, "the node to be idle", self)
        return self

    def run(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def node_state(self) -> str:
        done = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=15)
        return done.stdout.strip().rstrip("*").lower() if done.returncode == 0 else ""

    def sbatch(self, *args: str) -> int:
        out = self.run("sbatch", "--parsable", *args).stdout.strip()
        return int(out.split(";")[0])

    def job_state(self, job_id: int) -> str:
        done = self.run("scontrol", "show", "job", str(job_id), "-o", check=False, timeout=15)
        for part in done.stdout.split():
            if part.startswith("JobState="):
                return part.split("=", 1)[1]
        return ""

    def job_cpus(self, job_id: int) -> str:
        """The job's allocated CPU ids on this node (`scontrol show job -d`: CPU_IDs=...)."""
        done = self.run("scontrol", "show", "job", "-d", str(job_id), check=False, timeout=15)
        for part in done.stdout.split():
            if part.startswith("CPU_IDs="):
                return part.split("=", 1)[1]
        return ""

    def node_gres(self) -> str:
        done = self.run("scontrol", "show", "node", self.node_name, "-o", timeout=15)
        for part in done.stdout.split():
            if part.startswith("Gres="):
                return part.split("=", 1)[1]
        return ""

    def log_text(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted((self.base / "log").glob("*")) if p.is_file())

    def stop(self) -> None:
        for job in self.run("squeue", "-h", "-o", "%i", check=False, timeout=15).stdout.split():
            self.run("scancel", job, check=False, timeout=15)
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()
        _remove_slurm_cgroups()
        shutil.rmtree(self.base, ignore_errors=True)


def _remove_slurm_cgroups() -> None:
    """slurmd leaves slurm_<node> directories (empty, once its jobs ended) in each hierarchy."""
    for root in Path("/sys/fs/cgroup").glob("*/slurm*"):
        for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [root]:
            if path.is_dir():
                try:
                    path.rmdir()
                except OSError:
                    pass


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid


def _gid(name: str) -> int:
    import grp

    return grp.getgrnam(name).gr_gid


def _wait(condition, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}\n{cluster.log_text()}")
