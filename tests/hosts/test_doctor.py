"""`reamer doctor` tells the truth on each profile: every claim is checked against the kernel itself."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from reamer.host.topology import read_topology
from tests.hosts.helpers import PROFILE, jsonout, sh


@pytest.fixture(scope="module")
def checks(service) -> dict[str, dict]:
    report = jsonout(["reamer", "-o", "json", "doctor"], timeout=600)
    assert report["ok"] is True, report
    return {c["name"]: c for c in report["checks"]}


def kernel_config(option: str) -> str | None:
    """`y`/`m`, or None when the kernel was built without it (from Debian's /boot/config-<release>)."""
    config = Path(f"/boot/config-{os.uname().release}").read_text()
    for line in config.splitlines():
        if line.startswith(f"{option}="):
            return line.split("=", 1)[1]
    return None


def test_cgroup_version_and_controllers(checks):
    fs = sh(["stat", "-fc", "%T", "/sys/fs/cgroup"]).strip()
    detail = checks["cgroups"]["detail"]
    assert checks["cgroups"]["ok"]
    if PROFILE.cgroup_v2:
        assert fs == "cgroup2fs"
        assert detail.startswith("cgroup v2"), detail
        for controller in Path("/sys/fs/cgroup/cgroup.controllers").read_text().split():
            assert controller in detail, (controller, detail)
    else:
        assert fs == "tmpfs" and Path("/sys/fs/cgroup/unified").is_dir()  # systemd's hybrid layout
        assert detail.startswith("cgroup v1"), detail


def test_rt_throttling_numbers(checks):
    runtime = Path("/proc/sys/kernel/sched_rt_runtime_us").read_text().strip()
    period = Path("/proc/sys/kernel/sched_rt_period_us").read_text().strip()
    assert checks["rt-throttling"]["ok"]
    assert f"{runtime} of every {period} us" in checks["rt-throttling"]["detail"]


def test_rt_group_scheduling_as_the_kernel_was_built(checks):
    built_in = kernel_config("CONFIG_RT_GROUP_SCHED") == "y"
    assert not built_in, "Debian's kernel is expected without RT group scheduling"
    detail = checks["rt-group-sched"]["detail"]
    assert checks["rt-group-sched"]["ok"]
    assert "no RT group scheduling" in detail, detail
    assert not Path("/sys/fs/cgroup/cpu/cpu.rt_runtime_us").exists()


def test_topology_line(checks):
    topology = read_topology()
    detail = checks["topology"]["detail"]
    assert detail.startswith(f"{PROFILE.cpus} CPUs, {PROFILE.sockets * PROFILE.cores} physical cores, "
                             f"{PROFILE.numa_nodes} NUMA node(s), {len(topology.l3_groups())} L3 group(s)"), detail


def test_perf_counters_as_the_pmu_is(checks):
    dmesg = sh(["dmesg"])
    has_pmu = Path("/sys/bus/event_source/devices/cpu").exists() and "no PMU driver" not in dmesg
    assert checks["perf-counters"]["ok"] is has_pmu, (checks["perf-counters"], has_pmu)
    assert checks["perf-counters"]["required"] is False


def test_no_gpu_said_plainly(checks):
    assert not Path("/proc/driver/nvidia/version").exists()
    assert checks["nvidia-driver"]["ok"] is False and checks["nvidia-driver"]["required"] is False
    assert "no NVIDIA driver" in checks["nvidia-driver"]["detail"]
    assert checks["root"]["ok"] and checks["onnxruntime"]["ok"] and checks["openvino"]["ok"]
