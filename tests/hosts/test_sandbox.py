"""The unit's sandboxing options leave every operation of the agent and its jobs working: cgroup writes,
SCHED_RR, perf probing, model paths and offline output directories where operators keep them (/srv,
/home, /tmp). Checked twice: a probe run under the unit's own [Service] options (systemd-run) against
the same probe run plainly, and offline inference through the real service."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.hosts.helpers import REPO, api, job_evidence, sh, tiny_model, wait_for

pytestmark = pytest.mark.profiles("v1")  # the unit's options do not depend on the cgroup version; v1 has 4 cpus, so the offline job starts 3 workers, not 7
UNIT = Path("/etc/systemd/system/reamer.service")
LIFECYCLE = {"Type", "NotifyAccess", "WatchdogSec", "ExecStart", "Restart", "RestartSec", "TimeoutStopSec",
             "TimeoutStartSec", "TimeoutAbortSec", "KillMode", "RuntimeDirectory", "RuntimeDirectoryMode",
             "RuntimeDirectoryPreserve", "StateDirectory", "StateDirectoryMode", "ConfigurationDirectory",
             "Environment"}


def sandbox_options() -> list[str]:
    options, section = [], ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key = line.split("=", 1)[0]
            if key not in LIFECYCLE:
                options.append(line)
    assert options, f"no sandboxing options found in {UNIT}"
    return options


def probe(model: str, tmp_dir: str, home_dir: str, sandboxed: bool) -> dict[str, str]:
    cmd = [f"{REPO}/.venv/bin/python", str(Path(__file__).with_name("sandbox_probe.py")), model, tmp_dir, home_dir]
    if sandboxed:
        props = [arg for option in sandbox_options() for arg in ("-p", option)]
        cmd = ["systemd-run", "--wait", "--pipe", "--quiet", "--collect", f"--working-directory={REPO}",
               f"--setenv=PYTHONPATH={REPO}", *props, *cmd]
    return json.loads(sh(cmd, timeout=300, env={"PYTHONPATH": str(REPO)}).strip().splitlines()[-1])


def test_unit_options_leave_perf_rr_cgroups_and_paths_working(service):
    model = tiny_model("/home/labuser/models")
    plain = probe(model, "/tmp/lab-probe", "/home/labuser/lab-probe", sandboxed=False)
    assert plain["perf_software"] == plain["sched_rr"] == plain["cgroup"] == plain["model"] == "ok", plain
    boxed = probe(model, "/tmp/lab-probe", "/home/labuser/lab-probe", sandboxed=True)
    assert boxed == plain, f"under the unit's options: {boxed}\nplainly: {plain}"


def write_inputs(directory: Path, count: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        np.save(directory / f"in{i}.npy", np.full((1, 16), i, dtype=np.float32))


def test_offline_job_reads_from_tmp_and_writes_to_home_as_the_operator_sees_them(service):
    """One offline job (the tiny model on 3 inputs) with its model and outputs under /home and its inputs
    in /tmp: a private /tmp would hide the inputs from the agent, a read-only /home would refuse the outputs."""
    inputs, outputs = Path("/tmp/lab-offline/in"), Path("/home/labuser/lab-offline/out")
    write_inputs(inputs, 3)
    model = tiny_model("/home/labuser/models")
    api("POST", "/v1/inference-jobs", {"name": "offline-paths", "model": model, "kind": "offline",
                                       "input_dir": str(inputs), "output_dir": str(outputs), "layout": "1x1:b1"})
    try:
        job = wait_for(lambda: (j := api("GET", "/v1/inference-jobs/offline-paths"))["state"] in ("done", "failed") and j,
                       timeout=300, interval=2, what="the offline job finished")
        assert job["state"] == "done", job_evidence("offline-paths")
        found = sorted(p.name for p in outputs.glob("*.npz"))  # seen from outside the unit's namespace
        assert found == ["in0.npz", "in1.npz", "in2.npz"], found
    finally:
        api("DELETE", "/v1/inference-jobs/offline-paths")
