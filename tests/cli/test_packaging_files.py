"""configs/reamer.yaml and systemd/reamer.service: the files an operator installs."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from reamer.agent.config import AgentConfig, load_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "reamer.yaml"
UNIT = REPO / "systemd" / "reamer.service"


def test_example_config_loads_and_equals_the_defaults():
    config = load_config(CONFIG)
    assert config == AgentConfig(gpu=config.gpu)  # the file shows the default of every key
    assert config.gpu  # the gpu section is spelled out, and validated by GpuConfig


def test_example_config_has_every_field_commented():
    text = CONFIG.read_text()
    data = yaml.safe_load(text)
    lines = text.splitlines()

    def documented(key: str, indent: int) -> bool:
        pattern = re.compile(rf"^{' ' * indent}{re.escape(key)}:")
        for i, line in enumerate(lines):
            if pattern.match(line):
                # a comment line right above it, or a trailing comment, or it shares a comment block
                # with the key(s) right above it (e.g. a pair like restart_limit/restart_window_s)
                j = i - 1
                while j >= 0 and pattern.match(lines[j]) is None and re.match(rf"^{' ' * indent}\w+:", lines[j]):
                    j -= 1
                return "#" in line or (j >= 0 and lines[j].lstrip().startswith("#"))
        return False

    for name in AgentConfig.model_fields:
        assert name in data, f"top-level key {name} missing from {CONFIG}"
        assert documented(name, 0), f"top-level key {name} has no comment in {CONFIG}"
    for section in ("training", "inference"):
        model = AgentConfig.model_fields[section].annotation
        for name in model.model_fields:
            assert name in data[section], f"{section}.{name} missing from {CONFIG}"
            assert documented(name, 2), f"{section}.{name} has no comment in {CONFIG}"


def test_example_config_spells_out_every_gpu_key():
    from reamer.gpu.config import GpuConfig

    data = yaml.safe_load(CONFIG.read_text())["gpu"]

    def walk(model, section: dict, where: str) -> None:
        for name, info in model.model_fields.items():
            assert name in section, f"{where}{name} missing from {CONFIG}"
            sub = info.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                walk(sub, section[name], f"{where}{name}.")

    walk(GpuConfig, data, "gpu.")
    assert GpuConfig.from_dict(data) == GpuConfig()


def test_unit_has_the_settings_the_agent_relies_on():
    text = UNIT.read_text()
    settings = dict(
        (line.split("=", 1)[0], line.split("=", 1)[1]) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    assert settings["Type"] == "notify"
    assert int(settings["WatchdogSec"]) > 0
    assert settings["ExecStart"] == "/usr/local/bin/reamer daemon --config /etc/reamer/reamer.yaml"
    assert settings["KillMode"] == "process"  # job processes survive an agent restart
    assert settings["Delegate"] == "yes"
    assert settings["Restart"] == "on-failure"
    assert settings["RuntimeDirectory"] == "reamer" and settings["StateDirectory"] == "reamer"
    assert settings["RuntimeDirectoryPreserve"] == "yes"  # job run dirs under /run/reamer survive a restart
    for cap in ("CAP_SYS_NICE", "CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID"):  # SETUID/SETGID: jobs as their users
        assert cap in settings["CapabilityBoundingSet"] and cap in settings["AmbientCapabilities"]
    # the unit's config path and socket match the example config's defaults
    config = load_config(CONFIG)
    assert f"REAMER_SOCKET={config.socket}" in text


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    reamer_bin = Path(sys.executable).with_name("reamer")
    if not reamer_bin.exists():
        pytest.skip(f"the reamer entry point is not installed next to {sys.executable}")
    # verify checks that ExecStart exists: point it at this checkout's entry point
    unit = tmp_path / "reamer.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/reamer", str(reamer_bin)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if "reamer.service" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr
