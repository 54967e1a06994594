"""What this host can do, as a list of checks for `reamer doctor`. Never raises: a check that cannot
run reports itself failed with the reason."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from reamer.host.cgroups import CgroupV1Driver, CgroupV2Driver, detect_driver
from reamer.host.errors import ReamerError
from reamer.host.perf import probe_perf
from reamer.host.sched import rt_throttling
from reamer.host.topology import read_topology


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True  # False: reamer works without it, with less (perf counters, GPUs)


def _check_root() -> Check:
    if os.geteuid() == 0:
        return Check("root", True, "running as root")
    return Check("root", False, f"running as uid {os.geteuid()}: cgroups and SCHED_RR need root",
                 "run the reamer daemon as root (the systemd unit does)")


def _check_cgroups(cgroup_root: str, proc_root: str) -> Check:
    driver = detect_driver(cgroup_root, proc_root)
    if isinstance(driver, CgroupV1Driver):
        wanted = ("cpu", "cpuset", "freezer")
        missing = [c for c in wanted if not (Path(cgroup_root) / c).is_dir()]
        if missing:
            return Check("cgroups", False, f"cgroup v1, controllers missing: {', '.join(missing)}",
                         f"mount the v1 controllers {', '.join(missing)} under {cgroup_root}")
        return Check("cgroups", True, f"cgroup v1 with {', '.join(wanted)}")
    assert isinstance(driver, CgroupV2Driver)
    available = driver.controllers("")
    missing = [c for c in ("cpu", "cpuset") if c not in available]
    if missing:
        return Check("cgroups", False, f"cgroup v2, controllers missing: {', '.join(missing)}",
                     "enable the cpu and cpuset controllers (they may be held by a v1 hierarchy)")
    return Check("cgroups", True, f"cgroup v2 with {', '.join(available)}")


def _check_rt_throttling(proc_root: str) -> Check:
    runtime, period = rt_throttling(proc_root)
    if runtime < 0:
        return Check("rt-throttling", False, "RT throttling is disabled (sched_rt_runtime_us = -1): a runaway "
                     "real-time thread can lock up a CPU", "echo 950000 > /proc/sys/kernel/sched_rt_runtime_us")
    return Check("rt-throttling", True, f"real-time threads may use {runtime} of every {period} us")


def _check_rt_group_sched(cgroup_root: str, proc_root: str) -> Check:
    driver = detect_driver(cgroup_root, proc_root)
    if driver.rt_group_sched:
        root_budget = driver.get_rt_runtime("")
        return Check("rt-group-sched", True, f"RT group scheduling on: reamer gives training cgroups a "
                     f"cpu.rt_runtime_us budget (root budget {root_budget} us)")
    if driver.version == 2:
        # v2 has no cpu.rt_runtime_us to look at: what matters is how the kernel was built.
        built_in = kernel_config_option("CONFIG_RT_GROUP_SCHED", proc_root)
        if built_in is None:
            return Check("rt-group-sched", True, "cgroup v2: no per-cgroup RT budget; cannot tell whether the kernel has "
                         "RT group scheduling (no /proc/config.gz or /boot/config-<release>); with it, SCHED_RR "
                         "threads must stay in the root cpu cgroup")
        if built_in:
            return Check("rt-group-sched", True, "cgroup v2 on a kernel with RT group scheduling (CONFIG_RT_GROUP_SCHED=y): "
                         "no per-cgroup RT budget, SCHED_RR threads must stay in the root cpu cgroup")
        return Check("rt-group-sched", True, "cgroup v2, no RT group scheduling (CONFIG_RT_GROUP_SCHED is not set): "
                     "SCHED_RR works in any cgroup")
    return Check("rt-group-sched", True, "no RT group scheduling: SCHED_RR works in any cgroup")


def kernel_config_option(option: str, proc_root: str = "/proc") -> bool | None:
    """Whether the running kernel was built with `option` (=y or =m), from /proc/config.gz or
    /boot/config-<release>; None when neither is there."""
    import gzip

    sources = [(Path(proc_root, "config.gz"), gzip.open), (Path(f"/boot/config-{os.uname().release}"), open)]
    for path, opener in sources:
        try:
            with opener(path, "rt") as config:
                return any(line.startswith(f"{option}=") and line.strip().split("=", 1)[1] in ("y", "m")
                           for line in config)
        except OSError:
            continue
    return None


def _check_perf() -> Check:
    support = probe_perf()
    if support.supported:
        return Check("perf-counters", True, support.reason, required=False)
    return Check("perf-counters", False, f"{support.reason}: model characterisation falls back to throughput "
                 "scaling", "run on bare metal or a VM with a virtual PMU; lower kernel.perf_event_paranoid",
                 required=False)


def _check_module(name: str, distribution: str) -> Callable[[], Check]:
    def check() -> Check:
        if importlib.util.find_spec(name) is None:
            return Check(name, False, f"{name} is not installed", f"pip install {distribution}")
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown version"
        return Check(name, True, f"{name} {version}")

    return check


def _check_topology(sys_root: str) -> Check:
    topology = read_topology(sys_root)
    cores = topology.physical_cores()
    return Check("topology", True, f"{len(topology.cpus)} CPUs, {len(cores)} physical cores, "
                 f"{len(topology.numa_nodes())} NUMA node(s), {len(topology.l3_groups())} L3 group(s): "
                 f"{topology.model_name}")


def _check_nvidia(proc_root: str) -> Check:
    version_file = Path(proc_root, "driver/nvidia/version")
    if version_file.exists():
        lines = version_file.read_text().splitlines()
        return Check("nvidia-driver", True, lines[0].strip() if lines else "present", required=False)
    if shutil.which("nvidia-smi"):
        return Check("nvidia-driver", True, "nvidia-smi found", required=False)
    return Check("nvidia-driver", False, "no NVIDIA driver: GPU sharing (MPS) is off, CPU inference still works",
                 "install the NVIDIA driver if this node has GPUs", required=False)


def run_checks(cgroup_root: str = "/sys/fs/cgroup", proc_root: str = "/proc", sys_root: str = "/sys") -> list[Check]:
    checks: list[tuple[str, Callable[[], Check], bool]] = [
        ("root", _check_root, True),
        ("cgroups", lambda: _check_cgroups(cgroup_root, proc_root), True),
        ("rt-throttling", lambda: _check_rt_throttling(proc_root), True),
        ("rt-group-sched", lambda: _check_rt_group_sched(cgroup_root, proc_root), True),
        ("topology", lambda: _check_topology(sys_root), True),
        ("perf-counters", _check_perf, False),
        ("onnxruntime", _check_module("onnxruntime", "onnxruntime"), True),
        ("openvino", _check_module("openvino", "openvino"), True),
        ("nvidia-driver", lambda: _check_nvidia(proc_root), False),
    ]
    results: list[Check] = []
    for name, check, required in checks:
        try:
            results.append(check())
        except ReamerError as error:
            results.append(Check(name, False, error.message, error.fix, required))
        except Exception as error:  # doctor must report, never crash
            results.append(Check(name, False, f"check failed: {type(error).__name__}: {error}", "", required))
    return results
