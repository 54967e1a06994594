"""What a process may do (run by test_sandbox.py directly and under reamer.service's sandboxing options):
open a perf event, make a thread SCHED_RR, create a cgroup below its own, read a model under /home,
write under /tmp and /home. Prints one JSON object; each value is "ok" or the error."""
import ctypes
import json
import os
import struct
import sys
from pathlib import Path

SYS_PERF_EVENT_OPEN = 298  # x86_64
PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK = 1, 0
libc = ctypes.CDLL(None, use_errno=True)


def perf_software() -> str:
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("IIQ", attr, 0, PERF_TYPE_SOFTWARE, 128, PERF_COUNT_SW_CPU_CLOCK)
    struct.pack_into("Q", attr, 40, 1 | (1 << 5) | (1 << 6))  # disabled, exclude_kernel, exclude_hv
    fd = libc.syscall(SYS_PERF_EVENT_OPEN, attr, 0, -1, -1, 0)
    if fd < 0:
        return os.strerror(ctypes.get_errno())
    os.close(fd)
    return "ok"


def perf_hardware() -> str:
    from reamer.host.perf import probe_perf
    support = probe_perf()
    return "ok" if support.supported else f"unsupported: {support.reason}"


def sched_rr() -> str:
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        return "ok"
    except OSError as exc:
        return exc.strerror


def cgroup_below_own() -> str:
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        own = Path(open("/proc/self/cgroup").read().split("::", 1)[1].strip()).relative_to("/")
        target = root / own / f"lab-probe-{os.getpid()}"
    else:
        target = root / "cpuset" / f"lab-probe-{os.getpid()}"
    try:
        target.mkdir()
        target.rmdir()
        return "ok"
    except OSError as exc:
        return f"{target}: {exc.strerror}"


def read_file(path: str) -> str:
    try:
        Path(path).read_bytes()
        return "ok"
    except OSError as exc:
        return exc.strerror


def write_dir(path: str) -> str:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / f"probe-{os.getpid()}").write_text("x")
        (Path(path) / f"probe-{os.getpid()}").unlink()
        return "ok"
    except OSError as exc:
        return exc.strerror


model, tmp_dir, home_dir = sys.argv[1:4]
print(json.dumps({"perf_software": perf_software(), "perf_hardware": perf_hardware(), "sched_rr": sched_rr(),
                  "cgroup": cgroup_below_own(), "model": read_file(model), "write_tmp": write_dir(tmp_dir),
                  "write_home": write_dir(home_dir)}))
