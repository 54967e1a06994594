"""One NVIDIA MPS control daemon for one GPU: start, health check, commands, stop.

Each GPU gets its own pipe and log directories (CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY)
and the daemon runs with CUDA_VISIBLE_DEVICES=<uuid>, so its server sees exactly that GPU (as device
0 inside MPS: pinned-memory limits for it use device 0). Commands are lines on the control binary's
stdin, as `echo CMD | nvidia-cuda-mps-control` does. Server-level limits (set_active_thread_percentage,
set_device_pinned_mem_limit) and defaults apply only to clients that connect afterwards.

What the real binary does (driver 580.159.04 on an H100, docs/operators.md "verified on real hardware"): it exits 0
when it refuses a command and says why on stdout ("Server 123 not found", 'Unknown command "x"'); it
ignores an out-of-range value without a word (the setters echo the value in force); `quit` with clients
connected does not return until they have exited, and the daemon answers no other command meanwhile.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from reamer.gpu.errors import MpsError, NoGpuDriver
from reamer.host.identity import pid_exists

PID_FILE = "nvidia-cuda-mps-control.pid"
# MPS puts Unix sockets in the pipe directory; sun_path holds 107 bytes, and it adds its own names.
MAX_PIPE_DIR_LEN = 80
# Refusals the control binary prints on stdout with exit status 0.
REFUSAL = re.compile(r"^(Server \d+ not found|Unknown command)", re.MULTILINE)


def find_control_binary(path: str) -> str | None:
    """Absolute path of the control binary (a name is looked up on PATH), or None."""
    if os.sep in path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(path)


def format_mem_limit(mb: int) -> str:
    """MPS memory limit value: whole megabytes ("2048M")."""
    return f"{int(mb)}M"


def pinned_mem_env(limits_mb: dict[int, int]) -> str:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT value, e.g. {0: 2048} -> "0=2048M" (devices as MPS numbers them)."""
    return ",".join(f"{dev}={format_mem_limit(mb)}" for dev, mb in sorted(limits_mb.items()))


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    status: str  # "ACTIVE", "FAULT", ... as get_server_status prints it
    clients: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"pid": self.pid, "status": self.status, "clients": list(self.clients)}


class MpsDaemon:
    """The control daemon serving one GPU."""

    def __init__(self, gpu_uuid: str, pipe_dir: str | os.PathLike, log_dir: str | os.PathLike,
                 control_path: str = "nvidia-cuda-mps-control", timeout_s: float = 10.0) -> None:
        self.gpu_uuid = gpu_uuid
        self.pipe_dir = Path(pipe_dir)
        self.log_dir = Path(log_dir)
        self.control_path = control_path
        self.timeout_s = timeout_s

    # ------------------------------------------------------------------ environment

    def env(self) -> dict[str, str]:
        """What the daemon and every client of this GPU's MPS server need in their environment."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
                "CUDA_VISIBLE_DEVICES": self.gpu_uuid}

    def _binary(self) -> str:
        found = find_control_binary(self.control_path)
        if found is None:
            raise NoGpuDriver(f"nvidia-cuda-mps-control not found (looked for {self.control_path!r})",
                              "install the NVIDIA driver's compute utilities (nvidia-compute-utils) or set "
                              "gpu.mps_control_path to the binary")
        return found

    def _run(self, args: list[str], stdin: str | None) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.update(self.env())
        try:
            return subprocess.run([self._binary(), *args], input=stdin, capture_output=True, text=True,
                                  env=env, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise MpsError(f"MPS control daemon for GPU {self.gpu_uuid} did not answer within "
                           f"{self.timeout_s:g}s ({(stdin or ' '.join(args)).strip()!r})",
                           f"check {self.log_dir}/control.log; restart the daemon (reamer restarts it on the "
                           "next tick if it is gone)") from None

    # ------------------------------------------------------------------ lifecycle

    def pid(self) -> int | None:
        """The running daemon's pid (from its pid file in the pipe directory), or None."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_exists(pid) else None

    def is_running(self) -> bool:
        return self.pid() is not None

    def start(self, default_active_thread_percentage: int | None = None) -> int:
        """Start the daemon (`-d`) unless it already runs; wait until it answers. Returns its pid."""
        if len(str(self.pipe_dir)) > MAX_PIPE_DIR_LEN:
            raise MpsError(f"MPS pipe directory {self.pipe_dir} is {len(str(self.pipe_dir))} characters; MPS "
                           f"creates Unix sockets there and needs it under {MAX_PIPE_DIR_LEN}",
                           "use a shorter agent run directory (run_dir)")
        if not self.is_running():
            self.pipe_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            done = self._run(["-d"], None)
            if done.returncode != 0:
                raise MpsError(f"could not start the MPS control daemon for GPU {self.gpu_uuid}: "
                               f"{(done.stderr or done.stdout).strip() or 'exit ' + str(done.returncode)}",
                               f"see {self.log_dir}/control.log; is another daemon using {self.pipe_dir}?")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                current = self.check_health()
                break
            except MpsError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if default_active_thread_percentage is not None and current != float(default_active_thread_percentage):
            self.set_default_active_thread_percentage(default_active_thread_percentage)
        pid = self.pid()
        if pid is None:
            raise MpsError(f"MPS control daemon for GPU {self.gpu_uuid} answered but wrote no pid file in "
                           f"{self.pipe_dir}", "check that the pipe directory is writable")
        return pid

    def stop(self, timeout_s: float | None = None) -> bool:
        """`quit`, then wait for the daemon to exit. Returns False if it was not running. Refuses while
        its servers have clients: `quit` would block until they exit, and the daemon answers nothing meanwhile."""
        pid = self.pid()
        if pid is None:
            return False
        clients = sorted({c for s in self.servers() for c in s.clients})
        if clients:
            raise MpsError(f"MPS control daemon {pid} for GPU {self.gpu_uuid} still has clients "
                           f"{', '.join(map(str, clients))}: `quit` would wait for them to exit and the daemon "
                           "would answer no command meanwhile", "stop those processes first (`reamer gpu status` "
                           "lists each MPS server's clients), then retry")
        self.command("quit")
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        while self.pid() is not None:
            if time.monotonic() > deadline:
                raise MpsError(f"MPS control daemon {pid} for GPU {self.gpu_uuid} did not exit after quit",
                               "its MPS server may still have clients: stop them, then retry")
            time.sleep(0.05)
        return True

    # ------------------------------------------------------------------ commands

    def command(self, line: str) -> str:
        """Send one command line; returns stdout. Raises MpsError if the daemon refuses or is absent."""
        done = self._run([], line.strip() + "\n")
        if done.returncode != 0 or REFUSAL.search(done.stdout):
            raise MpsError(f"MPS command {line.strip()!r} failed for GPU {self.gpu_uuid}: "
                           f"{(done.stderr or done.stdout).strip() or 'exit ' + str(done.returncode)}",
                           "check that the daemon runs (reamer gpu status) and the arguments are valid")
        return done.stdout

    def check_health(self) -> float:
        """Health check as NVIDIA's device plugin does it: get_default_active_thread_percentage."""
        out = self.command("get_default_active_thread_percentage").strip()
        try:
            return float(out.split()[-1])
        except (ValueError, IndexError):
            raise MpsError(f"unexpected answer from MPS control daemon for GPU {self.gpu_uuid}: {out!r}",
                           "check the daemon's version and control.log") from None

    def healthy(self) -> bool:
        try:
            self.check_health()
            return True
        except MpsError:
            return False

    def get_default_active_thread_percentage(self) -> float:
        return self.check_health()

    def _set_percentage(self, line: str, pct: int) -> None:
        out = self.command(line).strip()
        try:
            now = float(out.split()[-1])
        except (ValueError, IndexError):
            now = None
        if now != float(pct):
            raise MpsError(f"MPS command {line!r} was not applied for GPU {self.gpu_uuid}: the daemon answered {out!r}",
                           "use a whole percentage from 1 to 100")

    def set_default_active_thread_percentage(self, pct: int) -> None:
        self._set_percentage(f"set_default_active_thread_percentage {int(pct)}", pct)

    def set_default_device_pinned_mem_limit(self, device: int, mb: int) -> None:
        self.command(f"set_default_device_pinned_mem_limit {int(device)} {format_mem_limit(mb)}")

    def set_active_thread_percentage(self, server_pid: int, pct: int) -> None:
        self._set_percentage(f"set_active_thread_percentage {int(server_pid)} {int(pct)}", pct)

    def set_device_pinned_mem_limit(self, server_pid: int, device: int, mb: int) -> None:
        self.command(f"set_device_pinned_mem_limit {int(server_pid)} {int(device)} {format_mem_limit(mb)}")

    def server_pids(self) -> list[int]:
        return [int(w) for w in self.command("get_server_list").split() if w.isdigit()]

    def client_pids(self, server_pid: int) -> list[int]:
        return [int(w) for w in self.command(f"get_client_list {int(server_pid)}").split() if w.isdigit()]

    def server_status(self, server_pid: int) -> str:
        return self.command(f"get_server_status {int(server_pid)}").strip() or "UNKNOWN"

    def servers(self) -> list[ServerInfo]:
        """Every server of this daemon with its status and clients (a server that vanished mid-way is skipped)."""
        out = []
        for spid in self.server_pids():
            try:
                out.append(ServerInfo(spid, self.server_status(spid), tuple(self.client_pids(spid))))
            except MpsError:
                continue
        return out

    def terminate_client(self, server_pid: int, client_pid: int) -> None:
        """Ask the server to end the client's GPU work (its CUDA calls then fail with
        cudaErrorMpsClientTerminated); the process itself runs on and stays listed until it exits. The
        daemon answers "0" when done. Send it once per client: a second one blocks the daemon until the
        client exits."""
        line = f"terminate_client {int(server_pid)} {int(client_pid)}"
        out = self.command(line).strip()
        if out.split()[-1:] != ["0"]:
            raise MpsError(f"MPS command {line!r} failed for GPU {self.gpu_uuid}: {out or 'no answer'}",
                           f"check that {client_pid} is a client of MPS server {server_pid} (reamer gpu status)")

    def log_tail(self, lines: int = 20) -> list[str]:
        try:
            return (self.log_dir / "control.log").read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []
