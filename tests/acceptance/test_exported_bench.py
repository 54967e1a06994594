"""Smoke run of the serving-overhead bench on the exported BERT, binary and JSON tensors: every figure of its
encoding table is measured (a few requests; the figures themselves are the bench's business, not a test's)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench needs two cpus (front door and instance)")
def test_bench_measures_the_exported_bert_in_json_and_binary(models_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.serving_overhead", "--models", "exported:bert", "--online-only",
         "--encodings", "binary,json", "--trials", "1", "--online-requests", "5", "--seq", "32",
         "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "REAMER_TEST_MODELS": str(models_dir)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    online = json.loads((tmp_path / "serving_overhead.json").read_text())["online"]["exported:bert"]
    assert online["inputs"]["input_ids"] == ["int64", [1, 32]]
    md = online["median"]
    for key in ("overhead_ms", "json_overhead_ms", "json_in_job_p50_ms", "tritonclient_json_p50_ms"):
        assert math.isfinite(md[key]), key
    assert md["json_p50_ms"] > 0 and md["json_in_job_p50_ms"] > 0
    assert "| exported:bert | onnxruntime | input_ids int64 [1, 32]" in done.stdout
