"""Smoke run of bench/serving_cost.py on the tiny model: a real job, real cpu accounting of its processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench puts one instance on each of two cpus")
def test_serving_cost_accounts_the_front_door_the_instances_and_the_client(tmp_path):
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, "-m", "bench.serving_cost", "--model", "tiny", "--rate", "100",
                           "--seconds", "2", "--model-dir", str(tmp_path / "models"), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["answered"] == figures["sent"] > 100
    # every process did work for the requests: the instances ran them, the front door parsed and routed them
    assert figures["inference_alone_ms"] > 0 and figures["instances_ms"] > 0 and figures["frontdoor_ms"] > 0
    assert figures["client_ms"] > 0
    assert "serving beside the inference" in proc.stdout
