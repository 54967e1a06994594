"""`reamer demo` end to end (real agent, cgroups, SCHED_RR, ONNX Runtime, HTTP load), and that it
leaves nothing behind."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from reamer.cli.main import cli
from tests.conftest import needs_root


def test_demo_without_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    result = CliRunner().invoke(cli, ["demo", "--duration", "5"])
    assert result.exit_code == 1
    assert "error: reamer demo needs root" in result.output
    assert "fix: run it as root" in result.output


def leftovers(cgroup_name: str, workdir: str) -> tuple[list[str], list[int]]:
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{cgroup_name}")] + \
              [str(p) for p in Path("/sys/fs/cgroup").glob(cgroup_name)]
    procs = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(workdir in arg for arg in proc.info["cmdline"] or []):
                procs.append(proc.pid)
        except psutil.Error:
            continue
    return cgroups, procs


@needs_root
@pytest.mark.slow
@pytest.mark.root
def test_demo_runs_and_cleans_up():
    rt = Path("/proc/sys/kernel/sched_rt_runtime_us").read_text().strip()
    if rt == "-1":
        pytest.skip("RT throttling is off on this machine; the demo refuses to use SCHED_RR then")
    proc = subprocess.run([sys.executable, "-m", "reamer.cli.main", "demo", "--duration", "15"],
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    match = re.search(r"work directory (\S+); cgroup (\S+)", out)
    assert match, out
    workdir, cgroup_name = match.groups()
    cgroups, procs = leftovers(cgroup_name, workdir)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "=== reamer demo summary ===" in out
    summary = out[out.index("=== reamer demo summary ==="):]
    assert re.search(r"training: +\d+ iterations while co-located", summary), summary
    iterations = int(re.search(r"training: +(\d+) iterations", summary).group(1))
    assert iterations > 0
    online = re.search(r"online, clients: +whole run, from each request's scheduled send to its answer: "
                       r"(\d+)/(\d+) ok at 20 rps, p50 [\d.]+ ms, p99 [\d.]+ ms, [\d.]+% within", summary)
    assert online, summary
    assert int(online.group(2)) > 0 and int(online.group(1)) > 0
    # the job's own figures, as the live tables showed them, say what they cover
    assert re.search(r"online, job: +(the \d+ live table\(s\) above, each over its last 10 s, from arrival at the job"
                     r"|no live table showed)", summary), summary
    assert re.search(r"offline: +\d+/400 inputs", summary), summary
    assert "removed every job, process and cgroup" in summary
    assert "--- t+" in out  # the periodic status
    assert cgroups == [] and procs == [], (cgroups, procs)
    assert not Path(workdir).exists()


@needs_root
@pytest.mark.slow
@pytest.mark.root
def test_demo_interrupted_cleans_up():
    """SIGINT in the middle (as Ctrl-C): exits cleanly and leaves no cgroup or process behind."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "reamer.cli.main", "demo", "--duration", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until training is attached: the agent, cgroups and RT exist
            lines.append(line)
            if "training attached" in line or "Traceback" in line:
                break
        out = "".join(lines)
        assert "training attached" in out, out
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=180)
        out += rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    workdir, cgroup_name = re.search(r"work directory (\S+); cgroup (\S+)", out).groups()
    assert proc.returncode == 0, out
    assert "stopped early by SIGINT" in out
    assert "Traceback" not in out
    cgroups, procs = leftovers(cgroup_name, workdir)
    assert cgroups == [] and procs == [], (cgroups, procs)


def fake_cpu_hierarchy(root: Path, root_budget: int, children: dict[str, int]) -> str:
    cpu = root / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "cpu.rt_runtime_us").write_text(f"{root_budget}\n")
    for name, budget in children.items():
        (cpu / name).mkdir()
        (cpu / name / "cpu.rt_runtime_us").write_text(f"{budget}\n")
    return str(root)


def test_demo_rt_budget_takes_what_other_cgroups_leave(tmp_path):
    from reamer.cli.demo_cmd import DEMO_RT_RUNTIME_US, rt_budget_us

    assert rt_budget_us(fake_cpu_hierarchy(tmp_path / "a", 950000, {"x": 0})) == DEMO_RT_RUNTIME_US
    assert rt_budget_us(fake_cpu_hierarchy(tmp_path / "b", 950000, {"x": 300000, "y": 500000})) == 130000


def test_demo_rt_budget_refuses_when_none_is_left(tmp_path):
    from reamer.cli.demo_cmd import rt_budget_us
    from reamer.host.errors import ReamerError

    with pytest.raises(ReamerError) as caught:
        rt_budget_us(fake_cpu_hierarchy(tmp_path, 950000, {"x": 900000}))
    assert "other cgroups hold the rest" in caught.value.message and "cpu.rt_runtime_us" in caught.value.fix


def test_demo_summary_says_what_each_figure_covers_and_agrees_with_the_tables():
    """The closing summary gives the clients' whole-run figure and, for the live tables, the job's own figures
    and the clients' over the same windows: a reader sees why 89.8 % and 95.9–99.5 % can both be true."""
    from reamer.cli.demo_cmd import LiveSample, online_summary, render_summary
    from reamer.serve.measure.loadgen import LoadResult, RequestRecord

    # 0-10 s: the start, every request late; 10-30 s: all within the 50 ms SLO
    records = [RequestRecord(t / 10, 80.0 if t < 100 else 5.0, "ok") for t in range(300)]
    load = type("Load", (), {"result": LoadResult("http://x", 10.0, 30.0, records, 30.0), "error": None})()
    samples = [LiveSample(20.0, 9.5, 0.995), LiveSample(30.0, 8.0, 0.959)]
    online = online_summary(load, None, samples)
    assert online["slo_attainment"] == pytest.approx(200 / 300)
    assert online["job_windows"]["slo_attainment"] == [0.959, 0.995]
    assert online["job_windows"]["client_slo_attainment"] == [1.0, 1.0]  # the windows the tables covered
    text = render_summary({"colocated_s": 30.0, "stopped_by": "finished", "training": {}, "online": online,
                           "offline": {}, "cleanup_problems": []})
    assert "whole run, from each request's scheduled send to its answer: 300/300 ok" in text
    assert "66.7% within the 50 ms SLO" in text
    assert ("the 2 live table(s) above, each over its last 10 s, from arrival at the job to its answer: "
            "95.9–99.5% within the SLO, p99 8.0–9.5 ms (the clients over those windows: 100.0%)") in text
