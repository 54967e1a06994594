from __future__ import annotations

import ctypes
import errno
import os

import pytest

from reamer.host import perf
from reamer.host.errors import HostError
from reamer.host.perf import (
    CounterSample, PerfSupport, PerfUnsupported, measure_counters, probe_perf, sample_from_readings, scale_count,
)


def test_attr_struct_matches_the_kernel_abi() -> None:
    assert ctypes.sizeof(perf.PerfEventAttr) == 112  # PERF_ATTR_SIZE_VER5
    assert perf.PerfEventAttr.read_format.offset == 32
    assert perf.PerfEventAttr.flags.offset == 40  # the disabled, inherit, ..., exclude_* bitfield word


def test_scale_count() -> None:
    assert scale_count(1000, 10, 10) == (1000, False)
    assert scale_count(1000, 10, 5) == (2000, True)  # counted half the time: extrapolate
    assert scale_count(999, 3, 1) == (2997, True)
    assert scale_count(0, 0, 0) == (0, False)
    assert scale_count(50, 10, 0) == (0, True)  # never scheduled: nothing to extrapolate from


def test_sample_from_readings_sums_threads_and_scales() -> None:
    sample = sample_from_readings({
        "instructions": [(3000, 100, 100), (1000, 100, 50)],  # 3000 + 2000
        "cycles": [(2000, 100, 100), (500, 100, 100)],
        "cache_references": [(400, 100, 100)],
        "cache_misses": [(20, 100, 50)],  # -> 40
    })
    assert sample == CounterSample(ipc=2.0, cache_miss_rate=0.1, instructions=5000, cycles=2500, scaled=True)


def test_sample_without_cycles_is_zero_not_a_crash() -> None:
    sample = sample_from_readings({"instructions": [(10, 1, 1)]})
    assert sample.ipc == 0.0 and sample.cache_miss_rate == 0.0 and not sample.scaled


def test_probe_is_cached() -> None:
    probe_perf.cache_clear()
    first = probe_perf()
    assert probe_perf() is first
    assert probe_perf.cache_info().hits >= 1


def test_unsupported_error_carries_errno_and_fix() -> None:
    error = PerfUnsupported(errno.ENOENT, perf._reason(errno.ENOENT))
    assert isinstance(error, HostError)
    assert error.errno == errno.ENOENT
    assert "no hardware counters" in error.message and "ENOENT" in error.message
    assert "throughput scaling" in error.fix
    assert "perf_event_paranoid" in perf._reason(errno.EACCES)


def test_this_machine() -> None:
    """This VM has no PMU: the probe says so with the errno; on hosts with counters, counters count."""
    probe_perf.cache_clear()
    support = probe_perf()
    assert isinstance(support, PerfSupport)
    if not support.supported:
        assert support.errno in (errno.ENOENT, errno.EOPNOTSUPP, errno.ENODEV, errno.EACCES, errno.EPERM)
        assert support.reason
        with pytest.raises(PerfUnsupported) as caught:
            measure_counters(os.getpid(), 0.05)
        assert caught.value.errno == support.errno
    else:
        sample = measure_counters(os.getpid(), 0.2)
        assert sample.cycles > 0 and sample.instructions > 0 and sample.ipc > 0
