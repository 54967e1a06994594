"""Hardware performance counters (instructions, cycles, cache references/misses) per process,
through the perf_event_open syscall via ctypes."""
from __future__ import annotations

import ctypes
import errno as errno_codes
import functools
import os
import platform
import time
from dataclasses import dataclass

from reamer.host.errors import HostError
from reamer.host.sched import ThreadGone, threads_of

PERF_TYPE_HARDWARE = 0
PERF_COUNT_HW_CPU_CYCLES = 0
PERF_COUNT_HW_INSTRUCTIONS = 1
PERF_COUNT_HW_CACHE_REFERENCES = 2
PERF_COUNT_HW_CACHE_MISSES = 3
PERF_FORMAT_TOTAL_TIME_ENABLED = 1 << 0
PERF_FORMAT_TOTAL_TIME_RUNNING = 1 << 1
_FLAG_EXCLUDE_KERNEL = 1 << 5
_FLAG_EXCLUDE_HV = 1 << 6

_SYSCALL_NUMBERS = {"x86_64": 298, "aarch64": 241, "arm64": 241}
COUNTERS = {
    "instructions": PERF_COUNT_HW_INSTRUCTIONS,
    "cycles": PERF_COUNT_HW_CPU_CYCLES,
    "cache_references": PERF_COUNT_HW_CACHE_REFERENCES,
    "cache_misses": PERF_COUNT_HW_CACHE_MISSES,
}


class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to PERF_ATTR_SIZE_VER5 (112 bytes); `flags` holds the bitfield word."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),
    ]


@dataclass(frozen=True)
class PerfSupport:
    supported: bool
    errno: int | None
    reason: str


@dataclass(frozen=True)
class CounterSample:
    ipc: float
    cache_miss_rate: float
    instructions: int
    cycles: int
    scaled: bool  # True when the kernel multiplexed a counter and the count was extrapolated


class PerfUnsupported(HostError):
    def __init__(self, errno: int | None, reason: str) -> None:
        super().__init__(
            f"hardware performance counters are unavailable: {reason}",
            "run on bare metal or a VM with a virtual PMU, and allow counters (sysctl kernel.perf_event_paranoid=1 "
            "or run as root); reamer falls back to measured throughput scaling",
        )
        self.errno = errno
        self.reason = reason


def _reason(code: int) -> str:
    name = errno_codes.errorcode.get(code, str(code))
    if code in (errno_codes.ENOENT, errno_codes.EOPNOTSUPP, errno_codes.ENODEV):
        return f"the CPU or hypervisor exposes no hardware counters ({name})"
    if code in (errno_codes.EACCES, errno_codes.EPERM):
        return f"not permitted by kernel.perf_event_paranoid or missing CAP_PERFMON ({name})"
    if code == errno_codes.ENOSYS:
        return "the kernel has no perf_event_open (ENOSYS)"
    return f"perf_event_open failed: {os.strerror(code)} ({name})"


def _syscall_number() -> int:
    number = _SYSCALL_NUMBERS.get(platform.machine())
    if number is None:
        raise PerfUnsupported(None, f"perf_event_open syscall number unknown for {platform.machine()}")
    return number


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _open_counter(config: int, tid: int) -> int:
    """Open one enabled user-space hardware counter on thread `tid`; raise OSError(errno) on failure."""
    attr = PerfEventAttr()
    attr.type = PERF_TYPE_HARDWARE
    attr.size = ctypes.sizeof(PerfEventAttr)
    attr.config = config
    attr.read_format = PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING
    attr.flags = _FLAG_EXCLUDE_KERNEL | _FLAG_EXCLUDE_HV
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(
        ctypes.c_long(_syscall_number()), ctypes.byref(attr), ctypes.c_int(tid), ctypes.c_int(-1),
        ctypes.c_int(-1), ctypes.c_ulong(0),
    )
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(fd)


def _read_counter(fd: int) -> tuple[int, int, int]:
    data = os.read(fd, 24)
    values = (ctypes.c_uint64 * 3).from_buffer_copy(data.ljust(24, b"\0"))
    return int(values[0]), int(values[1]), int(values[2])


@functools.lru_cache(maxsize=1)
def probe_perf() -> PerfSupport:
    """Can this process count instructions? Cached; call probe_perf.cache_clear() to probe again."""
    try:
        fd = _open_counter(PERF_COUNT_HW_INSTRUCTIONS, 0)
    except PerfUnsupported as error:
        return PerfSupport(False, error.errno, error.reason)
    except OSError as error:
        return PerfSupport(False, error.errno, _reason(error.errno))
    os.close(fd)
    return PerfSupport(True, None, "hardware counters available")


def scale_count(value: int, time_enabled: int, time_running: int) -> tuple[int, bool]:
    """Extrapolate a multiplexed count to the whole enabled time: (count, scaled?).
    A counter that never ran (running 0) counted nothing we can extrapolate from: (0, True)."""
    if time_running <= 0:
        return 0, time_enabled > 0
    if time_running >= time_enabled:
        return value, False
    return round(value * time_enabled / time_running), True


def sample_from_readings(readings: dict[str, list[tuple[int, int, int]]]) -> CounterSample:
    """Combine raw (value, enabled, running) readings per counter name (one per thread) into a sample."""
    totals: dict[str, int] = {}
    scaled_any = False
    for name in COUNTERS:
        total = 0
        for value, enabled, running in readings.get(name, []):
            count, scaled = scale_count(value, enabled, running)
            total += count
            scaled_any |= scaled
        totals[name] = total
    cycles, instructions = totals["cycles"], totals["instructions"]
    references = totals["cache_references"]
    return CounterSample(
        ipc=instructions / cycles if cycles else 0.0,
        cache_miss_rate=totals["cache_misses"] / references if references else 0.0,
        instructions=instructions,
        cycles=cycles,
        scaled=scaled_any,
    )


def measure_counters(pid: int, window_s: float) -> CounterSample:
    """Count user-space instructions, cycles and cache references/misses of every thread of `pid`
    over `window_s` seconds. Raises PerfUnsupported where the host has no usable counters."""
    support = probe_perf()
    if not support.supported:
        raise PerfUnsupported(support.errno, support.reason)
    fds: list[tuple[str, int]] = []
    try:
        for tid in threads_of(pid):
            for name, config in COUNTERS.items():
                try:
                    fds.append((name, _open_counter(config, tid)))
                except OSError as error:
                    if error.errno == errno_codes.ESRCH:
                        break  # this thread exited; the others still count
                    if error.errno == errno_codes.EMFILE:
                        raise HostError(
                            f"process {pid} has too many threads to count them all ({len(fds)} counters open)",
                            "raise the open-file limit (ulimit -n / LimitNOFILE=) of reamer",
                        ) from None
                    raise PerfUnsupported(error.errno, _reason(error.errno)) from None
        if not fds:
            raise ThreadGone(pid)
        time.sleep(window_s)
        readings: dict[str, list[tuple[int, int, int]]] = {}
        for name, fd in fds:
            readings.setdefault(name, []).append(_read_counter(fd))
        return sample_from_readings(readings)
    finally:
        for _, fd in fds:
            os.close(fd)
