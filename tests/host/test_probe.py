from __future__ import annotations

import os
from pathlib import Path

import pytest

from reamer.host import probe
from reamer.host.probe import Check, run_checks

NAMES = ["root", "cgroups", "rt-throttling", "rt-group-sched", "topology", "perf-counters", "onnxruntime",
         "openvino", "nvidia-driver"]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def test_real_host() -> None:
    checks = run_checks()
    assert [check.name for check in checks] == NAMES
    found = by_name(checks)
    assert found["root"].ok == (os.geteuid() == 0)
    assert found["topology"].ok and f"{os.cpu_count()} CPUs" in found["topology"].detail
    runtime = int(Path("/proc/sys/kernel/sched_rt_runtime_us").read_text())
    assert found["rt-throttling"].ok == (runtime >= 0)
    if Path("/sys/fs/cgroup/cpu/cpu.rt_runtime_us").exists():
        assert found["cgroups"].ok and "cgroup v1" in found["cgroups"].detail
        assert "cpu.rt_runtime_us" in found["rt-group-sched"].detail
    perf = found["perf-counters"]
    assert perf.required is False
    if not perf.ok:
        assert perf.fix and "throughput scaling" in perf.detail
    for check in checks:
        assert check.ok or check.fix or not check.required, check


def test_missing_everything_does_not_crash(tmp_path: Path) -> None:
    found = by_name(run_checks(cgroup_root=str(tmp_path), proc_root=str(tmp_path), sys_root=str(tmp_path)))
    assert list(found) == NAMES
    for name in ("cgroups", "rt-throttling", "rt-group-sched", "topology", "nvidia-driver"):
        assert not found[name].ok, found[name]
        assert found[name].fix, found[name]
    assert "no cgroup hierarchy" in found["cgroups"].detail


def test_rt_throttling_disabled_is_flagged(tmp_path: Path) -> None:
    kernel = tmp_path / "sys/kernel"
    kernel.mkdir(parents=True)
    (kernel / "sched_rt_runtime_us").write_text("-1\n")
    (kernel / "sched_rt_period_us").write_text("1000000\n")
    check = by_name(run_checks(proc_root=str(tmp_path)))["rt-throttling"]
    assert not check.ok and "950000" in check.fix


def test_nvidia_driver_found(tmp_path: Path) -> None:
    (tmp_path / "driver/nvidia").mkdir(parents=True)
    (tmp_path / "driver/nvidia/version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n")
    check = by_name(run_checks(proc_root=str(tmp_path)))["nvidia-driver"]
    assert check.ok and "550.54.15" in check.detail


def test_a_crashing_check_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(sys_root):
        raise RuntimeError("sysfs exploded")

    monkeypatch.setattr(probe, "read_topology", boom)
    check = by_name(run_checks())["topology"]
    assert not check.ok and "RuntimeError: sysfs exploded" in check.detail


def test_missing_python_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = probe.importlib.util.find_spec
    monkeypatch.setattr(probe.importlib.util, "find_spec",
                        lambda name: None if name == "openvino" else real_find_spec(name))
    check = by_name(run_checks())["openvino"]
    assert not check.ok and check.fix == "pip install openvino"
