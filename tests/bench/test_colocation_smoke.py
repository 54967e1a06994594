"""Smoke run of the co-location bench: every strategy runs for real and yields metrics and plots."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_root

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ("training_alone", "inference_alone", "shared", "no_consolidation", "gang", "reamer", "reamer_idle")


def _bench_cgroups() -> set[str]:
    found = set()
    for controller in ("cpu", "cpuset", "freezer"):
        base = Path("/sys/fs/cgroup", controller)
        if base.is_dir():
            found |= {f"{controller}/{d.name}" for d in base.iterdir() if d.name.startswith("reamer-bench-")}
    return found


@needs_root
@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench needs two cpus (training and online)")
@pytest.mark.skipif(not Path("/sys/fs/cgroup/freezer").is_dir(), reason="needs the cgroup v1 freezer (gang strategy)")
def test_quick_run_measures_every_strategy(tmp_path):
    before = _bench_cgroups()
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# results\n\nkept by other benches\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.colocation", "--quick", "--duration", "2", "--out", str(tmp_path / "out"),
         "--results-md", str(results_md)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "colocation.json").read_text())
    summary = data["summary"]
    assert set(summary) == set(STRATEGIES)

    for name in ("training_alone", "shared", "no_consolidation", "gang", "reamer", "reamer_idle"):
        assert summary[name]["iterations"] > 0, name
        assert math.isfinite(summary[name]["iteration_median_ms"]["median"]), name
    for name in ("inference_alone", "shared", "no_consolidation", "gang", "reamer", "reamer_idle"):
        entry = summary[name]
        assert entry["requests"] > 0, name
        assert entry["failed"] < entry["requests"], name  # requests went through the HTTP server
        assert math.isfinite(entry["p99_ms"]["median"]), name
        assert math.isfinite(entry["offline_rps"]["median"]) and entry["offline_rps"]["median"] > 0, name
    for name in ("shared", "gang", "reamer", "reamer_idle"):
        assert summary[name]["offline_cpu_on_training_per_s"]["median"] >= 0, name

    # the mechanisms really applied: reamer's training threads are SCHED_RR, reamer_idle's offline SCHED_IDLE
    assert set(summary["reamer"]["training_policies"]) == {"rr"}
    assert summary["reamer"]["rt_runtime_us"] > 0
    assert set(summary["shared"]["training_policies"]) == {"other"}
    phases = {p["strategy"]: p for p in data["phases"]}
    assert set(phases["reamer_idle"]["offline_policies"]) == {"idle"}
    if data["config"]["server"] == "job":  # reamer's own job runner served the online requests
        assert phases["reamer"]["server_status"]["requests"] > 0

    for png in ("latency_cdf.png", "training_slowdown.png", "offline_throughput.png"):
        path = tmp_path / "out" / png
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    text = results_md.read_text()
    assert "kept by other benches" in text
    assert "## Co-location: training + online + offline inference" in text and "Smoke run" in text
    assert "| reamer (SCHED_RR) |" in text

    assert _bench_cgroups() <= before  # the bench removed its cgroups
