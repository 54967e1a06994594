"""Boot one profile's VM, wait for its job, stream its progress, and never leave it running.

QEMU runs in a session (process group) of its own with PR_SET_PDEATHSIG, so it dies with this driver
even when the driver is killed with SIGKILL; every other way out (timeout, Ctrl-C, SIGTERM, an error)
kills the whole group in a `finally`."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lab.image import Image
from lab.profiles import Profile

BOOT_TIMEOUT_S = float(os.environ.get("REAMER_LAB_BOOT_TIMEOUT", 300))  # qemu start -> job running
BOOT_ATTEMPTS = 2  # the only retry in the lab: a boot that never reaches the job
PR_SET_PDEATHSIG = 1


@dataclass
class VmRun:
    profile: str
    out_dir: Path
    booted: bool = False
    boot_s: float | None = None  # qemu start -> job started
    wall_s: float = 0.0
    timed_out: bool = False
    qemu_rc: int | None = None
    attempts: int = 0
    error: str = ""


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def qemu_command(image: Image, profile: Profile, out_dir: Path, shares: dict[str, Path],
                 console_log: Path) -> list[str]:
    # mitigations=off: emulated speculation barriers only cost time here; apparmor=0: docker needs either
    # the apparmor userspace or this.
    cmdline = ["console=ttyS0", "root=/dev/vda", "rw", "panic=-1", "apparmor=0", "mitigations=off",
               *profile.kernel_cmdline(), f"reamer_lab.profile={profile.name}"]
    cmdline += [f"reamer_lab.{tag}={path}" for tag, path in shares.items()]
    cmd = ["qemu-system-x86_64", "-nodefaults", "-machine", "q35", "-accel", "tcg,thread=multi",
           "-cpu", "max,vendor=GenuineIntel",  # the default AMD vendor string hides SMT from the guest
           *profile.qemu_topology_args(),
           "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", " ".join(cmdline),
           # snapshot=on: the cached image is never written; the VM's changes go to a temporary file.
           "-drive", f"file={image.rootfs},if=virtio,format=raw,snapshot=on",
           "-virtfs", f"local,path={out_dir},mount_tag=labout,security_model=passthrough,id=labout"]
    for tag, path in shares.items():
        cmd += ["-virtfs", f"local,path={path},mount_tag={tag},security_model=passthrough,readonly=on,id={tag}"]
    cmd += ["-nic", "none", "-display", "none", "-no-reboot", "-serial", f"file:{console_log}", "-monitor", "none"]
    return cmd


class _Tail:
    """Prints new lines of a file as they appear, prefixed with the profile name."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path, self.prefix, self.offset, self.partial = path, prefix, 0, ""

    def poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        *lines, self.partial = text.split("\n")
        for line in lines:
            print(f"[{self.prefix}] {line}", flush=True)


def run_profile(image: Image, profile: Profile, out_dir: Path, shares: dict[str, Path], run_timeout_s: float,
                job_args: list[str], job_env: dict[str, str]) -> VmRun:
    run = VmRun(profile.name, out_dir)
    start = time.monotonic()
    for attempt in range(1, BOOT_ATTEMPTS + 1):
        run.attempts = attempt
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "pytest-args").write_text("".join(f"{arg}\n" for arg in job_args))
        (out_dir / "lab.env").write_text("".join(f"{key}={value}\n" for key, value in job_env.items()))
        remaining = run_timeout_s - (time.monotonic() - start)
        (out_dir / "deadline-s").write_text(f"{int(remaining)}\n")
        _boot_once(image, profile, out_dir, shares, remaining, run)
        if run.booted or run.timed_out:
            break
        print(f"[{profile.name}] the VM did not reach its job (attempt {attempt}/{BOOT_ATTEMPTS}): {run.error}",
              flush=True)
    run.wall_s = time.monotonic() - start
    return run


def _boot_once(image: Image, profile: Profile, out_dir: Path, shares: dict[str, Path], timeout_s: float,
               run: VmRun) -> None:
    console = out_dir / "console.log"
    cmd = qemu_command(image, profile, out_dir, shares, console)
    (out_dir / "qemu-command").write_text(" ".join(cmd) + "\n")
    t0 = time.monotonic()
    stderr = (out_dir / "qemu-stderr.log").open("w")
    qemu = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, start_new_session=True,
                            preexec_fn=_die_with_parent)
    tail = _Tail(out_dir / "pytest.log", profile.name)
    run.booted, run.error = False, ""
    try:
        while True:
            rc = qemu.poll()
            if not run.booted and (out_dir / "started").exists():
                run.booted, run.boot_s = True, time.monotonic() - t0
                print(f"[{profile.name}] booted in {run.boot_s:.0f} s; running tests/hosts inside", flush=True)
            tail.poll()
            if rc is not None:
                run.qemu_rc = rc
                if not run.booted:
                    run.error = f"qemu exited with {rc} before the job started (see {console})"
                break
            elapsed = time.monotonic() - t0
            if not run.booted and elapsed > BOOT_TIMEOUT_S:
                run.error = f"no job start within {BOOT_TIMEOUT_S:.0f} s of boot (see {console})"
                break
            if elapsed > timeout_s:
                run.timed_out = True
                run.error = f"the VM ran past the profile's limit of {timeout_s:.0f} s and was killed"
                break
            time.sleep(0.5)
    finally:
        _kill_group(qemu)
        stderr.close()
        tail.poll()


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not get ignored
        print(f"warning: qemu pid {proc.pid} did not exit after SIGKILL", file=sys.stderr)
