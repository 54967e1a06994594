"""Smoke run of the serving-overhead bench on the tiny model: every part measures something real."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Serving overhead (issue 3)"


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench needs two cpus (front door and instance)")
def test_quick_run_measures_offline_online_and_the_openvino_hint(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# results\n\n## Other bench\n\nkept as it is\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serving_overhead", "--quick", "--models", "tiny", "--out", str(tmp_path / "out"),
         "--results-md", str(results_md)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "serving_overhead.json").read_text())

    assert set(data["offline"]) == {"tiny/onnxruntime/2x1:b1", "tiny/openvino/2x1:b1"}
    for entry in data["offline"].values():
        assert entry["bare_median"] > 0 and entry["reamer_median"] > 0
        assert math.isfinite(entry["ratio_median"])
    online = data["online"]["tiny"]["median"]
    # HTTP and the hop to the instance can never beat a direct call over a pipe
    assert 0 < online["direct_noncompute_p50_ms"] < online["http_noncompute_p50_ms"]
    assert 0 < online["direct_p50_ms"] < online["tritonclient_p50_ms"]
    assert 0 < online["in_job_p50_ms"] < online["http_p50_ms"]
    # nor can it beat the least a TCP server does (tensor bytes in, output bytes out)
    assert 0 < online["direct_tcp_noncompute_p50_ms"] < online["http_noncompute_p50_ms"]
    assert online["overhead_ms"] == pytest.approx(online["http_noncompute_p50_ms"]
                                                  - online["direct_tcp_noncompute_p50_ms"])
    assert online["overhead_vs_pipe_ms"] == pytest.approx(online["http_noncompute_p50_ms"]
                                                          - online["direct_noncompute_p50_ms"])
    hint = data["ov_compare"]["tiny"]
    assert hint["ov_hint_median"] > 0 and hint["streams"] >= 1
    assert set(hint["reamer_best"]) == {"onnxruntime", "openvino"}

    text = results_md.read_text()
    assert "## Other bench\n\nkept as it is" in text
    assert text.count(HEADING) == 1
    section = text.split(HEADING, 1)[1]
    assert "tiny/onnxruntime/2x1:b1" in section and "load average" in section
